"""The CPU attention backend: decode rows through a Numba kernel, prefills through SDPA.

One batch may mix both (the engine's continuous batches). Sequences with at most
`MAX_DECODE_QUERY` new tokens become kernel rows that read their blocks in place
(`kernels.decode_*`); longer ones gather their blocks and run
`scaled_dot_product_attention` with a bottom-right causal mask, where the matrix products
pay for the copy. float16 and float64 caches, and pools that are not contiguous, take the
SDPA path for every sequence (Numba has no fast float16, and the kernel reads flat views).

`plan` (once per step) runs the checks and the work split in one compiled pass; `run` (per
layer) converts the query and calls one compiled function.

A bfloat16 cache is read as its bits and widened to float32 in the kernels' loops
(`bf16.py`); sums run in float32. An int8 cache is read as int8, its scales applied once
per token and head (`kernels.py`); a prefill dequantizes the blocks it gathers anyway
(the matrix products take float operands) and runs SDPA in float32.

The models' side of a decode step on the CPU (products of a few rows, the whole decoder
stack in one compiled call) is `pagedkv.runtime`, which reads this backend's plans and
compiles its own kernels when a model takes them (`pagedkv.runtime.warmup`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagedkv.ops import checks
from pagedkv.ops.cpu import int8, kernels
from pagedkv.ops.cpu.arrays import as_numpy, checked_slots, sync_threads
from pagedkv.ops.metadata import AttentionMetadata
from pagedkv.ops.quantize import KVScales, dequantize
from pagedkv.ops.reference import attention_mask
from pagedkv.runtime import kernel_cache
from pagedkv.runtime.threads import workers_spin

__all__ = [
    "KERNEL_DTYPES", "MAX_DECODE_QUERY", "CpuPlan", "plan", "run",
    "uses_kernel", "warmup", "write_kv",
]  # fmt: skip

MAX_DECODE_QUERY = 4
"""Sequences with at most this many new tokens go to the kernel; beyond, gather + SDPA."""
SERIAL_BYTES = 4 << 20
"""Batches reading less KV run on one thread: waking the others, asleep since the last
parallel call (on a virtual machine, rescheduling idle CPUs), costs more (benchmarks.md).
Where the workers spin (`workers_spin`) a parallel call starts at once, and any
batch of more than one item takes every thread."""
MIN_CHUNK = {False: 256, True: 64}
"""Fewest key positions worth an item of their own in a parallel batch, with sleeping /
spinning workers: an item is merged at the end, and where waking a thread costs more than
scoring 256 tokens (sleeping workers) a short sequence stays one item. A serial batch is
cut finer (`kernels.plan_items`)."""
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.int8)


@dataclass
class CpuPlan:
    """One step's batch, checked and split; valid for caches of `cache_shape`/`dtype`."""

    cache_shape: torch.Size
    dtype: torch.dtype
    sliding_window: int | None
    items: np.ndarray  # int64 [num_items, 4]: (kernel row, seq, start, end)
    row_items: np.ndarray  # int64 [num_rows + 1]
    rows: np.ndarray  # int64 [num_rows]: query row of each kernel row
    prefill_seqs: list[int]
    block_tables: np.ndarray  # int32 [num_seqs, max_blocks]
    seq_lens: np.ndarray  # int32 [num_seqs]
    query_start_loc: np.ndarray  # int32 [num_seqs + 1]
    parallel: bool
    rows_index: torch.Tensor | None  # the rows as a tensor, unless they are all the rows

    def is_decode_only(self, num_real: int) -> bool:
        """Whether every one of the step's `num_real` rows is a kernel row."""
        return not self.prefill_seqs and self.rows_index is None and self.rows.shape[0] == num_real


def uses_kernel(cache: torch.Tensor) -> bool:
    """Whether decode rows over `cache` go to the Numba kernel."""
    return cache.dtype in KERNEL_DTYPES and cache.is_contiguous()


