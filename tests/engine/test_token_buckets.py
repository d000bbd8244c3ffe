"""Token buckets: every matmul of a step runs at one of a few row counts, outputs unchanged."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import make_hf_model

from pagedkv import LLM, SamplingParams
from pagedkv.engine.runner import bucket_num_tokens


@pytest.mark.parametrize("limit", [2048, 8192])
def test_buckets_cover_every_count_with_few_sizes(limit: int) -> None:
    sizes = [bucket_num_tokens(n) for n in range(limit + 1)]
    assert sizes[:9] == list(range(9)), "up to 8 rows run as they are"
    for n, size in enumerate(sizes):
        assert n <= size <= max(8, 1.25 * n), f"{n} -> {size}: at most 25 % padding"
        assert n <= 512 or size <= 1.125 * n, f"{n} -> {size}: at most 12.5 % past 512"
        assert bucket_num_tokens(size) == size, f"{size} is a bucket of its own"
    assert sizes == sorted(sizes), "monotone"
    distinct = len(set(sizes))
    doublings_past_512 = limit.bit_length() - 10
    bound = 9 + 4 * (limit.bit_length() - 4) + 4 * doublings_past_512
    assert distinct <= bound, f"{distinct} sizes up to {limit}"
    assert [bucket_num_tokens(n) for n in (9, 17, 100, 513, 1025, 1589)] == [
        10, 20, 112, 576, 1152, 1664,
    ]  # fmt: skip


def _prompts(seed: int, num: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 37))] for _ in range(num)]


def _recording_llm(model_dir, dtype: str, token_buckets: bool) -> tuple[LLM, list[int]]:
    """An LLM whose model records the row count of every forward."""
    llm = LLM(
        model_dir,
        device="cpu",
        dtype=dtype,
        num_blocks=128,
        block_size=4,
        max_num_batched_tokens=64,
        token_buckets=token_buckets,
    )
    seen: list[int] = []
    model = llm.engine.runner.model
    forward = model.forward

    def recording_forward(input_ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        seen.append(input_ids.shape[0])
        return forward(input_ids, *args, **kwargs)

    model.forward = recording_forward  # type: ignore[method-assign]
    return llm, seen


@pytest.mark.parametrize(
    ("arch", "dtype"), [("llama", "float32"), ("qwen3", "float32"), ("llama", "bfloat16")]
)
def test_greedy_and_seeded_outputs_match_with_buckets_off(tmp_path, arch: str, dtype: str) -> None:
    """Steps of 3..~200 tokens (chunked prefills beside decodes, n = 2, prompt logprobs):
    the same tokens with padded matmuls as without, and logprobs equal within rounding."""
    model_dir = make_hf_model(tmp_path, arch, seed=3)
    prompts = [{"prompt_token_ids": p} for p in _prompts(0, 7, 400)]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    seeded = SamplingParams(
        temperature=0.8, max_tokens=6, ignore_eos=True, seed=11, n=2, prompt_logprobs=2
    )
    params = [greedy, seeded] * 3 + [greedy]
    runs = {}
    for token_buckets in (True, False):
        llm, seen = _recording_llm(model_dir, dtype, token_buckets)
        runs[token_buckets] = (llm.generate(prompts, params, use_tqdm=False), seen)
    (padded, padded_rows), (plain, plain_rows) = runs[True], runs[False]
    assert padded_rows == [bucket_num_tokens(n) for n in plain_rows]
    assert padded_rows != plain_rows, "some step was padded"
    tolerance = 1e-4 if dtype == "float32" else 0.05
    for a, b in zip(padded, plain, strict=True):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert x.token_ids == y.token_ids
            for row_x, row_y in zip(x.logprobs or [], y.logprobs or [], strict=True):
                for token, logprob in row_y.items():
                    assert row_x[token] == pytest.approx(logprob, abs=tolerance)
        for row_x, row_y in zip(a.prompt_logprobs or [], b.prompt_logprobs or [], strict=True):
            assert (row_x is None) == (row_y is None)
            for token, logprob in (row_y or {}).items():
                assert row_x[token] == pytest.approx(logprob, abs=tolerance)


def test_padding_rows_write_no_kv(tmp_path) -> None:
    """A padded step writes exactly the slots an unpadded one writes, nothing else."""
    model_dir = make_hf_model(tmp_path, "llama", seed=4)
    caches = []
    for token_buckets in (True, False):
        llm = LLM(
            model_dir,
            device="cpu",
            num_blocks=32,
            block_size=4,
            token_buckets=token_buckets,
            enable_prefix_caching=False,
        )
        llm.generate(
            [{"prompt_token_ids": list(range(5, 16))}],  # 11 tokens: padded to 12
            SamplingParams(temperature=0, max_tokens=1),
            use_tqdm=False,
        )
        caches.append(llm.engine.runner.kv_cache.key_caches[0].clone())
    padded, plain = caches
    written = plain.abs().sum(dim=(1, 2, 3)) > 0
    assert int(written.sum()) == 3, "11 tokens fill three blocks of 4"
    assert torch.equal(padded.abs().sum(dim=(1, 2, 3)) > 0, written)
    torch.testing.assert_close(padded, plain, rtol=1e-5, atol=1e-5)
