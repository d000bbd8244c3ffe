"""write_kv stores each token at its slot and skips negative (padding) slots."""

from __future__ import annotations

import pytest
import torch

from pagedkv.ops import write_kv
from pagedkv.ops.reference import write_kv as reference_write_kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_write_kv_places_rows_and_skips_padding(dtype: torch.dtype, slot_dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    block_size, heads, dim = 5, 2, 8
    key_cache = torch.zeros(6, block_size, heads, dim, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    key = torch.randn(4, heads, dim, generator=gen).to(dtype)
    value = torch.randn(4, heads, dim, generator=gen).to(dtype)
    slots = torch.tensor([7, -1, 29, 0], dtype=slot_dtype)
    write_kv(key, value, key_cache, value_cache, slots)
    for t, slot in ((0, 7), (2, 29), (3, 0)):
        assert torch.equal(key_cache[slot // block_size, slot % block_size], key[t])
        assert torch.equal(value_cache[slot // block_size, slot % block_size], value[t])
    assert int((key_cache != 0).any(-1).any(-1).sum()) == 3
    ref_k, ref_v = torch.zeros_like(key_cache), torch.zeros_like(value_cache)
    reference_write_kv(key, value, ref_k, ref_v, slots)
    assert torch.equal(ref_k, key_cache) and torch.equal(ref_v, value_cache)


def test_write_kv_into_strided_view_and_empty_batch() -> None:
    """A non-contiguous cache view still gets the rows; zero tokens is a no-op."""
    pool = torch.zeros(2, 4, 3, 1, 4)
    key_cache, value_cache = pool[0], pool[1]
    wide = torch.zeros(4, 3, 2, 4)
    key = torch.ones(2, 1, 4)
    write_kv(key, key * 2, wide[:, :, :1], wide[:, :, 1:], torch.tensor([4, 11]))
    assert torch.equal(wide[1, 1, 0], torch.ones(4))
    assert torch.equal(wide[3, 2, 1], 2 * torch.ones(4))
    write_kv(key[:0], key[:0], key_cache, value_cache, torch.zeros(0, dtype=torch.int64))
    assert not pool.any()


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_write_kv_rejects_slot_past_the_end(backend: str) -> None:
    key_cache = torch.zeros(2, 4, 1, 8)
    key = torch.ones(2, 1, 8)
    with pytest.raises(
        ValueError, match=r"^slot_mapping: expected slots < .* = 8, got .*\[1\] = 8"
    ):
        write_kv(key, key, key_cache, key_cache.clone(), torch.tensor([7, 8]), backend=backend)
    assert not key_cache.any(), "a row written before the bad slot was found"


@pytest.mark.parametrize("heads, dim", [(1, 3), (3, 5), (2, 8)])
def test_write_kv_any_row_width_and_offset_source(heads: int, dim: int) -> None:
    """Rows copied as 8-byte words or as bytes (a float16 row of 6 or 30 bytes), from
    sources that start anywhere in their storage."""
    gen = torch.Generator().manual_seed(2)
    key_cache = torch.zeros(3, 4, heads, dim, dtype=torch.float16)
    value_cache = torch.zeros_like(key_cache)
    flat = torch.randn(1 + 2 * 3 * heads * dim, generator=gen).to(torch.float16)
    key = flat[1 : 1 + 3 * heads * dim].view(3, heads, dim)  # starts 2 bytes into its storage
    value = flat[1 + 3 * heads * dim :].view(3, heads, dim)
    write_kv(key, value, key_cache, value_cache, torch.tensor([11, 0, 5]))
    for t, slot in enumerate((11, 0, 5)):
        assert torch.equal(key_cache.view(-1, heads, dim)[slot], key[t])
        assert torch.equal(value_cache.view(-1, heads, dim)[slot], value[t])
    assert int((key_cache != 0).any(-1).any(-1).sum()) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_repeated_writes_strided_sources_and_errors(dtype: torch.dtype) -> None:
    """Writes into one pair, from a strided key with int32 slots; errors are named."""
    gen = torch.Generator().manual_seed(2)
    key_cache = torch.zeros(4, 4, 2, 8, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    write_kv(key_cache[0, :1], value_cache[0, :1], key_cache, value_cache, torch.tensor([-1]))
    # A strided key (every other token of a wider batch) and int32 slots.
    key = torch.randn(6, 2, 8, generator=gen).to(dtype)[::2]
    value = torch.randn(3, 2, 8, generator=gen).to(dtype)
    write_kv(key, value, key_cache, value_cache, torch.tensor([5, -1, 15], dtype=torch.int32))
    assert torch.equal(key_cache[1, 1], key[0]) and torch.equal(value_cache[3, 3], value[2])
    with pytest.raises(ValueError, match=r"^slot_mapping: expected slots < .* = 16, got "):
        write_kv(key, value, key_cache, value_cache, torch.tensor([0, 1, 16]))
    with pytest.raises(ValueError, match=r"^value: expected shape \[num_tokens, 2, 8\]"):
        write_kv(key, value[:, :1], key_cache, value_cache, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"^key: expected dtype"):
        write_kv(key.double(), value, key_cache, value_cache, torch.tensor([0, 1, 2]))