def plan(
    metadata: AttentionMetadata,
    key_cache: torch.Tensor,
    num_heads: int,
    sliding_window: int | None,
) -> CpuPlan:
    """See `AttentionBackend.plan`."""
    # Contiguous copies of strided views: one compiled variant reads them all.
    tables = np.ascontiguousarray(metadata.block_tables.numpy())
    lens = np.ascontiguousarray(metadata.seq_lens.numpy())
    starts = np.ascontiguousarray(metadata.query_start_loc.numpy())
    num_tokens = metadata.num_tokens
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    spin = workers_spin()
    row_bytes = 2 * key_cache.shape[2] * key_cache.shape[3] * key_cache.element_size()
    serial_total = -(-SERIAL_BYTES // row_bytes)
    items, row_items, rows, prefill, total, error, seq = kernels.plan_items(
        starts, lens, tables, num_tokens, num_blocks, block_size, sliding_window or 0,
        MAX_DECODE_QUERY if uses_kernel(key_cache) else 0, sync_threads(), MIN_CHUNK[spin],
        serial_total,
    )  # fmt: skip
    if error == kernels.BAD_BLOCK:
        raise checks.bad_block(tables, lens, seq, num_blocks, block_size)
    if error != kernels.OK:
        checks.check_lengths(starts, lens, num_tokens, tables.shape[1] * block_size)
        raise AssertionError(f"plan_items reported error {error} that check_lengths missed")
    return CpuPlan(
        cache_shape=key_cache.shape,
        dtype=key_cache.dtype,
        sliding_window=sliding_window,
        items=items,
        row_items=row_items,
        rows=rows,
        prefill_seqs=prefill.tolist(),
        block_tables=tables,
        seq_lens=lens,
        query_start_loc=starts,
        parallel=total >= serial_total or (spin and items.shape[0] > 1),
        rows_index=None if rows.shape[0] == num_tokens else torch.from_numpy(rows),
    )


def run(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: CpuPlan,
    scale: float,
    scales: KVScales | None = None,
) -> torch.Tensor:
    """See `AttentionBackend.run`."""
    if plan.rows.shape[0] and not uses_kernel(key_cache):
        raise checks.fail("key_cache", "a contiguous pool, as the plan's", "a strided one")
    if scales is not None and not all(t.is_contiguous() for t in scales):
        raise checks.fail("key_scales", "contiguous scales", "strided ones")
    if not plan.prefill_seqs:
        return _decode_rows(query, key_cache, value_cache, plan, scale, scales)
    out = torch.empty_like(query)
    if plan.rows.shape[0]:
        out[plan.rows_index] = _decode_rows(query, key_cache, value_cache, plan, scale, scales)
    for s in plan.prefill_seqs:
        lo, hi = int(plan.query_start_loc[s]), int(plan.query_start_loc[s + 1])
        out[lo:hi] = _prefill_seq(
            query[lo:hi], (key_cache, value_cache), scales, plan.block_tables[s],
            int(plan.seq_lens[s]), scale, plan.sliding_window,
        )  # fmt: skip
    return out


def _cache_rows(cache: torch.Tensor) -> np.ndarray:
    """A cache as the kernels read it: [num_slots, num_heads, head_dim]."""
    return as_numpy(cache.view(-1, cache.shape[-2], cache.shape[-1]))


def scale_rows(scales: KVScales | None) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Scales as the kernels read them: [num_slots, num_kv_heads] float16 bits, or None."""
    if scales is None:
        return None, None
    key, value = (as_numpy(t.view(-1, t.shape[-1])) for t in scales)
    return key, value


def _decode_rows(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: CpuPlan,
    scale: float,
    scales: KVScales | None,
) -> torch.Tensor:
    """The kernel rows' output, [num_rows, num_heads, head_dim] in the query's dtype (summed
    in float32)."""
    rows = query if plan.rows_index is None else query[plan.rows_index]
    q = rows.to(torch.float32).contiguous()
    out = torch.empty_like(q)
    decode = kernels.decode_parallel if plan.parallel else kernels.decode_serial
    decode(
        q.numpy(), _cache_rows(key_cache), _cache_rows(value_cache), *scale_rows(scales),
        plan.block_tables, plan.items, plan.row_items, key_cache.shape[1], scale, out.numpy(),
    )  # fmt: skip
    return out.to(query.dtype)


def _prefill_seq(
    query: torch.Tensor,
    caches: tuple[torch.Tensor, torch.Tensor],
    scales: KVScales | None,
    block_table: np.ndarray,
    seq_len: int,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """One sequence by gather + SDPA: query [q, H, D] -> [q, H, D]; over int8 caches the
    gathered rows are dequantized and SDPA runs in float32."""
    query_len, block_size = query.shape[0], caches[0].shape[1]
    # Blocks wholly before the window of the first new token are never read.
    first = 0 if sliding_window is None else max(0, seq_len - query_len - sliding_window + 1)
    b0, b1 = first // block_size, -(-seq_len // block_size)
    blocks = torch.from_numpy(block_table[b0:b1].astype(np.int64))
    start = b0 * block_size
    # (nb, bs, Hkv, D) -> (nb * bs, Hkv, D) -> (Hkv, L', D) with L' = seq_len - start;
    # made contiguous because SDPA's CPU kernel is slower on the strided view.
    k, v = (_gather(c, blocks, seq_len - start) for c in caches)
    if scales is not None:
        k, v = (dequantize(x, _gather(t, blocks, seq_len - start), torch.float32)
                for x, t in ((k, scales[0]), (v, scales[1])))  # fmt: skip
    k, v = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
    q = query.transpose(0, 1).to(k.dtype)  # (H, q, D)
    if sliding_window is None and start == 0 and query_len == seq_len:
        mask, causal = None, True
    else:
        mask = attention_mask(query_len, seq_len, sliding_window, query.device)[:, start:]
        causal = False
    out = F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
    )
    return out[0].transpose(0, 1).to(query.dtype)


def _gather(pool: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` rows of `blocks` of a pool [N, bs, ...]: [length, ...]."""
    return pool.index_select(0, blocks).flatten(0, 1)[:length]


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scales: KVScales | None = None,
) -> None:
    """See `AttentionBackend.write_kv`: one `index_copy_` per pool, whose rows are the slots
    of ``[num_blocks * block_size, num_kv_heads, head_dim]``; into an int8 cache one
    compiled pass that quantizes each row where it is stored (`int8.store_rows`).
    Checked before anything is written, so a bad batch leaves the cache as it was."""
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    pools = [key_cache, value_cache, *(scales or ())]
    if scales is not None and all(pool.is_contiguous() for pool in pools):
        past = int8.store_rows(  # type: ignore[call-arg]
            _row_values(key), _row_values(value), *(as_numpy(pool) for pool in pools),
            as_numpy(slot_mapping.long()),
        )  # fmt: skip
        if past >= 0:
            raise checks.slot_past_end(slot_mapping, past, num_slots)
        return
    slots, low = checked_slots(slot_mapping, num_slots)
    if not all(pool.is_contiguous() for pool in pools):
        from pagedkv.ops import reference

        reference.write_kv(key, value, key_cache, value_cache, slots, scales)
        return
    if low < 0:  # padding rows are skipped
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    for pool, new in zip(pools, (key, value), strict=True):
        pool.view(num_slots, *pool.shape[2:]).index_copy_(0, slots, new)


