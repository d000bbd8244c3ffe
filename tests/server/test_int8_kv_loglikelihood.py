"""Multiple-choice scoring as lm-eval's `local-completions` model asks it (token-id prompts,
echo, the continuation's logprobs summed) through a server over an int8 KV cache: the same
answers as over the float cache on at least 9 of 10 questions, loglikelihoods close."""

from __future__ import annotations

import random

import httpx
from live_server import MODEL_NAME, start_server


def _questions() -> list[tuple[list[int], list[list[int]]]]:
    """10 (context, 2-4 continuations) of token ids."""
    rng = random.Random(0)
    out = []
    for _ in range(10):
        context = [1] + [rng.randrange(3, 500) for _ in range(rng.randint(6, 20))]
        choices = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 4))]
                   for _ in range(rng.randint(2, 4))]  # fmt: skip
        out.append((context, choices))
    return out


def _loglikelihoods(url: str, context: list[int], choices: list[list[int]]) -> list[float]:
    body = {"model": MODEL_NAME, "prompt": [context + c for c in choices], "max_tokens": 1,
            "logprobs": 1, "echo": True, "temperature": 0}  # fmt: skip
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    lls = []
    for choice in sorted(response.json()["choices"], key=lambda c: c["index"]):
        cont = choices[choice["index"]]
        token_logprobs = choice["logprobs"]["token_logprobs"]
        lls.append(sum(token_logprobs[len(context) : len(context) + len(cont)]))
    return lls


def _score(model_dir, **kwargs) -> list[list[float]]:
    with start_server(model_dir, max_num_seqs=8, **kwargs) as live:
        return [_loglikelihoods(live.url, *q) for q in _questions()]


def test_int8_cache_gives_the_float_cache_answers(tiny_model_dir):
    full, quantized = _score(tiny_model_dir), _score(tiny_model_dir, kv_cache_dtype="int8")
    same = sum(a.index(max(a)) == b.index(max(b)) for a, b in zip(full, quantized, strict=True))
    assert same >= 9
    diffs = [
        abs(x - y) for a, b in zip(full, quantized, strict=True) for x, y in zip(a, b, strict=True)
    ]
    assert 0 < max(diffs) < 0.1  # the int8 cache is read, and stays close
