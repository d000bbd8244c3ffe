"""The CPU backend: decode rows through a Numba kernel, prefill sequences through gather + SDPA.

One call may mix both (the engine's continuous batches): sequences with at most
`MAX_DECODE_QUERY` new tokens become kernel rows that read their blocks in place
(`cpu_kernels`), longer ones gather their blocks and run `scaled_dot_product_attention` with
a bottom-right causal mask, where the matrix-matrix products pay for the copy.
float16 and float64 caches take the SDPA path for every sequence (Numba has no fast float16).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from pagedkv.ops import _validate, cpu_kernels, cpu_launch, cpu_plan
from pagedkv.ops.metadata import AttentionMetadata
from pagedkv.ops.reference import attention_mask

MAX_DECODE_QUERY = 4
"""Sequences with at most this many new tokens go to the kernel. Measured crossover (8 sequences
of 2048 tokens, float32, 2 threads): 4 new tokens each, kernel 89 ms vs gather + SDPA 180 ms;
8 new tokens each, 98 ms vs 77 ms."""

# Cache dtypes the decode kernel reads (bfloat16 as its uint16 bits).
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class _Plan:
    """How one batch is split; depends on the index tensors, cache geometry and window only."""

    items: np.ndarray  # int64 [num_items, 6], see cpu_kernels
    splits: np.ndarray  # int64 [num_split_rows, 3]
    rows: np.ndarray  # int64 [num_rows], query row of each kernel output row
    num_workers: int  # cpu_kernels.count_workers
    prefetch: int  # cpu_kernels.prefetch_mode
    prefill_seqs: np.ndarray  # int64 [num_prefill]
    starts: np.ndarray  # int32 [num_seqs + 1], query_start_loc
    seq_lens: np.ndarray  # int32 [num_seqs]
    block_tables: np.ndarray  # int32 [num_seqs, max_blocks]
    covers_all: bool  # rows == arange(num_tokens): the kernel output is the whole output
    launch_block: torch.Tensor | None = None  # cpu_launch.plan_block, when the launcher runs it


def _make_plan(
    num_tokens: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    sliding_window: int | None,
) -> _Plan:
    """Validate the batch's lengths and block ids and split it; raises ValueError."""
    tables, starts, lens = block_tables.numpy(), query_start_loc.numpy(), seq_lens.numpy()
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    # The kernel reads flat views of the caches: a strided pool (allowed by the contract as
    # long as the last dim is dense) takes the gather path instead.
    use_kernel = _flat_views(key_cache, value_cache) is not None
    num_threads = cpu_kernels.num_threads()
    items, splits, rows, prefill, total, error, seq = cpu_plan.plan_items(
        starts,
        lens,
        tables,
        num_tokens,
        num_blocks,
        block_size,
        sliding_window or 0,
        MAX_DECODE_QUERY if use_kernel else 0,
        num_threads,
    )
    if error == cpu_plan.BAD_BLOCK:
        raise ValueError(
            f"block_tables: expected block ids in [0, {num_blocks}) for the "
            f"ceil(seq_len / block_size) blocks of sequence {seq}, "
            f"got {tables[seq].tolist()[: -(-int(lens[seq]) // block_size)]}"
        )
    if error != cpu_plan.OK:
        _validate.check_lengths(starts, lens, num_tokens, tables.shape[1] * block_size)
        raise AssertionError(f"plan_items reported error {error} that check_lengths missed")
    row_bytes = 2 * key_cache.shape[2] * key_cache.shape[3] * key_cache.element_size()
    num_workers = cpu_kernels.count_workers(total * row_bytes, items.shape[0], num_threads)
    prefetch = cpu_kernels.prefetch_mode(key_cache.element_size(), total * row_bytes)
    covers_all = rows.shape[0] == num_tokens
    launch_block = None
    if use_kernel and covers_all and tables.flags.c_contiguous and cpu_launch.loaded():
        launch_block = cpu_launch.plan_block(
            num_tokens, tables, items, splits, num_workers, prefetch
        )
    return _Plan(
        items=items,
        splits=splits,
        rows=rows,
        num_workers=num_workers,
        prefetch=prefetch,
        prefill_seqs=prefill,
        starts=starts,
        seq_lens=lens,
        block_tables=tables,
        covers_all=covers_all,
        launch_block=launch_block,
    )