def _row_values(rows: torch.Tensor) -> np.ndarray:
    """K or V rows [n, num_kv_heads, head_dim] as `int8.store_rows` reads them: float32, or
    bfloat16 as its bits; other dtypes are converted to float32 (as `quantize` takes them)."""
    if rows.dtype not in (torch.float32, torch.bfloat16):
        rows = rows.float()
    return as_numpy(rows.contiguous())


def warmup(key_cache: torch.Tensor, value_cache: torch.Tensor, num_heads: int) -> None:
    """Load or compile the kernel variants that caches of this dtype use (the plan; for
    the kernel dtypes both decode kernels too, for int8 its write); say so on stderr when
    it compiles. The other kernel dtype's variants are left to an engine that runs it:
    building both would keep a first start waiting for code it never runs."""
    dtype = key_cache.dtype
    name = str(dtype).removeprefix("torch.")
    # Other dtypes run the plan alone, which any earlier warm-up built.
    kernel_cache.announce(f"attention-{name}" if dtype in KERNEL_DTYPES else None)
    _compile(dtype)
    kernel_cache.mark_compiled(f"attention-{name}")


def _compile(dtype: torch.dtype) -> None:
    """Run the plan on a tiny cache of `dtype` (a decode of one 1-token sequence); for a
    kernel dtype each decode kernel too, and for int8 the quantizing write."""
    cache = torch.zeros(1, 1, 1, 8, dtype=dtype)
    metadata = AttentionMetadata.build([[0]], [1], [1], [0])
    p = plan(metadata, cache, 1, None)
    if dtype not in KERNEL_DTYPES:
        return
    scales = (torch.zeros(1, 1, 1, dtype=torch.float16),) * 2 if dtype == torch.int8 else None
    query_dtype = torch.float32 if dtype == torch.int8 else dtype
    for parallel in (False, True):
        p.parallel = parallel
        run(torch.zeros(1, 1, 8, dtype=query_dtype), cache, cache, p, 1.0, scales)
    if scales is not None:  # the quantizing write, from rows of either model dtype
        for rows in (torch.zeros(1, 1, 8), torch.zeros(1, 1, 8, dtype=torch.bfloat16)):
            write_kv(rows, rows, cache, cache, torch.zeros(1, dtype=torch.int64), scales)
