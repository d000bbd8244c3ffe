"""Echo and prompt logprobs as lm-eval's `local-completions` model uses them: loglikelihoods
of batched token-id prompts equal transformers' log-softmax, prefix caching on or off."""

from __future__ import annotations

import httpx
import pytest
import torch
from live_server import MODEL_NAME, start_server

CONTEXT = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52]  # 14 tokens: 3.5 blocks of 4
CONTINUATIONS = [[60, 61, 62], [70], [80, 81, 82, 83, 84, 85]]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Per prompt, transformers' log-softmax rows [len(prompt), vocab] (float64)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        return torch.log_softmax(logits.double(), -1)

    return logprobs


def _loglikelihood_requests(url: str) -> list[dict]:
    """lm-eval's request body: context + continuation prompts, one token generated."""
    body = {
        "model": MODEL_NAME,
        "prompt": [CONTEXT + c for c in CONTINUATIONS],
        "max_tokens": 1,
        "logprobs": 1,
        "echo": True,
        "temperature": 0,
        "seed": 1234,
    }
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return sorted(response.json()["choices"], key=lambda c: c["index"])


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_loglikelihoods_equal_transformers(tiny_model_dir, reference, enable_prefix_caching):
    # 8 batched tokens a step: every prompt is prefilled in chunks.
    with start_server(
        tiny_model_dir, enable_prefix_caching=enable_prefix_caching, max_num_batched_tokens=8
    ) as live:
        first = _loglikelihood_requests(live.url)
        again = _loglikelihood_requests(live.url)  # now the shared context is cached
        hits = live.metrics()["pagedkv_prefix_cache_hits_tokens_total"]
    assert first == again
    for choice, continuation in zip(first, CONTINUATIONS, strict=True):
        prompt = CONTEXT + continuation
        logprobs = choice["logprobs"]
        assert len(logprobs["token_logprobs"]) == len(prompt) + 1  # the prompt + 1 generated
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        rows = reference(prompt)
        expected = [rows[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
        assert logprobs["token_logprobs"][1 : len(prompt)] == pytest.approx(expected, abs=2e-3)
        # lm-eval: the continuation's loglikelihood and whether greedy decoding produces it.
        ctxlen = len(CONTEXT)
        loglikelihood = sum(logprobs["token_logprobs"][ctxlen:-1])
        assert loglikelihood == pytest.approx(sum(expected[ctxlen - 1 :]), abs=2e-3)
        is_greedy = all(
            lp == max(top.values())
            for lp, top in zip(
                logprobs["token_logprobs"][ctxlen:-1],
                logprobs["top_logprobs"][ctxlen:-1],
                strict=False,
            )
        )
        greedy = all(rows[i - 1].argmax().item() == prompt[i] for i in range(ctxlen, len(prompt)))
        assert is_greedy == greedy
        assert all(len(top) in (1, 2) for top in logprobs["top_logprobs"][1:])
    if enable_prefix_caching:
        assert hits == 0, "prompt-logprob requests take no prefix-cache hits"


def test_echo_without_logprobs_and_max_tokens_zero(server):
    url = f"{server.url}/v1/completions"
    prompt = "The quick brown fox"
    body = {"model": MODEL_NAME, "prompt": prompt, "temperature": 0, "max_tokens": 4}
    plain = httpx.post(url, json=body, timeout=60).json()["choices"][0]["text"]
    echoed = httpx.post(url, json={**body, "echo": True}, timeout=60).json()
    assert echoed["choices"][0]["text"] == prompt + plain
    alone = httpx.post(url, json={**body, "echo": True, "max_tokens": 0, "logprobs": 2}).json()
    choice = alone["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == alone["usage"]["prompt_tokens"]
    assert alone["usage"]["completion_tokens"] == 0
    assert choice["logprobs"]["text_offset"][0] == 0
    assert all(len(top) in (2, 3) for top in choice["logprobs"]["top_logprobs"][1:])


def test_streamed_echo_starts_with_the_prompt(server):
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    args = dict(model=MODEL_NAME, prompt=CONTEXT, max_tokens=3, temperature=0, logprobs=1)
    whole = client.completions.create(**args, echo=True)
    chunks = list(client.completions.create(**args, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    streamed = [lp for c in chunks if c.choices for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed == whole.choices[0].logprobs.token_logprobs
    assert len(chunks[0].choices[0].logprobs.tokens) == len(CONTEXT) + 1