class _FlatCaches(NamedTuple):
    """A cache pair as the decode kernel reads it, with the geometry it needs."""

    key: np.ndarray  # flat views (float32, or bfloat16 bits as uint16)
    value: np.ndarray
    shape: tuple[int, int, int, int]  # of each cache, and its last three sizes:
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    threads_address: int  # cpu_kernels.thread_count_address()
    launch: cpu_launch.LaunchCaches | None  # when the C++ launcher is loaded


def _flat_views(key_cache: torch.Tensor, value_cache: torch.Tensor) -> _FlatCaches | None:
    """The caches as flat NumPy arrays for the decode kernel, or None if it cannot read them.

    float32 arrives as is, bfloat16 as its uint16 bits (NumPy has no bfloat16); other dtypes
    and strided caches (allowed by the contract as long as the last dim is dense; a flat
    view of them would be a copy) take the gather path. Call only for a checked pair
    (`_validate.known_pair`): `try_decode` trusts the memo.
    """
    return _memo_views(key_cache, value_cache, _FLAT_MEMO, _build_flat_views)


_FLAT_MEMO = "_pagedkv_flat"


def _build_flat_views(key_cache: torch.Tensor, value_cache: torch.Tensor) -> _FlatCaches | None:
    if key_cache.dtype not in _KERNEL_DTYPES:
        return None
    shape = tuple(key_cache.shape)
    key_flat, value_flat = _flat(key_cache), _flat(value_cache)
    threads_address = cpu_kernels.thread_count_address()
    launcher = cpu_launch.loaded()
    launch = None
    if launcher is not None:
        launch = cpu_launch.caches_block(
            launcher, key_flat, value_flat, key_cache, value_cache, MAX_DECODE_QUERY,
            threads_address,
        )  # fmt: skip
    return _FlatCaches(
        key_flat, value_flat, shape, *shape[1:], key_cache.dtype, threads_address, launch
    )


def _memo_views(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    name: str,
    build: Callable[[torch.Tensor, torch.Tensor], Any],
) -> Any:
    """`build(key_cache, value_cache)`'s NumPy views of a contiguous cache pair (None if
    either is strided), memoized on `key_cache` under `name` and keyed by both storage
    addresses.

    Building views costs microseconds, paid per layer by small decode batches otherwise (a
    decode step's write has a 10 us budget). Restriding a cache in place (`as_strided_`,
    `set_`) is not supported.
    """
    memo = key_cache.__dict__.get(name)
    if (
        memo is not None and memo[0] is value_cache
        and memo[1] == key_cache.data_ptr() and memo[2] == value_cache.data_ptr()
    ):  # fmt: skip
        return memo[3]
    contiguous = key_cache.is_contiguous() and value_cache.is_contiguous()
    views = build(key_cache, value_cache) if contiguous else None
    key_cache.__dict__[name] = (value_cache, key_cache.data_ptr(), value_cache.data_ptr(), views)
    return views


def _flat(cache: torch.Tensor) -> np.ndarray:
    if cache.dtype == torch.bfloat16:  # no NumPy bfloat16: hand over the raw bits
        return cache.view(torch.int16).numpy().view(np.uint16).reshape(-1)
    return cache.numpy().reshape(-1)


def _decode_rows(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: _Plan,
    scale: float,
) -> torch.Tensor:
    """Kernel rows' output, float32 [num_rows, num_heads, head_dim]."""
    num_tokens, num_heads, head_dim = query.shape
    # The kernel reads these through their addresses; a cast alone may keep strides.
    q = query.contiguous()
    if q.dtype is not torch.float32:
        q = q.float()
    out = torch.empty(plan.rows.shape[0], num_heads, head_dim, dtype=torch.float32)
    caches = _flat_views(key_cache, value_cache)
    cpu_kernels.decode(
        q.data_ptr(),
        num_tokens,
        num_heads,
        head_dim,
        caches.key,
        caches.value,
        caches.block_size,
        caches.num_kv_heads,
        plan.block_tables,
        plan.items,
        plan.splits,
        scale,
        out.data_ptr(),
        out.shape[0],
        plan.num_workers,
        plan.prefetch,
    )
    return out


