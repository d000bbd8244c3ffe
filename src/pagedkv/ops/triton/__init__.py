"""Triton backend of the ops contract (`pagedkv.ops.backend`): paged attention and KV
writes on CUDA. Under ``TRITON_INTERPRET=1`` (set before this package is first imported)
the same kernels run on CPU tensors, which is how the tests check them without a GPU.

Routing, one launch per kind and no host sync (nothing is read back from the GPU):
    decode batch  ->  the decode kernel, split across partitions (+ one reduce launch)
    otherwise     ->  the general prefill/mixed kernel for all rows
`plan` picks the kernel and its launch arguments from host-side values, once per step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton

from pagedkv.ops import reference
from pagedkv.ops.metadata import AttentionMetadata
from pagedkv.ops.triton.decode import decode_attention
from pagedkv.ops.triton.prefill import prefill_attention
from pagedkv.ops.triton.write import check_device, check_strides, write_kv

__all__ = ["plan", "run", "warmup", "write_kv"]

_DECODE_TILE_LANES = 64  # keys per decode iteration: 16 KiB of K (bf16, d=128) per load
_PREFILL_TILE_LANES = 64
_MIN_PARTITION = 256  # tokens; below this a partition's fixed cost (Q load, partial) dominates
_MAX_PARTITIONS = 64  # the reduce kernel holds all partials of a head in registers
_PROGRAMS_PER_SM = 4


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a constant per device, cached)."""
    if device.type != "cuda":
        return 4  # interpreter on CPU: only shapes the partition choice of tests
    return torch.cuda.get_device_properties(device).multi_processor_count


def tile_blocks_for(block_size: int, lanes: int) -> int:
    """Blocks per key tile: ``lanes`` keys (padded lanes included), at least one block."""
    return max(1, lanes // triton.next_power_of_2(block_size))


def prefill_block_m(
    dtype: torch.dtype, num_tokens: int, num_seqs: int, group: int, block_size: int
) -> int:
    """Query rows (tokens x padded GQA group) per prefill program.

    128-row tiles halve the K/V tiles each query is re-read against (the usual
    FlashAttention-2 shape on Hopper: 8 warps, 3 stages, no spills on sm_90) but only pay
    when sequences bring that many rows on average; mixed batches of short chunks and
    decode rows keep 64, and so do key tiles over 64 (block_size 128: 128 x 128 spills).
    float32 dots run on FMA units with operands in registers: 32.
    """
    if dtype == torch.float32:
        return 32
    if triton.next_power_of_2(block_size) > _PREFILL_TILE_LANES:
        return 64
    rows_per_seq = num_tokens // max(1, num_seqs) * triton.next_power_of_2(group)
    return 128 if rows_per_seq >= 128 else 64


def choose_partition_size(
    num_rows: int, num_kv_heads: int, max_context: int, tile_tokens: int, num_sms: int
) -> int:
    """Tokens per decode program: split only as far as needed to fill the GPU.

    Batch 64 x 8 KV heads already gives 512 programs, so long partitions (no or
    little split); batch 1 at 32K context gets up to 64 partitions of 512 tokens.

    Returns:
        A multiple of ``tile_tokens``; >= ``max_context`` when no split is wanted.
    """
    max_context = max(1, max_context)  # a batch of empty sequences still gets a partition
    wanted = triton.cdiv(_PROGRAMS_PER_SM * num_sms, max(1, num_rows * num_kv_heads))
    num_parts = min(wanted, _MAX_PARTITIONS, triton.cdiv(max_context, _MIN_PARTITION))
    per_part = triton.cdiv(max_context, max(1, num_parts))
    return triton.cdiv(per_part, tile_tokens) * tile_tokens


@dataclass
class TritonPlan:
    """A step's batch as the kernels take it: which kernel, and its launch arguments."""

    is_decode: bool
    # block_tables, seq_lens, query_start_loc: made contiguous once for every layer
    index: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    options: dict[str, Any]  # the kernel's keyword arguments besides `scale`


def plan(
    metadata: AttentionMetadata,
    key_cache: torch.Tensor,
    num_heads: int,
    sliding_window: int | None,
) -> TritonPlan:
    """Route the batch and size its launch from host-side values only (nothing is read back
    from the GPU).

    ``max_query_len <= 1`` selects the decode kernel even when some sequences have no new
    token. Without host lengths (a plain `paged_attention` call), ``num_tokens ==
    num_seqs`` means decode (or q_len 0 next to q_len 2+, which the decode kernel handles
    too) and ``max_blocks * block_size`` bounds every sequence: size block tables to the
    batch's longest sequence, not the model's maximum, or short batches split too little.
    """
    md = metadata
    check_device(key_cache.device)
    if md.seq_lens.is_cpu:  # under the interpreter: the checks the GPU path cannot afford
        reference.plan(md, key_cache, num_heads, sliding_window)
    tables = md.block_tables if md.block_tables.stride(-1) == 1 else md.block_tables.contiguous()
    index = (tables, md.seq_lens.contiguous(), md.query_start_loc.contiguous())
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    is_decode = (
        md.max_query_len <= 1 if md.max_query_len is not None else md.num_tokens == md.num_seqs
    )
    if not is_decode:
        block_m = prefill_block_m(
            key_cache.dtype, md.num_tokens, md.num_seqs, num_heads // num_kv_heads, block_size
        )
        tile_blocks = tile_blocks_for(block_size, _PREFILL_TILE_LANES)
        options = dict(sliding_window=sliding_window, block_m=block_m, tile_blocks=tile_blocks)
        return TritonPlan(False, index, options)
    max_span = (
        md.max_seq_len if md.max_seq_len is not None else md.block_tables.shape[1] * block_size
    )
    if sliding_window is not None:
        # Keys from the block holding (position - window + 1) to the position itself.
        max_span = min(max_span, sliding_window + block_size - 1)
    tile_blocks = tile_blocks_for(block_size, _DECODE_TILE_LANES)
    partition = choose_partition_size(
        md.num_tokens, num_kv_heads, max_span, tile_blocks * block_size, _num_sms(key_cache.device)
    )
    options = dict(
        sliding_window=sliding_window,
        max_span=max_span,
        partition_size=partition,
        tile_blocks=tile_blocks,
    )
    return TritonPlan(True, index, options)


def run(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: TritonPlan,
    scale: float,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """See `AttentionBackend.run`: one launch of the planned kernel (two for a split decode)."""
    check_strides(key_cache, value_cache)
    query = query if query.stride(-1) == 1 else query.contiguous()
    attend = decode_attention if plan.is_decode else prefill_attention
    return attend(
        query, key_cache, value_cache, *plan.index, scale=scale, scales=scales, **plan.options
    )


def warmup(key_cache: torch.Tensor, value_cache: torch.Tensor, num_heads: int) -> None:
    """Check that the kernels can run on the caches' device; Triton compiles per launch
    configuration on first use, so nothing is compiled ahead."""
    check_device(key_cache.device)
