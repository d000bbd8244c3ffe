"""Prefill / mixed attention: any number of new tokens per sequence, one launch.

Grid ``(num_tokens // BLOCK_Q + num_seqs, num_kv_heads)``. Sequence s owns the
query tiles ``[qsl[s] // BLOCK_Q + s, qsl[s + 1] // BLOCK_Q + s + 1)``, a range at
least ``cdiv(q_len_s, BLOCK_Q)`` long, so the grid is sized without reading any
length on the host (no device sync); each program finds its sequence by binary
search over ``query_start_loc`` and leaves if its tile is past the sequence's end.

A program's M dimension is ``BLOCK_Q`` query tokens x ``GROUP_PAD`` query heads of
one KV head, row r = (token r // GROUP_PAD, head r % GROUP_PAD), so a decode row in
a mixed batch costs one tile of GROUP heads and a K/V tile feeds every head of the
group. Key tiles walk the block table from the first block inside the window to
the diagonal; blocks wholly outside the causal/window band are never visited.

Tiles: long prompts get 128-row tiles (8 warps, 3 stages, wgmma, 174 registers, 96 KiB
shared, no spills on sm_90 per benchmarks/triton_compile_check.py), the FlashAttention-2
shape; short chunks and decode rows get 64-row tiles. Masks cost a few integer ops per score.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.ops.triton.attend import LOG2E, attend_keys
from pagedkv.ops.triton.indexing import find_seq, scale_args


@triton.jit
def _prefill_kernel(
    query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out,
    scale_log2, window, num_seqs,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt, stride_ot, stride_oh,
    key_scales, value_scales, stride_sb, stride_st, stride_sh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_SIZE_PAD: tl.constexpr, TILE_BLOCKS: tl.constexpr, USE_WINDOW: tl.constexpr,
    FP32_DOT: tl.constexpr, QUANTIZED: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = find_seq(query_start_loc, num_seqs, pid, BLOCK_Q, True)
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    q_first = (pid - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first token of this tile
    if q_first >= q_len:
        return
    seq_len = tl.load(seq_lens + seq)
    context_len = seq_len - q_len  # tokens already cached before the new ones

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    token = q_first + rows // GROUP_PAD
    heads = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (token < q_len) & (rows % GROUP_PAD < GROUP)
    q_pos = context_len + token  # (M,) absolute position of each row's token
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    row = (q_start + token).to(tl.int64)  # row * stride can pass 2**31 in long batches
    q_offset = row[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(query + q_offset, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if not QUANTIZED:  # an int8 cache's rows are widened to the query's dtype
        q = q.to(key_cache.dtype.element_ty)  # (M, D)

    # Keys this tile can see:
    #   [key_lo, key_hi) = [first row pos - window + 1, last row pos + 1), clipped to the sequence.
    key_hi = tl.minimum(context_len + q_first + BLOCK_Q, seq_len)
    key_lo = 0
    if USE_WINDOW:
        key_lo = tl.maximum(context_len + q_first - window + 1, 0)
    m_i, l_i, acc = attend_keys(
        q, q_pos, key_cache, value_cache, block_tables + seq * stride_bt, kv_head * stride_kh,
        dims, dim_ok, (key_lo // BLOCK_SIZE) * BLOCK_SIZE, key_hi, window, scale_log2,
        stride_kb, stride_kt, key_scales, value_scales, kv_head * stride_sh, stride_sb,
        stride_st, QUANTIZED, BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD, BLOCK_SIZE, BLOCK_SIZE_PAD,
        TILE_BLOCKS, USE_WINDOW, True, FP32_DOT,
    )  # fmt: skip

    # Padding rows may have seen no key (l_i == 0); they are not stored.
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_offset = row[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(out + o_offset, o.to(out.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def prefill_meta(
    *, is_fp32: bool, group: int, head_dim: int, block_size: int, block_m: int,
    tile_blocks: int, use_window: bool, quantized: bool = False,
) -> dict:  # fmt: skip
    """Compile-time parameters and launch options of `_prefill_kernel`."""
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = triton.next_power_of_2(head_dim)
    block_size_pad = triton.next_power_of_2(block_size)
    # float32 dots run on FMA units ("ieee"), and 128-row or 128-key tiles hold twice the
    # scores: 4 warps would spill registers there (checked with ptxas for sm_90).
    lanes = tile_blocks * block_size_pad
    is_big = is_fp32 or block_m >= 128 or lanes * head_dim_pad > 64 * 128
    return dict(
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=max(1, block_m // group_pad),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size,
        BLOCK_SIZE_PAD=block_size_pad, TILE_BLOCKS=tile_blocks, USE_WINDOW=use_window,
        FP32_DOT=is_fp32, QUANTIZED=quantized, num_warps=8 if is_big else 4,
        num_stages=3 if block_m >= 128 else 2,
    )  # fmt: skip


def prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None,
    block_m: int,
    tile_blocks: int,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of every packed new token (prefill, chunked prefill, decode mixed).

    Args:
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
            sliding_window: as for `decode_attention`.
        block_m: rows per program (query tokens x padded GQA group), a power of two.
        tile_blocks: blocks per key tile.
        scales: as for `decode_attention`.

    Returns:
        [num_tokens, num_heads, head_dim] in query's dtype.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    meta = prefill_meta(
        is_fp32=query.dtype == torch.float32, group=num_heads // num_kv_heads,
        head_dim=head_dim, block_size=key_cache.shape[1], block_m=block_m,
        tile_blocks=tile_blocks, use_window=sliding_window is not None,
        quantized=scales is not None,
    )  # fmt: skip
    grid = (num_tokens // meta["BLOCK_Q"] + num_seqs, num_kv_heads)
    key_scales, value_scales, scale_strides = scale_args(key_cache, scales)
    _prefill_kernel[grid](
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out,
        scale * LOG2E, sliding_window or 0, num_seqs,
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1),
        key_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        key_scales, value_scales, *scale_strides, **meta,
    )  # fmt: skip
    return out
