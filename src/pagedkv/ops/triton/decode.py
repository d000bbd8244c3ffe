"""Decode attention (one new token per sequence) as flash-decoding over a paged cache.

Grid ``(num_tokens, num_kv_heads, num_partitions)``: each program reads one
partition of one row's context for one KV head and computes all query heads of
that KV head's GQA group at once (the group is the M dimension of ``tl.dot``), so
every K/V row is read from HBM once per step. With more than one partition, each
program writes a partial (running max, sum, unnormalized output) and
``_reduce_kernel`` merges them.

The kernel's time against SDPA on contiguous KV and its share of the HBM bandwidth are in
docs/benchmarks.md (Triton section): it reaches neither SDPA nor the bandwidth yet except on
long single sequences, where the split across partitions pays. `benchmarks/tune_triton.py`
sweeps the launch configuration and locates the per-call fixed cost.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.ops.triton.attend import LOG2E, NEG_FLOOR, attend_keys
from pagedkv.ops.triton.indexing import find_seq, scale_args


@triton.jit
def _decode_kernel(
    query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out,
    part_max, part_sum, part_acc, scale_log2, window, partition_size, num_seqs, max_parts,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt, stride_ot, stride_oh,
    key_scales, value_scales, stride_sb, stride_st, stride_sh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_SIZE_PAD: tl.constexpr,
    TILE_BLOCKS: tl.constexpr, USE_WINDOW: tl.constexpr, IS_SPLIT: tl.constexpr,
    FP32_DOT: tl.constexpr, QUANTIZED: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)  # one query row
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    # Row r belongs to sequence r when every sequence has one new token; otherwise (some
    # have none) search for it. Both ways end with qsl[seq] <= token < qsl[seq + 1].
    seq = tl.minimum(token, num_seqs - 1)
    q_start = tl.load(query_start_loc + seq)
    if (q_start != token) | (tl.load(query_start_loc + seq + 1) != token + 1):
        seq = find_seq(query_start_loc, num_seqs, token, 1, False)
        q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    seq_len = tl.load(seq_lens + seq)
    pos = seq_len - q_len + (token - q_start)  # this token's position
    # The partition grid starts at the block holding the first key the token sees:
    #   |<- part 0 ->|<- part 1 ->| ...      partition_size tokens each, block-aligned
    #   ^ (key_lo // BLOCK_SIZE) * BLOCK_SIZE                  keys end at pos (incl.)
    key_lo = 0
    if USE_WINDOW:
        key_lo = tl.maximum(pos - window + 1, 0)
    start = (key_lo // BLOCK_SIZE) * BLOCK_SIZE + part * partition_size

    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    row = token.to(tl.int64)  # row * stride and the partial slots can pass 2**31
    q = tl.load(
        query + row * stride_qt + heads[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )  # (GROUP_PAD, D)
    if not QUANTIZED:  # an int8 cache's rows are widened to the query's dtype
        q = q.to(key_cache.dtype.element_ty)
    m_i, l_i, acc = attend_keys(
        q, pos, key_cache, value_cache, block_tables + seq * stride_bt, kv_head * stride_kh,
        dims, dim_ok, start, tl.minimum(start + partition_size, pos + 1), window, scale_log2,
        stride_kb, stride_kt, key_scales, value_scales, kv_head * stride_sh, stride_sb,
        stride_st, QUANTIZED, GROUP_PAD, HEAD_DIM_PAD, BLOCK_SIZE, BLOCK_SIZE_PAD,
        TILE_BLOCKS, USE_WINDOW, False, FP32_DOT,
    )  # fmt: skip
    if IS_SPLIT:
        # Every partition writes, empty ones too (max = floor, sum = 0): the reduce then
        # merges all max_parts entries of a row without knowing its sequence.
        # Layout: [num_tokens, num_heads, max_parts] (+ [HEAD_DIM_PAD] for acc).
        slot = (row * tl.num_programs(1) * GROUP + heads) * max_parts + part
        tl.store(part_max + slot, m_i, mask=row_ok)
        tl.store(part_sum + slot, l_i, mask=row_ok)
        tl.store(part_acc + slot[:, None] * HEAD_DIM_PAD + dims[None, :], acc, mask=row_ok[:, None])
    else:
        o = acc / l_i[:, None]  # l_i > 0: the single partition holds pos itself
        tl.store(
            out + row * stride_ot + heads[:, None] * stride_oh + dims[None, :],
            o.to(out.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )


@triton.jit
def _reduce_kernel(
    out, part_max, part_sum, part_acc, max_parts, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PARTS_PAD: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    parts = tl.arange(0, PARTS_PAD)
    part_ok = parts < max_parts
    base = (token * tl.num_programs(1) + head) * max_parts
    m = tl.load(part_max + base + parts, mask=part_ok, other=NEG_FLOOR)
    l = tl.load(part_sum + base + parts, mask=part_ok, other=0.0)  # noqa: E741
    weight = tl.exp2(m - tl.max(m, 0))  # 0 for empty partitions (max = floor, sum = 0)
    dims = tl.arange(0, HEAD_DIM_PAD)
    acc = tl.load(
        part_acc + (base + parts)[:, None] * HEAD_DIM_PAD + dims[None, :],
        mask=part_ok[:, None],
        other=0.0,
    )  # (PARTS_PAD, D)
    o = tl.sum(acc * weight[:, None], 0) / tl.sum(l * weight, 0)
    tl.store(
        out + token * stride_ot + head * stride_oh + dims,
        o.to(out.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


def decode_meta(
    *, is_fp32: bool, group: int, head_dim: int, block_size: int, tile_blocks: int,
    use_window: bool, is_split: bool, quantized: bool = False,
) -> dict:  # fmt: skip
    """Compile-time parameters and launch options of `_decode_kernel`."""
    block_size_pad = triton.next_power_of_2(block_size)
    # float32 dots run on FMA units with operands in registers: tiles of 128+ keys
    # spill with 4 warps (ptxas, sm_90).
    is_big = is_fp32 and tile_blocks * block_size_pad > 64
    return dict(
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),  # tl.dot needs M >= 16
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
        BLOCK_SIZE_PAD=block_size_pad, TILE_BLOCKS=tile_blocks, USE_WINDOW=use_window,
        IS_SPLIT=is_split, FP32_DOT=is_fp32, QUANTIZED=quantized,
        # One tile of K and V in flight while the previous one is multiplied (ptxas, sm_90,
        # bf16/d128/bs16: 39 KiB shared, 94 registers, so 5 programs per SM).
        num_warps=8 if is_big else 4, num_stages=3,
    )  # fmt: skip


def reduce_meta(*, head_dim: int, num_parts: int) -> dict:
    """Compile-time parameters and launch options of `_reduce_kernel`."""
    return dict(
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        PARTS_PAD=triton.next_power_of_2(num_parts), num_warps=4,
    )  # fmt: skip


def decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None,
    max_span: int,
    partition_size: int,
    tile_blocks: int,
    meta: dict | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention for batches of (mostly) one new token per sequence, one program per row.

    Built for q_len == 1 (row s is sequence s); rows of a sequence with q_len > 1 next to
    sequences with none are found by binary search and stay exact, each rereading its KV.

    Args:
        query: [num_tokens, num_heads, head_dim], float16 | bfloat16 | float32.
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], equal strides.
        block_tables: [num_seqs, max_blocks] int32.  seq_lens: [num_seqs] int32.
        query_start_loc: [num_seqs + 1] int32.
        scale: softmax scale.  sliding_window: window in tokens, or None.
        max_span: bound on any row's key range, from the block holding its first
            visible key to its own position (sizes the partition grid; no device read).
        partition_size: tokens per program, a multiple of ``tile_blocks * block_size``;
            ``>= max_span`` disables the split and the reduce launch.
        tile_blocks: blocks per key tile.
        meta: launch options merged over `decode_meta`'s, e.g. ``{"num_warps": 8,
            "num_stages": 2}`` (benchmarks/tune_triton.py); None in normal use.
        scales: (key_scales, value_scales) [num_blocks, block_size, num_kv_heads] float16
            of int8 caches (equal strides), else None.

    Returns:
        [num_tokens, num_heads, head_dim] in query's dtype.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    num_parts = max(1, triton.cdiv(max_span, partition_size))
    is_split = num_parts > 1
    if is_split:
        head_dim_pad = triton.next_power_of_2(head_dim)
        part_max = torch.empty(num_tokens, num_heads, num_parts, dtype=torch.float32,
                               device=query.device)  # fmt: skip
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty(num_tokens, num_heads, num_parts, head_dim_pad,
                               dtype=torch.float32, device=query.device)  # fmt: skip
    else:
        part_max = part_sum = part_acc = out  # unused by the kernel when IS_SPLIT is false
    options = decode_meta(
        is_fp32=query.dtype == torch.float32, group=num_heads // num_kv_heads,
        head_dim=head_dim, block_size=key_cache.shape[1], tile_blocks=tile_blocks,
        use_window=sliding_window is not None, is_split=is_split, quantized=scales is not None,
    ) | (meta or {})  # fmt: skip
    key_scales, value_scales, scale_strides = scale_args(key_cache, scales)
    _decode_kernel[(num_tokens, num_kv_heads, num_parts)](
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out,
        part_max, part_sum, part_acc, scale * LOG2E, sliding_window or 0, partition_size,
        seq_lens.shape[0], num_parts, query.stride(0), query.stride(1), key_cache.stride(0),
        key_cache.stride(1), key_cache.stride(2), block_tables.stride(0), out.stride(0),
        out.stride(1), key_scales, value_scales, *scale_strides, **options,
    )  # fmt: skip
    if is_split:
        _reduce_kernel[(num_tokens, num_heads)](
            out, part_max, part_sum, part_acc, num_parts, out.stride(0), out.stride(1),
            **reduce_meta(head_dim=head_dim, num_parts=num_parts),
        )  # fmt: skip
    return out
