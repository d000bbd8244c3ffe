"""The oracle: paged attention in plain PyTorch, one sequence at a time.

Slow and obvious on purpose. Every other backend is tested against it, and it is tested
against dense `scaled_dot_product_attention` on the same KV held contiguously.
"""

from __future__ import annotations

import torch

from pagedkv.memory.groups import first_needed_block
from pagedkv.ops import checks
from pagedkv.ops.metadata import AttentionMetadata
from pagedkv.ops.quantize import KVScales, dequantize, quantize


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Read one sequence's keys (or values) through its block table.

    Args:
        cache: [num_blocks, block_size, num_kv_heads, head_dim].
        block_table: int [max_blocks]; only the first ceil(seq_len / block_size) are read.
        seq_len: number of tokens to return.

    Returns:
        [seq_len, num_kv_heads, head_dim], a copy in the cache's dtype.
    """
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].long()
    # (num_blocks, block_size, H, D) -> (num_blocks * block_size, H, D), then trim the tail
    return cache[blocks].flatten(0, 1)[:seq_len]


def attention_mask(
    query_len: int, seq_len: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor:
    """Bottom-right causal mask, bool [query_len, seq_len], True where attention is allowed.

    New token i sits at position seq_len - query_len + i and sees positions p with
    pos - sliding_window < p <= pos.
    """
    positions = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
    keys = torch.arange(seq_len, device=device)[None, :]
    mask = keys <= positions
    if sliding_window is not None:
        mask &= keys > positions - sliding_window
    return mask


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scales: KVScales | None = None,
) -> None:
    """Store each token's key/value row at its slot (quantized, with its scale, into an
    int8 cache); negative slots are skipped."""
    checks.check_slots_fit(slot_mapping, key_cache.shape[0] * key_cache.shape[1])
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    if scales is None:
        key_cache[blocks, offsets] = key[keep]
        value_cache[blocks, offsets] = value[keep]
        return
    for rows, cache, row_scales in zip((key, value), (key_cache, value_cache), scales, strict=True):
        cache[blocks, offsets], row_scales[blocks, offsets] = quantize(rows[keep])


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None,
    scales: KVScales | None = None,
) -> torch.Tensor:
    """Paged attention over packed sequences (the contract of `pagedkv.ops.paged_attention`).

    Computes in float32 (float64 for float64 inputs, and over an int8 cache, which it
    dequantizes first with `scales`) and returns the query's dtype. Inputs are assumed
    validated.
    """
    wide = query.dtype == torch.float64 or scales is not None
    compute_dtype = torch.float64 if wide else torch.float32
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = starts[s], starts[s + 1]
        if hi == lo:
            continue
        # (H, q, D) queries against (H, L, D) keys: KV heads repeated for GQA; blocks wholly
        # before the first query's window are never read (they may have been freed).
        start = first_needed_block(sliding_window, seq_len - (hi - lo), key_cache.shape[1])
        start *= key_cache.shape[1]
        table = block_tables[s][start // key_cache.shape[1] :]
        q = query[lo:hi].to(compute_dtype).transpose(0, 1)
        key_scales, value_scales = (None, None) if scales is None else scales
        k = _gather(key_cache, key_scales, table, seq_len - start, compute_dtype)
        v = _gather(value_cache, value_scales, table, seq_len - start, compute_dtype)
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (q @ k.transpose(1, 2)) * scale  # (H, q, L)
        mask = attention_mask(hi - lo, seq_len, sliding_window, query.device)[:, start:]
        scores = scores.masked_fill(~mask, float("-inf"))
        out[lo:hi] = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).to(query.dtype)
    return out


def _gather(
    cache: torch.Tensor,
    scales: torch.Tensor | None,
    block_table: torch.Tensor,
    seq_len: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """One sequence's rows [seq_len, num_kv_heads, head_dim] in `dtype`, dequantized where
    `scales` is given."""
    rows = gather_kv(cache, block_table, seq_len)
    if scales is None:
        return rows.to(dtype)
    return dequantize(rows, gather_kv(scales, block_table, seq_len), dtype)


def plan(
    metadata: AttentionMetadata,
    key_cache: torch.Tensor,
    num_heads: int,
    sliding_window: int | None,
) -> tuple[AttentionMetadata, int | None]:
    """Check lengths and block ids (CPU index tensors only: elsewhere it would sync)."""
    if metadata.seq_lens.is_cpu:
        tables, lens = metadata.block_tables.numpy(), metadata.seq_lens.numpy()
        num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
        starts = metadata.query_start_loc.numpy()
        checks.check_lengths(starts, lens, metadata.num_tokens, tables.shape[1] * block_size)
        for s, seq_len in enumerate(lens.tolist()):
            query_len = int(starts[s + 1] - starts[s])
            first = first_needed_block(sliding_window, seq_len - query_len, block_size)
            used = tables[s, first : -(-seq_len // block_size)]
            if ((used < 0) | (used >= num_blocks)).any():
                raise checks.bad_block(tables, lens, s, num_blocks, block_size)
    return metadata, sliding_window


def run(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: tuple[AttentionMetadata, int | None],
    scale: float,
    scales: KVScales | None = None,
) -> torch.Tensor:
    """`paged_attention` on the planned batch."""
    md, sliding_window = plan
    return paged_attention(
        query, key_cache, value_cache, md.block_tables, md.seq_lens, md.query_start_loc,
        scale=scale, sliding_window=sliding_window, scales=scales,
    )  # fmt: skip


def warmup(key_cache: torch.Tensor, value_cache: torch.Tensor, num_heads: int) -> None:
    """Nothing to compile."""
