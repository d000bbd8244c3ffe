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

Expected speed on an H200 (bf16, head_dim 128, long prompts; not measured in this
session): 64 x 64 tiles with 4 warps on mma.sync reach roughly 40-55 % of dense
tensor-core peak, about what a FlashAttention-2-style Triton kernel gets before
warp specialization; the masks cost a few integer ops per score.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.ops.triton.indexing import find_seq, kv_tile_rows

_LOG2E = 1.4426950408889634
_NEG_FLOOR = tl.constexpr(-1.0e30)  # finite start for the running max (see decode.py)


@triton.jit
def _prefill_kernel(
    query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out,
    scale_log2, window, num_seqs,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_SIZE_PAD: tl.constexpr, TILE_BLOCKS: tl.constexpr, USE_WINDOW: tl.constexpr,
    FP32_DOT: tl.constexpr,
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
    q_offset = (q_start + token)[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(query + q_offset, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q = q.to(key_cache.dtype.element_ty)  # (M, D)

    # Keys this tile can see:
    #   [key_lo, key_hi) = [first row pos - window + 1, last row pos + 1), clipped to the sequence.
    key_hi = tl.minimum(context_len + q_first + BLOCK_Q, seq_len)
    key_lo = 0
    if USE_WINDOW:
        key_lo = tl.maximum(context_len + q_first - window + 1, 0)
    m_i = tl.full([BLOCK_Q * GROUP_PAD], _NEG_FLOOR, tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    table_row = block_tables + seq * stride_bt
    head_offset = kv_head * stride_kh
    for tile_start in range((key_lo // BLOCK_SIZE) * BLOCK_SIZE, key_hi, TILE_BLOCKS * BLOCK_SIZE):
        row_offset, k_pos, is_valid = kv_tile_rows(
            table_row, tile_start // BLOCK_SIZE, key_hi, stride_kb, stride_kt,
            BLOCK_SIZE, BLOCK_SIZE_PAD, TILE_BLOCKS,
        )  # fmt: skip
        kv_offset = head_offset + row_offset[:, None] + dims[None, :]  # (N, D)
        kv_mask = is_valid[:, None] & dim_ok[None, :]
        k = tl.load(key_cache + kv_offset, mask=kv_mask, other=0.0)
        if FP32_DOT:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        keep = is_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])  # (M, N) causal
        if USE_WINDOW:
            keep = keep & (k_pos[None, :] > q_pos[:, None] - window)
        scores = tl.where(keep, scores * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(value_cache + kv_offset, mask=kv_mask, other=0.0)
        if FP32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # Padding rows may have seen no key (l_i == 0); they are not stored.
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_offset = (q_start + token)[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(out + o_offset, o.to(out.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def prefill_meta(
    *, is_fp32: bool, group: int, head_dim: int, block_size: int, block_m: int,
    tile_blocks: int, use_window: bool,
) -> dict:  # fmt: skip
    """Compile-time parameters and launch options of `_prefill_kernel`."""
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = triton.next_power_of_2(head_dim)
    block_size_pad = triton.next_power_of_2(block_size)
    # float32 dots run on FMA units ("ieee") and tiles of 128+ keys hold twice the
    # scores: 4 warps would spill registers there (checked with ptxas for sm_90).
    is_big = is_fp32 or tile_blocks * block_size_pad * head_dim_pad > 64 * 128
    return dict(
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=max(1, block_m // group_pad),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size,
        BLOCK_SIZE_PAD=block_size_pad, TILE_BLOCKS=tile_blocks, USE_WINDOW=use_window,
        FP32_DOT=is_fp32, num_warps=8 if is_big else 4, num_stages=2,
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
) -> torch.Tensor:
    """Causal attention of every packed new token (prefill, chunked prefill, decode mixed).

    Args:
        query: [num_tokens, num_heads, head_dim], float16 | bfloat16 | float32.
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], equal strides.
        block_tables: [num_seqs, max_blocks] int32.  seq_lens: [num_seqs] int32.
        query_start_loc: [num_seqs + 1] int32, cumulative new-token counts.
        scale: softmax scale.  sliding_window: window in tokens, or None.
        block_m: rows per program (query tokens x padded GQA group), a power of two.
        tile_blocks: blocks per key tile.

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
    )  # fmt: skip
    grid = (num_tokens // meta["BLOCK_Q"] + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out,
        scale * _LOG2E, sliding_window or 0, num_seqs,
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1),
        key_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1), **meta,
    )  # fmt: skip
    return out