def _prefill_seq(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: np.ndarray,
    seq_len: int,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """One sequence by gather + SDPA: query [q, H, D] -> [q, H, D]."""
    query_len, block_size = query.shape[0], key_cache.shape[1]
    # Blocks wholly before the window of the first new token are never read.
    first = 0 if sliding_window is None else max(0, seq_len - query_len - sliding_window + 1)
    b0, b1 = first // block_size, -(-seq_len // block_size)
    blocks = torch.from_numpy(block_table[b0:b1].astype(np.int64))
    start = b0 * block_size
    # (nb, bs, Hkv, D) -> (nb * bs, Hkv, D) -> (Hkv, L', D) with L' = seq_len - start.
    # Contiguous K/V: SDPA's CPU kernel runs ~10 % slower on the strided view at 512 tokens,
    # more than the copy costs.
    k = key_cache.index_select(0, blocks).flatten(0, 1)[: seq_len - start].transpose(0, 1)
    v = value_cache.index_select(0, blocks).flatten(0, 1)[: seq_len - start].transpose(0, 1)
    k, v = k.contiguous(), v.contiguous()
    q = query.transpose(0, 1)  # (H, q, D)
    if sliding_window is None and start == 0 and query_len == seq_len:
        mask, causal = None, True
    else:
        mask = attention_mask(query_len, seq_len, sliding_window, query.device)[:, start:]
        causal = False
    out = F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
    )
    return out[0].transpose(0, 1)


def _run(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: _Plan,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    has_rows = plan.rows.shape[0] > 0
    if has_rows:
        rows_out = _decode_rows(query, key_cache, value_cache, plan, scale)
        if plan.covers_all:
            return rows_out if query.dtype == torch.float32 else rows_out.to(query.dtype)
    out = torch.empty_like(query)
    if has_rows:
        out[torch.from_numpy(plan.rows)] = rows_out.to(query.dtype)
    for s in plan.prefill_seqs.tolist():
        lo, hi = int(plan.starts[s]), int(plan.starts[s + 1])
        out[lo:hi] = _prefill_seq(
            query[lo:hi],
            key_cache,
            value_cache,
            plan.block_tables[s],
            int(plan.seq_lens[s]),
            scale,
            sliding_window,
        )
    return out


def try_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float | None,
    sliding_window: int | None,
) -> torch.Tensor | None:
    """The plain `paged_attention` call of a decode-only batch over a known cache pair, checked
    and run here in one compiled call (plan and kernel); None otherwise.

    None (arguments this path does not take as they are, a prefill sequence, a bad length or
    block id, a cache pair not yet checked or that the kernel cannot read) sends the caller
    to the general path, which validates everything, names any error and runs prefills.
    The checks here are the contract's (`_validate.check_attention_args`) for the common
    case only, each tensor attribute read once: a plain call follows other kernels that have
    flushed the caches, where each Python step costs 3-5x its hot time (the checks and the
    call's set-up: 12 -> 7 us after an SDPA call, measured).
    """
    memo = key_cache.__dict__.get(_FLAT_MEMO)  # set only for a pair that passed the checks
    if memo is None or memo[0] is not value_cache or memo[3] is None:
        return None
    # One unpacking: each named-field read would be a Python-level call.
    key_flat, value_flat, _, block_size, num_kv_heads, cache_dim, dtype, threads, launch = memo[3]
    if launch is not None:  # the same checks and kernel, from C++ (`cpu_launch`)
        try:
            return launch.module.plan_and_decode(
                query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                launch.block, scale, sliding_window, launch.plan_and_decode,
            )  # fmt: skip
        except TypeError:
            return None  # not tensors: the general path names the problem
    int32 = torch.int32
    try:
        q_shape, table_shape = query.shape, block_tables.shape
        lens_shape, starts_shape = seq_lens.shape, query_start_loc.shape
        if len(table_shape) != 2:
            return None
        num_seqs = table_shape[0]
        if not (
            len(q_shape) == 3 and q_shape[2] == cache_dim
            and q_shape[1] % num_kv_heads == 0 and query.dtype is dtype
            and block_tables.dtype is int32 and seq_lens.dtype is int32
            and query_start_loc.dtype is int32
            and len(lens_shape) == 1 and lens_shape[0] == num_seqs
            and len(starts_shape) == 1 and starts_shape[0] == num_seqs + 1
            and query.is_cpu and block_tables.is_cpu and seq_lens.is_cpu
            and query_start_loc.is_cpu
            and (sliding_window is None or (type(sliding_window) is int and sliding_window >= 1))
            and (scale is None or (type(scale) is float and math.isfinite(scale)))
            # Last: the cache pair still has the storage its views were made from.
            and memo[1] == key_cache.data_ptr() and memo[2] == value_cache.data_ptr()
        ):  # fmt: skip
            return None
    except (AttributeError, TypeError):
        return None  # not tensors: the general path names the problem
    num_tokens, num_heads, head_dim = q_shape
    if num_tokens > MAX_DECODE_QUERY * num_seqs:
        return None  # some sequence is a prefill: no query cast or output for nothing
    # The kernel reads these through their addresses: the contiguous copies (the tensors
    # themselves, usually) must stay alive until it returns.
    q = query.contiguous()
    if q.dtype is not torch.float32:
        q = q.float()
    tables, lens = block_tables.contiguous(), seq_lens.contiguous()
    starts = query_start_loc.contiguous()
    out = torch.empty_like(q)  # float32 and contiguous, as q (and cheaper than torch.empty)
    status, _ = cpu_kernels.plan_and_decode(
        q.data_ptr(),
        num_tokens,
        num_heads,
        key_flat,
        value_flat,
        block_size,
        num_kv_heads,
        head_dim,
        tables.data_ptr(),
        num_seqs,
        table_shape[1],
        lens.data_ptr(),
        starts.data_ptr(),
        sliding_window or 0,
        MAX_DECODE_QUERY,
        threads,
        1.0 / math.sqrt(head_dim) if scale is None else scale,  # as check_attention_args
        out.data_ptr(),
    )
    if status != cpu_plan.OK:
        return None
    return out if query.dtype is torch.float32 else out.to(query.dtype)


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
) -> torch.Tensor:
    """Backend entry point; the contract is `pagedkv.ops.paged_attention` (inputs validated).

    `pagedkv.ops.paged_attention` tries `try_decode` first; this is the general path."""
    plan = _make_plan(
        query.shape[0],
        block_tables,
        seq_lens,
        query_start_loc,
        key_cache,
        value_cache,
        sliding_window,
    )
    return _run(query, key_cache, value_cache, plan, scale, sliding_window)


