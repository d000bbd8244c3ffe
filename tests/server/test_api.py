"""The OpenAI-compatible server through the official `openai` client, on a real engine."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from live_server import MODEL_NAME

PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _complete(client, **kwargs):
    args = dict(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=12, seed=7, extra_body={"ignore_eos": True}
    )
    args.update(kwargs)
    return client.completions.create(**args)


def _streamed_completion(client, **kwargs) -> tuple[dict[int, str], dict[int, str | None]]:
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    for chunk in _complete(client, stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
    return texts, reasons


def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_completion_n2_usage(client):
    result = _complete(client, n=2, temperature=1.0)
    assert sorted(c.index for c in result.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in result.choices)
    assert result.usage.completion_tokens == 2 * 12
    assert result.usage.prompt_tokens > 5
    assert result.usage.total_tokens == result.usage.prompt_tokens + 24
    # Seeded samples differ from each other but repeat exactly.
    again = _complete(client, n=2, temperature=1.0)
    assert [c.text for c in again.choices] == [c.text for c in result.choices]


def test_token_id_prompt_and_batch(client):
    single = _complete(client, prompt=[1, 40, 41, 42], temperature=0.0)
    batch = _complete(client, prompt=[[1, 40, 41, 42], [1, 50, 51]], temperature=0.0, n=2)
    assert len(batch.choices) == 4
    by_index = {c.index: c.text for c in batch.choices}
    assert by_index[0] == by_index[1] == single.choices[0].text  # greedy: n copies
    assert batch.usage.prompt_tokens == 7


def test_streamed_equals_unstreamed(client):
    whole = _complete(client, n=2, temperature=0.8, max_tokens=20)
    texts, reasons = _streamed_completion(client, n=2, temperature=0.8, max_tokens=20)
    assert texts == {c.index: c.text for c in whole.choices}
    assert reasons == {c.index: c.finish_reason for c in whole.choices}


def test_stop_string(client):
    full = _complete(client, temperature=0.0, max_tokens=24).choices[0].text
    assert len(full) > 8, "the tiny model should produce some text"
    stop = full[4:7]
    expected = full[: full.index(stop)]
    stopped = _complete(client, temperature=0.0, max_tokens=24, stop=[stop, "\x00never"])
    assert stopped.choices[0].text == expected
    assert stopped.choices[0].finish_reason == "stop"
    texts, reasons = _streamed_completion(client, temperature=0.0, max_tokens=24, stop=stop)
    assert texts == {0: expected} and reasons == {0: "stop"}


def test_completion_logprobs(client):
    result = _complete(client, logprobs=3, temperature=1.0)
    lp = result.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    assert all(x <= 0.0 for x in lp.token_logprobs)
    assert all(1 <= len(top) <= 4 for top in lp.top_logprobs)
    # The sampled token's logprob appears among the alternatives when it ranks in the top 3.
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    streamed = [
        c.choices[0].logprobs
        for c in _complete(client, logprobs=3, stream=True)
        if c.choices and c.choices[0].logprobs
    ]
    assert [x for part in streamed for x in part.token_logprobs] == pytest.approx(lp.token_logprobs)


def test_chat_streamed_and_not(client):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hello."},
    ]
    args = dict(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=10,
        seed=3,
        temperature=0.9,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**args, logprobs=True, top_logprobs=2)
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert len(choice.logprobs.content) == whole.usage.completion_tokens == 10
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    chunks = list(
        client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices


def test_sixteen_concurrent_streams(server):
    async def run() -> tuple[list[str], list[str]]:
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)

        async def one(i: int, stream: bool) -> str:
            args = dict(
                model=MODEL_NAME,
                prompt=f"{PROMPT} {i}",
                max_tokens=16,
                seed=i,
                extra_body={"ignore_eos": True},
            )
            if not stream:
                return (await aclient.completions.create(**args)).choices[0].text
            parts = []
            async for chunk in await aclient.completions.create(**args, stream=True):
                parts.extend(c.text for c in chunk.choices)
            return "".join(parts)

        streamed = await asyncio.gather(*(one(i, True) for i in range(16)))
        whole = await asyncio.gather(*(one(i, False) for i in range(16)))
        await aclient.close()
        return list(streamed), list(whole)

    streamed, whole = asyncio.run(run())
    assert streamed == whole
    assert len(set(whole)) > 1
    metrics = server.wait_all_blocks_free()
    assert metrics["pagedkv_kv_blocks_used"] == 0
    assert metrics["pagedkv_time_to_first_token_seconds_count"] >= 32


def test_metrics_names(server):
    metrics = server.metrics()
    names = {k.split("{")[0] for k in metrics}
    for name in (
        "pagedkv_num_requests_running",
        "pagedkv_num_requests_waiting",
        "pagedkv_kv_blocks_used",
        "pagedkv_kv_blocks_free",
        "pagedkv_kv_blocks_cached",
        "pagedkv_kv_blocks_total",
        "pagedkv_prefix_cache_hit_rate",
        "pagedkv_num_preemptions_total",
        "pagedkv_prompt_tokens_total",
        "pagedkv_generation_tokens_total",
        "pagedkv_time_to_first_token_seconds_count",
        "pagedkv_inter_token_latency_seconds_count",
    ):
        assert name in names, name
    assert all(name.startswith("pagedkv_") for name in names), names
    assert metrics["pagedkv_kv_blocks_total"] == 128
    assert metrics["pagedkv_generation_tokens_total"] > 0
