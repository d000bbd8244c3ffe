"""The inner loop both attention kernels share: online softmax over paged key tiles."""

from __future__ import annotations

import triton
import triton.language as tl

from pagedkv.ops.triton.indexing import kv_tile_rows

# Scores start from a finite floor, not -inf: a row whose tile is fully masked then
# gets exp2(-inf - floor) = 0 instead of exp2(-inf + inf) = nan.
NEG_FLOOR = tl.constexpr(-1.0e30)
LOG2E = 1.4426950408889634  # the kernels take exp2 of scores scaled by scale * LOG2E


@triton.jit
def _dot(a, b, FP32_DOT: tl.constexpr):
    # float32 inputs: exact "ieee" products (the tests ask 1e-5), not the tf32 default.
    if FP32_DOT:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def attend_keys(
    q, q_pos, key_cache, value_cache, table_row, head_offset, dims, dim_ok, start, end,
    window, scale_log2, stride_kb, stride_kt, key_scales, value_scales, scale_head, stride_sb,
    stride_st, QUANTIZED: tl.constexpr,
    M: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_SIZE_PAD: tl.constexpr, TILE_BLOCKS: tl.constexpr, USE_WINDOW: tl.constexpr,
    PER_ROW_CAUSAL: tl.constexpr, FP32_DOT: tl.constexpr,
):  # fmt: skip
    """Online softmax of ``q`` (M, D) over the keys at positions [start, end).

    ``start`` is block-aligned; ``end`` bounds what is read. Key k is kept for a row
    at ``q_pos`` when ``k <= q_pos`` (PER_ROW_CAUSAL: q_pos is (M,), one per row;
    otherwise a scalar with ``end <= q_pos + 1`` already) and, with USE_WINDOW,
    ``k > q_pos - window``. With QUANTIZED the caches are int8 and each key's float16
    scale (``key_scales``/``value_scales`` at ``scale_head`` plus the block and token
    strides ``stride_sb``, ``stride_st``) multiplies its scores and its softmax weights.

    Returns:
        (running max (M,) in log2 units, sum of exp2 (M,), unnormalized output (M, D)).
    """
    m_i = tl.full([M], NEG_FLOOR, tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, HEAD_DIM_PAD], tl.float32)
    for tile_start in range(start, end, TILE_BLOCKS * BLOCK_SIZE):
        row_offset, k_pos, is_valid = kv_tile_rows(
            table_row, tile_start // BLOCK_SIZE, end, stride_kb, stride_kt,
            BLOCK_SIZE, BLOCK_SIZE_PAD, TILE_BLOCKS,
        )  # fmt: skip
        kv_offset = head_offset + row_offset[:, None] + dims[None, :]  # (N, D)
        kv_mask = is_valid[:, None] & dim_ok[None, :]
        k = tl.load(key_cache + kv_offset, mask=kv_mask, other=0.0)
        if QUANTIZED:
            scale_rows, _, _ = kv_tile_rows(
                table_row, tile_start // BLOCK_SIZE, end, stride_sb, stride_st,
                BLOCK_SIZE, BLOCK_SIZE_PAD, TILE_BLOCKS,
            )  # fmt: skip
            scale_offset = scale_head + scale_rows
            k_scale = tl.load(key_scales + scale_offset, mask=is_valid, other=0.0).to(tl.float32)
            v_scale = tl.load(value_scales + scale_offset, mask=is_valid, other=0.0)
            scores = _dot(q, tl.trans(k.to(q.dtype)), FP32_DOT) * (scale_log2 * k_scale[None, :])
        else:
            scores = _dot(q, tl.trans(k), FP32_DOT) * scale_log2  # (M, N)
        if PER_ROW_CAUSAL:
            keep = is_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
            if USE_WINDOW:
                keep = keep & (k_pos[None, :] > q_pos[:, None] - window)
        else:
            keep = is_valid[None, :]
            if USE_WINDOW:
                keep = keep & (k_pos[None, :] > q_pos - window)
        scores = tl.where(keep, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)  # rescale of what was summed under the old max
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(value_cache + kv_offset, mask=kv_mask, other=0.0)
        if QUANTIZED:
            v = v.to(q.dtype)
            p = p * v_scale.to(tl.float32)[None, :]
        if not FP32_DOT:
            p = p.to(v.dtype)
        acc = acc * alpha[:, None] + _dot(p, v, FP32_DOT)
        m_i = m_new
    return m_i, l_i, acc
