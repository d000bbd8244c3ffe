"""Shared Triton helpers: find a program's sequence, turn logical blocks into addresses.

A key tile is ``TILE_BLOCKS`` whole logical blocks of one sequence. Each block
contributes ``BLOCK_SIZE_PAD`` lanes (the next power of two of ``block_size``),
of which the first ``block_size`` are real tokens::

    lane:      0 1 2 3 4 5 6 7 | 8 9 ...         (block_size 5, BLOCK_SIZE_PAD 8)
    token:     0 1 2 3 4 - - - | 5 6 ...         ('-' = padding lane, masked)
    block id:  table[b0]       | table[b0 + 1]   (one table load per block)

Within a block the tokens are consecutive rows of the NHD cache, so one block's
lanes read one contiguous run of ``block_size`` rows per KV head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def scale_args(
    key_cache: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int]]:
    """The attention kernels' scale arguments: (key_scales, value_scales, their block, token
    and head strides); for a float cache the caches themselves stand in, never read."""
    if scales is None:
        return key_cache, key_cache, (0, 0, 0)
    key_scales, value_scales = scales
    if key_scales.stride() != value_scales.stride():
        raise ValueError(
            "expected key_scales and value_scales with equal strides, "
            f"got {key_scales.stride()} and {value_scales.stride()}"
        )
    return key_scales, value_scales, tuple(key_scales.stride())  # type: ignore[return-value]


@triton.jit
def kv_tile_rows(
    table_row,
    tile_first_block,
    key_hi,
    stride_block,
    stride_token,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_SIZE_PAD: tl.constexpr,
    TILE_BLOCKS: tl.constexpr,
):
    """Row offsets, positions and validity of one key tile.

    Args:
        table_row: pointer to the sequence's block table row (int32).
        tile_first_block: logical index of the tile's first block.
        key_hi: one past the last position the tile may read (exclusive bound).
        stride_block, stride_token: cache strides of dims 0 and 1 (elements).

    Returns:
        (row_offset [TILE_BLOCKS * BLOCK_SIZE_PAD] int64, position [...] int32,
        is_valid [...] int1). Invalid lanes point at block 0 and must be masked.
    """
    blocks = tile_first_block + tl.arange(0, TILE_BLOCKS)  # (TB,) logical block index
    # Table entries past the sequence may be -1: only blocks that hold a position
    # below key_hi are read.
    block_ids = tl.load(table_row + blocks, mask=blocks * BLOCK_SIZE < key_hi, other=0)
    in_block = tl.arange(0, BLOCK_SIZE_PAD)
    position = blocks[:, None] * BLOCK_SIZE + in_block[None, :]  # (TB, BSP)
    is_valid = (in_block[None, :] < BLOCK_SIZE) & (position < key_hi)
    # int64: block_id * stride_block exceeds 2**31 elements for caches over 4 GiB.
    row_offset = block_ids.to(tl.int64)[:, None] * stride_block + in_block[None, :] * stride_token
    num_lanes: tl.constexpr = TILE_BLOCKS * BLOCK_SIZE_PAD
    return (
        tl.reshape(row_offset, [num_lanes]),
        tl.reshape(position, [num_lanes]),
        tl.reshape(is_valid, [num_lanes]),
    )


@triton.jit
def find_seq(query_start_loc, num_seqs, target, BLOCK_Q: tl.constexpr, TILE_MODE: tl.constexpr):
    """Binary search over ``query_start_loc`` (log2(num_seqs) scalar loads).

    TILE_MODE: largest s with ``qsl[s] // BLOCK_Q + s <= target`` (target = a query tile
    index, see prefill.py). Otherwise: largest s with ``qsl[s] <= target`` (target = a
    query row; sequences without new tokens are stepped over).
    """
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        key = tl.load(query_start_loc + mid)
        if TILE_MODE:
            key = key // BLOCK_Q + mid
        go_right = key <= target
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(go_right, hi, mid)
    return lo - 1
