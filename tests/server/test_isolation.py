"""Prefix-cache isolation over HTTP: `cache_salt` and `--prefix-cache-isolation per-key`.

Requests with different salts compute their whole prompt (no hit in the metrics), give the
same tokens, and answer as slowly as a prompt nobody sent before; the same salt hits.
"""

from __future__ import annotations

import random
import statistics
import time

import httpx
import pytest
from helpers import make_hf_model, make_tokenizer
from live_server import MODEL_NAME, LiveServer, start_server

from pagedkv.server.auth import AccessPolicy

BLOCK = 16
PROMPT_LEN = 1000
NUM_HIT = (PROMPT_LEN - 1) // BLOCK * BLOCK  # the last token is always computed
HITS = "pagedkv_prefix_cache_hits_tokens_total"
QUERIES = "pagedkv_prefix_cache_queries_tokens_total"
ROUNDS = 5


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(PROMPT_LEN)]


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A random Llama wide enough that a 1,000-token prefill clearly outlasts a cache hit."""
    model_dir = make_hf_model(
        tmp_path_factory.mktemp("isolation"),
        "llama",
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    )
    make_tokenizer(model_dir)
    with start_server(model_dir, block_size=BLOCK, num_blocks=1024) as live:
        yield live


def _complete(
    server: LiveServer, prompt: list[int] | str, salt: str | None, **extra
) -> tuple[list[str], float, float]:
    """(the choice's tokens, the prefix-cache hits and queries it added)."""
    before = server.metrics()
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "logprobs": 0, **extra}  # fmt: skip
    if salt is not None:
        body["cache_salt"] = salt
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    after = server.metrics()
    tokens = response.json()["choices"][0]["logprobs"]["tokens"]
    return tokens, after[HITS] - before[HITS], after[QUERIES] - before[QUERIES]


def test_different_salts_compute_the_whole_prompt_and_agree(big) -> None:
    prompt = _prompt(1)
    tokens_a, hits_a, queries_a = _complete(big, prompt, "tenant-a")
    tokens_b, hits_b, queries_b = _complete(big, prompt, "tenant-b")
    tokens_none, hits_none, _ = _complete(big, prompt, None)
    assert (hits_a, hits_b, hits_none) == (0, 0, 0)
    assert queries_a == queries_b == PROMPT_LEN
    assert tokens_a == tokens_b == tokens_none and len(tokens_a) == 8
    again, hits_again, _ = _complete(big, prompt, "tenant-a")
    assert (again, hits_again) == (tokens_a, NUM_HIT)
    assert _complete(big, prompt, None)[1] == NUM_HIT


def test_chat_takes_cache_salt(big) -> None:
    def chat(salt: str) -> float:
        before = big.metrics()[HITS]
        body = {"model": MODEL_NAME, "max_tokens": 2, "cache_salt": salt,
                "messages": [{"role": "user", "content": "tell me a story " * 40}]}  # fmt: skip
        response = httpx.post(f"{big.url}/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return big.metrics()[HITS] - before

    assert chat("chat-a") == 0
    assert chat("chat-b") == 0
    assert chat("chat-a") > 0


def test_cache_salt_is_checked(big) -> None:
    for salt, expected in (("", "at least 1 character"), (5, "expected a valid string")):
        body = {"model": MODEL_NAME, "prompt": "x", "cache_salt": salt}
        response = httpx.post(f"{big.url}/v1/completions", json=body, timeout=10)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "cache_salt" and expected in error["message"]


def _time_one(server: LiveServer, prompt: list[int], salt: str | None) -> float:
    """Seconds to the first (and only) token of one non-streamed request."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    started = time.perf_counter()
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    elapsed = time.perf_counter() - started
    assert response.status_code == 200, response.text
    return elapsed


def test_a_cross_salt_request_is_as_slow_as_a_cold_one(big) -> None:
    victim = _prompt(2)
    _time_one(big, _prompt(3), None)  # warm-up
    _time_one(big, victim, "victim")  # the victim's prompt is now cached under its salt
    times: dict[str, list[float]] = {"hit": [], "cross": [], "cold": []}
    before = big.metrics()[HITS]
    for i in range(ROUNDS):
        order = ["hit", "cross", "cold"] if i % 2 else ["cold", "cross", "hit"]
        for kind in order:
            if kind == "hit":
                times[kind].append(_time_one(big, victim, "victim"))
            elif kind == "cross":  # the victim's prompt under a salt never used before
                times[kind].append(_time_one(big, victim, f"attacker-{i}"))
            else:  # a prompt nobody sent before
                times[kind].append(_time_one(big, _prompt(100 + i), None))
    # Only the victim's own requests hit: the engine computed every other prompt in full.
    assert big.metrics()[HITS] - before == ROUNDS * NUM_HIT
    hit, cross, cold = (statistics.median(times[k]) for k in ("hit", "cross", "cold"))
    summary = f"medians: hit {hit:.3f}s, cross-salt {cross:.3f}s, cold {cold:.3f}s"
    assert hit < 0.5 * cold, f"a hit should be clearly faster, or nothing is measured; {summary}"
    assert cross > 0.7 * cold, f"a cross-salt request must not be faster than cold; {summary}"
    assert cross > 1.5 * hit, summary


def test_per_key_isolation(tiny_model_dir) -> None:
    keys = ("tenant-key-one", "tenant-key-two")
    access = AccessPolicy(api_keys=keys, isolate_per_key=True)
    prompt = list(range(10, 60))  # twelve full blocks of 4 and two tokens
    num_hit = 48
    with start_server(tiny_model_dir, app_kwargs={"access": access}) as live:
        auth = [{"Authorization": f"Bearer {key}"} for key in keys]

        def hits(who: int, salt: str | None = None) -> float:
            before = live.metrics(auth[0])[HITS]
            body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0}
            if salt is not None:
                body["cache_salt"] = salt
            response = httpx.post(
                f"{live.url}/v1/completions", json=body, headers=auth[who], timeout=60
            )
            assert response.status_code == 200, response.text
            return live.metrics(auth[0])[HITS] - before

        assert hits(0) == 0
        assert hits(1) == 0  # another key: its own cache
        assert hits(0) == num_hit
        assert hits(1, "shared") == 0  # a salt partitions a key's cache further
        assert hits(0, "shared") == 0  # and the same salt under another key shares nothing
        assert hits(1, "shared") == num_hit
        assert hits(1) == num_hit
