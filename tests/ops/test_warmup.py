"""`pagedkv.ops.warmup` readies the backend's kernels without touching the cache."""

from __future__ import annotations

import pytest
import torch

from pagedkv.ops import cpu_kernels, warmup


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_warmup_compiles_both_decode_kernels_and_leaves_the_cache_alone(dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    key_cache = torch.randn(3, 4, 2, 8, generator=gen).to(dtype)
    value_cache = torch.randn(3, 4, 2, 8, generator=gen).to(dtype)
    before = key_cache.clone(), value_cache.clone()
    warmup(key_cache, value_cache, 4)
    assert torch.equal(key_cache, before[0]) and torch.equal(value_cache, before[1])
    bits = "float32" if dtype == torch.float32 else "uint16"
    for kernel in (cpu_kernels.decode_serial, cpu_kernels.decode_parallel):
        cache_types = [str(sig[1]) for sig in kernel.signatures]
        assert any(bits in t for t in cache_types), (kernel, cache_types)


def test_warmup_with_a_backend_without_one_is_a_no_op() -> None:
    key_cache = torch.zeros(2, 4, 1, 8)
    warmup(key_cache, key_cache.clone(), 2, backend="reference")


@pytest.mark.parametrize("num_heads", [0, 3, 2.0, True])
def test_warmup_rejects_bad_num_heads(num_heads) -> None:
    key_cache = torch.zeros(2, 4, 2, 8)
    with pytest.raises(ValueError, match=r"^num_heads: expected a positive multiple"):
        warmup(key_cache, key_cache.clone(), num_heads)


def test_warmup_rejects_mismatched_caches() -> None:
    with pytest.raises(ValueError, match=r"^value_cache: expected"):
        warmup(torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 4), 2)
