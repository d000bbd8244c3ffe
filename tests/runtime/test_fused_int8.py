"""The compiled decoder stack over an int8 cache: the layer executor's logits and cache
bytes, and its quantization of a row byte for byte as `pagedkv.ops.quantize`'s."""

from __future__ import annotations

import pytest
import torch
from helpers import make_hf_model
from helpers.paged_batch import PagedBatch, prompt
from numba import njit

from pagedkv.models import load_model
from pagedkv.models.fused_executor import FusedDecodeExecutor
from pagedkv.ops.cpu.arrays import as_numpy
from pagedkv.ops.cpu.int8 import store_row
from pagedkv.ops.quantize import quantize


@njit
def _store_rows(cache, scales, rows):  # pragma: no cover
    for t in range(rows.shape[0]):
        for g in range(rows.shape[1]):
            store_row(cache, scales, t, g, rows[t, g])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_quantization_writes_the_bytes_of_quantize(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(40, 3, 64, generator=gen) * torch.rand(40, 3, 1, generator=gen) * 8
    rows[3, 2] = 0.0
    rows[5, 0, 7] = 1e-30  # a scale that rounds to 0 in float16
    rows = rows.to(dtype)
    cache = torch.zeros(40, 3, 64, dtype=torch.int8)
    scales = torch.zeros(40, 3, dtype=torch.float16)
    _store_rows(cache.numpy(), as_numpy(scales), as_numpy(rows))
    data, want = quantize(rows)
    assert torch.equal(cache, data) and torch.equal(scales, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_int8_decode_steps_match_layer_by_layer(tmp_path, dtype):
    model_dir = make_hf_model(tmp_path, "qwen3")
    plain, fused = (load_model(model_dir, dtype=dtype) for _ in range(2))
    plain.use_cpu_runtime(fused_decode=False, onednn=False)
    assert fused.use_cpu_runtime(fused_decode=True, onednn=False)
    assert isinstance(fused.executor, FusedDecodeExecutor)
    batches = [PagedBatch(m, seed=3, cache_dtype=torch.int8) for m in (plain, fused)]
    prompts = {0: prompt(13, seed=5), 1: prompt(21, seed=6)}
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for _ in range(6):  # a prefill, then decodes across block ends
        logits = [b.step(m, prompts) for b, m in zip(batches, (plain, fused), strict=True)]
        for a, b in zip(*logits, strict=True):
            torch.testing.assert_close(b, a, **tol)
        caches = [b.cache for b in batches]
        for pool in ("key_pool", "value_pool"):
            # rows rounded one int8 step apart at most (their float inputs differ by rounding)
            diff = getattr(caches[1], pool).int() - getattr(caches[0], pool).int()
            assert diff.abs().max() <= 1 and (diff != 0).float().mean() < 0.01
        for pool in ("key_scale_pool", "value_scale_pool"):
            torch.testing.assert_close(getattr(caches[1], pool), getattr(caches[0], pool),
                                       atol=1e-3, rtol=1e-2)  # fmt: skip
        prompts = {seq: [int(out[-1].argmax())] for seq, out in enumerate(logits[0])}
    assert caches[0].key_pool.abs().sum() > 0 and caches[0].key_scale_pool.abs().sum() > 0