def _plan_key(num_tokens: int, cache_shape: tuple, dtype: torch.dtype, window: int | None) -> tuple:
    """Where a step's plan sits in `AttentionMetadata.plans`: every layer of a step shares
    the geometry, so the first layer plans and the others reuse it."""
    return ("cpu", num_tokens, cache_shape, dtype, window)


def paged_attention_from_metadata(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    attn_metadata: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """As `paged_attention`, reusing the step's plan (built by the first layer that asks).

    `pagedkv.ops.paged_attention_from_metadata` tries `try_planned` first; this is the
    general path."""
    md = attn_metadata
    key = _plan_key(query.shape[0], tuple(key_cache.shape), key_cache.dtype, sliding_window)
    plan = md.plans.get(key)
    if plan is None:
        plan = md.plans[key] = _make_plan(
            query.shape[0],
            md.block_tables,
            md.seq_lens,
            md.query_start_loc,
            key_cache,
            value_cache,
            sliding_window,
        )
    return _run(query, key_cache, value_cache, plan, scale, sliding_window)


def try_planned(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    attn_metadata: AttentionMetadata,
    scale: float | None,
    sliding_window: int | None,
) -> torch.Tensor | None:
    """`paged_attention_from_metadata` for a layer of a decode-only step whose plan an
    earlier layer built, checked and run here; None otherwise (the general path then runs).

    As `try_decode`, for the engine's per-layer calls: the step's index tensors were checked
    when its plan was built (the metadata does not change within a step), so this checks
    only the query, the scale and the window, reading each attribute once (general path
    after an SDPA call: ~26 us of Python per layer, measured).
    """
    memo = key_cache.__dict__.get(_FLAT_MEMO)  # set only for a pair that passed the checks
    if memo is None or memo[0] is not value_cache or memo[3] is None:
        return None
    key_flat, value_flat, shape, block_size, num_kv_heads, cache_dim, dtype, _, launch = memo[3]
    if launch is not None:  # the same checks and kernel, from C++ (`cpu_launch`)
        try:
            key = _plan_key(query.shape[0], shape, dtype, sliding_window)
            plan = attn_metadata.plans.get(key)
            if plan is None or plan.launch_block is None:
                return None
            return launch.module.decode(
                query, key_cache, value_cache, launch.block, plan.launch_block, scale,
                launch.decode,
            )  # fmt: skip
        except (AttributeError, TypeError, IndexError):
            return None  # not a tensor or a bad window: the general path names the problem
    try:
        q_shape = query.shape
        if len(q_shape) != 3 or not (
            sliding_window is None or (type(sliding_window) is int and sliding_window >= 1)
        ):
            return None
        plan = attn_metadata.plans.get(_plan_key(q_shape[0], shape, dtype, sliding_window))
        if not (
            plan is not None and plan.covers_all and q_shape[2] == cache_dim
            and q_shape[1] % num_kv_heads == 0 and query.dtype is dtype
            and query.is_cpu
            and (scale is None or (type(scale) is float and math.isfinite(scale)))
            and memo[1] == key_cache.data_ptr() and memo[2] == value_cache.data_ptr()
        ):  # fmt: skip
            return None
    except (AttributeError, TypeError):
        return None  # not a tensor: the general path names the problem
    num_tokens, num_heads, head_dim = q_shape
    q = query.contiguous()  # read by address: a cast alone may keep strides
    if q.dtype is not torch.float32:
        q = q.float()
    out = torch.empty_like(q)
    cpu_kernels.decode(
        q.data_ptr(),
        num_tokens,
        num_heads,
        head_dim,
        key_flat,
        value_flat,
        block_size,
        num_kv_heads,
        plan.block_tables,
        plan.items,
        plan.splits,
        1.0 / math.sqrt(head_dim) if scale is None else scale,  # as check_attention_args
        out.data_ptr(),
        num_tokens,
        plan.num_workers,
        plan.prefetch,
    )
    return out if query.dtype is torch.float32 else out.to(query.dtype)


def _row_views(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple | None:
    """Raw [num_slots, row_words] views (`_bytes`) of a contiguous cache pair, then
    num_kv_heads, head_dim and dtype (None if strided), memoized (`_memo_views`). Call only
    for a checked pair (`_validate.known_pair`): `try_write` trusts the memo."""
    return _memo_views(key_cache, value_cache, _ROWS_MEMO, _build_row_views)


_ROWS_MEMO = "_pagedkv_row_views"


def _build_row_views(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple:
    _, _, num_kv_heads, head_dim = key_cache.shape
    key_rows, value_rows = _bytes(key_cache), _bytes(value_cache)
    launcher = cpu_launch.loaded()
    launch = None
    if launcher is not None:
        launch = cpu_launch.rows_block(launcher, key_rows, value_rows, key_cache, value_cache)
    return key_rows, value_rows, num_kv_heads, head_dim, key_cache.dtype, launch


def _bytes(cache: torch.Tensor) -> np.ndarray:
    """[num_slots, row_words] raw view: uint64 words when a row allows, else bytes."""
    # NumPy has no bfloat16: view 2-byte floats as int16 first (write_kv only copies bits)
    raw = cache.view(torch.int16).numpy() if cache.element_size() == 2 else cache.numpy()
    rows = raw.reshape(cache.shape[0] * cache.shape[1], -1).view(np.uint8)
    return rows.view(np.uint64) if rows.shape[1] % 8 == 0 else rows


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Backend entry point; the contract is `pagedkv.ops.write_kv` (inputs validated).

    One serial Numba pass (no temporaries, no parallel start): a decode step writes only a
    few rows per layer, so fixed costs dominate.

    Raises:
        ValueError: a slot is past the end of the cache.
    """
    views = _row_views(key_cache, value_cache)
    if views is None:
        from pagedkv.ops.reference import write_kv as write_strided

        write_strided(key, value, key_cache, value_cache, slot_mapping)
        return
    # The kernel reads its inputs through their addresses: keep contiguous ones alive here.
    key, value, slots = key.contiguous(), value.contiguous(), slot_mapping.contiguous()
    bad = cpu_kernels.write_rows(
        key.data_ptr(),
        value.data_ptr(),
        slots.data_ptr(),
        slots.dtype is torch.int64,
        key.size(0),
        views[0],
        views[1],
    )
    if bad >= 0:
        raise _bad_slot(views[0].shape[0], slot_mapping, bad)


def _bad_slot(num_slots: int, slot_mapping: torch.Tensor, token: int) -> ValueError:
    return ValueError(
        f"slot_mapping: expected slots < num_blocks * block_size = {num_slots}, "
        f"got slot_mapping[{token}] = {int(slot_mapping[token])}"
    )


def try_write(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> bool:
    """`write_kv` of CPU tensors into a known cache pair, checked and run here; False
    (nothing written) sends the caller to the general path, which validates everything and
    names any error.

    As `try_decode`: the contract's checks (`_validate.check_write_args`) for the common
    case, each attribute read once, without the general path's layers of calls (a decode
    step's write has a 10 us budget, ~7 of them the copy).

    Raises:
        ValueError: a slot is past the end of the cache (nothing written for that token).
    """
    memo = key_cache.__dict__.get(_ROWS_MEMO)  # set only for a pair that passed the checks
    if memo is None or memo[0] is not value_cache or memo[3] is None:
        return False
    key_rows, value_rows, num_kv_heads, head_dim, dtype, launch = memo[3]
    if launch is not None:  # the same checks and copy, from C++ (`cpu_launch`)
        try:
            bad = launch.module.write(
                key, value, key_cache, value_cache, slot_mapping, launch.block, launch.write
            )
        except TypeError:
            return False  # not tensors: the general path names the problem
        if bad is None:
            return False
        if bad >= 0:
            raise _bad_slot(key_rows.shape[0], slot_mapping, bad)
        return True
    try:
        key_shape, value_shape, slots_shape = key.shape, value.shape, slot_mapping.shape
        slots_dtype = slot_mapping.dtype
        if not (
            len(key_shape) == 3 and key_shape[1] == num_kv_heads and key_shape[2] == head_dim
            and len(value_shape) == 3 and value_shape[0] == key_shape[0]
            and value_shape[1] == num_kv_heads and value_shape[2] == head_dim
            and len(slots_shape) == 1 and slots_shape[0] == key_shape[0]
            and (slots_dtype is torch.int64 or slots_dtype is torch.int32)
            and key.dtype is dtype and value.dtype is dtype
            and key.is_cpu and value.is_cpu and slot_mapping.is_cpu
            and memo[1] == key_cache.data_ptr() and memo[2] == value_cache.data_ptr()
        ):  # fmt: skip
            return False
    except (AttributeError, TypeError):
        return False  # not tensors: the general path names the problem
    # The kernel reads these through their addresses: keep contiguous ones alive here.
    key, value, slots = key.contiguous(), value.contiguous(), slot_mapping.contiguous()
    bad = cpu_kernels.write_rows(
        key.data_ptr(),
        value.data_ptr(),
        slots.data_ptr(),
        slots_dtype is torch.int64,
        key_shape[0],
        key_rows,
        value_rows,
    )
    if bad >= 0:
        raise _bad_slot(key_rows.shape[0], slot_mapping, bad)
    return True


def warmup(key_cache: torch.Tensor, value_cache: torch.Tensor, num_heads: int) -> None:
    """Compile, or load from Numba's on-disk cache, every kernel a step over this cache pair
    can call: the planner, the decode kernel of planned batches and of plain calls, and the
    KV write; and build or load the C++ launcher of the decode kernels (`cpu_launch`).

    A first compile takes seconds per kernel; without this it lands in whichever step first
    takes each path. Numba specializes on types, not sizes, so one-token inputs compile what
    the real ones use. Reads block 0 of the caches, writes nothing (the write's only slot is
    padding).
    """
    if cpu_launch.load() is not None:  # views made before: rebuilt with the launcher's blocks
        key_cache.__dict__.pop(_FLAT_MEMO, None)
        key_cache.__dict__.pop(_ROWS_MEMO, None)
    head_dim = key_cache.shape[3]
    query = torch.zeros(1, num_heads, head_dim, dtype=key_cache.dtype)
    index = dict(dtype=torch.int32)
    batch = torch.zeros(1, 1, **index), torch.ones(1, **index), torch.tensor([0, 1], **index)
    plan = _make_plan(1, *batch, key_cache, value_cache, None)
    _run(query, key_cache, value_cache, plan, 1.0, None)  # plan_items, then decode
    out = try_decode(query, key_cache, value_cache, *batch, 1.0, None)  # plan_and_decode
    assert out is not None, "warm-up took the general path: plan_and_decode not compiled"
    row = torch.zeros(1, key_cache.shape[2], head_dim, dtype=key_cache.dtype)
    write_kv(row, row, key_cache, value_cache, torch.full((1,), -1, dtype=torch.int64))
