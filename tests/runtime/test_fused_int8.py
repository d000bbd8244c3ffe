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
from pagedkv.ops import AttentionMetadata, cpu
from pagedkv.ops.cpu.arrays import as_numpy
from pagedkv.ops.cpu.int8 import store_row
from pagedkv.ops.quantize import quantize
from pagedkv.runtime.decode import DecoderWeights, decode_layers


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


def _tiny_step(cache: torch.Tensor, scale_pools) -> None:
    """One decode step of a one-layer stack (hidden 8, one head of 8) writing slot 1 of
    `cache`: q, k and v are the q|k|v bias, all ones."""
    sizes = {"in_norm": (8,), "qkv": (24, 8), "o_proj": (8, 8), "post_norm": (8,),
             "gate_up": (4, 8), "down": (8, 2)}  # fmt: skip
    layer = {k: torch.zeros(v) for k, v in sizes.items()}
    layer.update(qkv_bias=torch.ones(24), q_norm=None, k_norm=None)
    weights = DecoderWeights.create([layer], torch.zeros(8), torch.zeros(5, 8), 1e-6)
    plan = cpu.plan(AttentionMetadata.build([[1]], [1], [1], [1]), cache[0], 1, None)
    row, cos, sin = torch.zeros(1, 8), torch.ones(1, 4), torch.zeros(1, 4)
    decode_layers(row, cos, sin, torch.ones(1, dtype=torch.int64), weights, cache,
                  cache.clone(), plan, 1.0, scale_pools=scale_pools)  # fmt: skip


@pytest.mark.parametrize(
    ("cache_dtype", "scales", "match"),
    [
        (torch.int8, None, "scale_pools: expected the scales of the int8 pools"),
        (torch.float32, torch.float16, "scale_pools: expected None beside a torch.float32"),
        (torch.int8, torch.float32, r"scale_pools \(key\): expected contiguous float16"),
    ],
)
def test_scale_pools_that_do_not_fit_the_pools_are_refused(cache_dtype, scales, match):
    cache = torch.zeros(1, 2, 1, 1, 8, dtype=cache_dtype)
    pools = None if scales is None else (torch.zeros(1, 2, 1, 1, dtype=scales),) * 2
    with pytest.raises(ValueError, match=match):
        _tiny_step(cache, pools)


def test_a_step_writes_its_rows_scales_at_their_slots_of_the_scale_pools():
    cache = torch.zeros(1, 2, 1, 1, 8, dtype=torch.int8)
    pools = tuple(torch.zeros(1, 2, 1, 1, dtype=torch.float16) for _ in range(2))
    _tiny_step(cache, pools)
    want = torch.tensor([[[[0.0]], [[1 / 127]]]], dtype=torch.float16)  # slot 1 only
    assert torch.equal(pools[0], want) and torch.equal(pools[1], want)
    assert torch.equal(cache[0, 1], torch.full((1, 1, 8), 127, dtype=torch.int8))
