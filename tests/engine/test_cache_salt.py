"""`SamplingParams(cache_salt=...)`: the same tokens, prefix-cache hits only within a salt."""

from __future__ import annotations

import pytest
from helpers import make_hf_model

from pagedkv import LLM, SamplingParams

PROMPT = [(7 * i + 3) % 250 + 2 for i in range(67)]  # eight full blocks of 8 and three tokens
NUM_CACHEABLE = 64


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    model_dir = make_hf_model(tmp_path_factory.mktemp("salt"), "llama", seed=3)
    return LLM(model_dir, device="cpu", num_blocks=128, block_size=8, max_num_batched_tokens=64)


def _run(llm: LLM, salt: str | None) -> tuple[list[int], int, int]:
    """(tokens, the request's cached tokens, the engine's prefix hits it added)."""
    hits_before = llm.stats()["prefix_cache_hits"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, cache_salt=salt)
    (output,) = llm.generate([PROMPT], params, use_tqdm=False)
    return (
        output.outputs[0].token_ids,
        output.num_cached_tokens,
        (llm.stats()["prefix_cache_hits"] - hits_before),
    )


def test_salts_share_no_prefix_and_give_the_same_tokens(llm: LLM) -> None:
    tokens_a, cached_a, hits_a = _run(llm, "tenant-a")
    tokens_b, cached_b, hits_b = _run(llm, "tenant-b")
    tokens_none, cached_none, hits_none = _run(llm, None)
    assert (cached_a, cached_b, cached_none) == (0, 0, 0)
    assert (hits_a, hits_b, hits_none) == (0, 0, 0)
    assert tokens_a == tokens_b == tokens_none
    again_a, cached_again, hits_again = _run(llm, "tenant-a")
    assert again_a == tokens_a
    assert cached_again == hits_again == NUM_CACHEABLE
    again_none = _run(llm, None)
    assert again_none == (tokens_none, NUM_CACHEABLE, NUM_CACHEABLE)


def test_cache_salt_must_be_a_non_empty_string() -> None:
    with pytest.raises(ValueError, match="cache_salt: expected a non-empty string, got ''"):
        SamplingParams(cache_salt="")
    with pytest.raises(ValueError, match="cache_salt: expected a non-empty string, got 5"):
        SamplingParams(cache_salt=5)  # type: ignore[arg-type]
