"""The CPU backend's compiled code: plan a batch, attend decode rows over the paged cache.

NumPy and Numba only (no torch: tensors arrive as NumPy views), and from pagedkv only the
span steps (`spans.py`, `int8_spans.py`, `softmax.py`) and `pagedkv.runtime.kernel_cache`,
which keeps the compiled code in the user's cache directory, keyed by the kernel files'
source, so that every checkout and venv of one pagedkv version shares it. `attend_item`,
`merge_row`, `exp_parts` and `EXACT_ORDER` are public: the decoder stack
(`pagedkv.runtime.stack`) calls them too.

Work split (flash-decoding on the CPU). A decode row attends to key positions
``[lo, pos]`` of its sequence; the plan cuts that range at multiples of `chunk` into
*items*, sized so that the batch makes about two items per thread, so one long sequence
still uses every core:

    row r:    lo ........................................... pos
    items:    [lo, c)   [c, 2c)   [2c, 3c)   ...   [kc, pos]      (c = chunk)

Each item leaves an unnormalized partial state per query head (running max `row_max`, sum
of weights `row_sum`, weighted values `acc`); `merge_row` combines a row's items into its
output. Within an item, tokens are scored a span at a time (up to `SPAN` tokens, across
block boundaries) before one online-softmax update per head, so small blocks do not pay a
rescale each.

An int8 cache comes with its scales ([num_slots, num_kv_heads] float16 bits, or None for a
float cache): a token's K scale multiplies its dot products (folded into the softmax
scale), its V scale the softmax weights, once per token and head; sums stay float32.
Its accumulate step (`int8_spans.py`) is vector code of its own (`tiles.py`); its scales'
lines are asked for a span ahead, as the rows are (`int8.prefetch_scales`).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from pagedkv.ops.cpu.int8 import prefetch_scales
from pagedkv.ops.cpu.softmax import EXACT_ORDER, exp_parts, softmax_span
from pagedkv.ops.cpu.spans import accumulate_span, fill_slots, score_span
from pagedkv.runtime import kernel_cache

kernel_cache.use_shared_cache()  # before the first `cache=True` decorator

OK, BAD_BOUNDS, BAD_QUERY_LEN, BAD_SEQ_LEN, BAD_BLOCK = range(5)
SPAN = 64
"""Tokens scored between two online-softmax updates."""
NEG_INIT = -1e30
"""Running max before any score (fastmath assumes no infinities)."""
__all__ = ["EXACT_ORDER", "attend_item", "decode_parallel", "decode_serial", "exp_parts",
           "merge_row", "plan_items"]  # fmt: skip


@njit(cache=True)
def plan_items(
    query_start_loc, seq_lens, block_tables, num_tokens, num_blocks, block_size, window,
    max_decode_query, num_threads, min_chunk, serial_total,
):  # fmt: skip  # pragma: no cover
    """Check a batch's lengths and block ids, and split it into items and prefill sequences.

    Args:
        query_start_loc: int32 [num_seqs + 1].  seq_lens: int32 [num_seqs].
        block_tables: int32 [num_seqs, max_blocks].
        num_tokens, num_blocks, block_size: the query's rows and the cache's geometry.
        window: sliding window, 0 for none.
        max_decode_query: sequences with at most this many new tokens become kernel rows;
            longer ones are returned in `prefill`.
        num_threads: threads the parallel kernel will run on.
        min_chunk: fewest key positions worth an item of their own in a batch of at least
            `serial_total` key positions; a smaller one is cut into items of a `SPAN` or
            more (it runs on one thread, where an item costs only its merge, or in the
            decoder stack's region, whose threads are awake).

    Returns:
        (items int64 [n, 4] of (row, seq, start, end), row_items int64 [num_rows + 1] (row
        r's items are row_items[r]:row_items[r + 1]), rows int64 [num_rows] (query row of
        kernel row r), prefill int64 [k], key positions over all rows, error code, sequence
        of the error).
    """
    num_seqs = seq_lens.shape[0]
    max_context = block_tables.shape[1] * block_size
    if query_start_loc[0] != 0 or query_start_loc[num_seqs] != num_tokens:
        return _failed(BAD_BOUNDS, 0)
    total = 0
    num_rows = 0
    for s in range(num_seqs):
        q_len = query_start_loc[s + 1] - query_start_loc[s]
        if q_len < 0:
            return _failed(BAD_QUERY_LEN, s)
        if seq_lens[s] < q_len or seq_lens[s] > max_context:
            return _failed(BAD_SEQ_LEN, s)
        # Blocks wholly before the first new token's window are never read (maybe freed).
        first = 0 if window <= 0 else max(0, seq_lens[s] - q_len - window + 1) // block_size
        for b in range(first, (seq_lens[s] + block_size - 1) // block_size):
            if block_tables[s, b] < 0 or block_tables[s, b] >= num_blocks:
                return _failed(BAD_BLOCK, s)
        if q_len <= max_decode_query:
            num_rows += q_len
            total += q_len * (seq_lens[s] if window <= 0 else min(seq_lens[s], window))
    chunk = max(-(-total // (2 * num_threads)), min_chunk if total >= serial_total else SPAN)
    chunk = -(-chunk // block_size) * block_size
    # A row of x positions makes at most x // chunk + 2 items (its ends need not align).
    items = np.empty((2 * num_rows + total // chunk + 1, 4), dtype=np.int64)
    row_items = np.empty(num_rows + 1, dtype=np.int64)
    rows = np.empty(num_rows, dtype=np.int64)
    prefill = np.empty(num_seqs, dtype=np.int64)
    n = r = k = 0
    for s in range(num_seqs):
        q0, q1 = query_start_loc[s], query_start_loc[s + 1]
        if q1 - q0 > max_decode_query:
            prefill[k] = s
            k += 1
            continue
        for row in range(q0, q1):
            pos = seq_lens[s] - (q1 - row)
            start = 0 if window <= 0 else max(0, pos - window + 1)
            rows[r] = row
            row_items[r] = n
            r += 1
            while start <= pos:
                end = min((start // chunk + 1) * chunk, pos + 1)
                items[n, 0], items[n, 1], items[n, 2], items[n, 3] = r - 1, s, start, end
                n += 1
                start = end
    row_items[num_rows] = n
    return items[:n], row_items, rows, prefill[:k], total, OK, 0


@njit(cache=True)
def _failed(code, seq):  # pragma: no cover
    empty = np.empty(0, dtype=np.int64)
    return np.empty((0, 4), dtype=np.int64), empty, empty, empty, 0, code, seq


@njit(cache=True, fastmath=True)
def attend_item(i, query, key_cache, value_cache, key_scales, value_scales, block_tables, items,
                block_size, scale, acc, row_max, row_sum):  # fmt: skip  # pragma: no cover
    """Attend item i's query row to its key range; leave its partial state. query: float32
    [num_rows, H, D]; caches [num_slots, num_kv_heads, D], float32, bfloat16 bits (uint16)
    or int8; scales [num_slots, num_kv_heads] float16 bits beside int8, else None;
    acc [H, D], row_max and row_sum [H], all overwritten."""
    row, seq, start, end = items[i, 0], items[i, 1], items[i, 2], items[i, 3]
    num_heads = query.shape[1]
    table = block_tables[seq]
    slots = np.empty(2 * SPAN, dtype=np.int64)
    scores = np.empty((num_heads, SPAN), dtype=np.float32)
    pow2 = np.empty(SPAN, dtype=np.int32)  # bits of 2^n for `exp_parts`
    acc[:] = 0.0
    row_max[:] = NEG_INIT
    row_sum[:] = 0.0
    for t0 in range(start, end, SPAN):
        n = min(SPAN, end - t0)
        known = min(n + SPAN, end - t0)  # and the next span's, to prefetch
        fill_slots(table, block_size, t0, known, slots)
        prefetch_scales(key_scales, value_scales, slots, n if t0 > start else 0, known)
        score_span(query[row], key_cache, value_cache, key_scales, slots, n, t0 == start,
                    np.float32(scale), scores)  # fmt: skip
        softmax_span(scores, n, acc, row_max, row_sum, pow2)
        accumulate_span(key_cache, value_cache, value_scales, slots, n, known, scores, acc)


@njit(cache=True, fastmath=True)
def merge_row(r, row_items, acc, row_max, row_sum, out):  # pragma: no cover
    """Combine row r's partial states (items row_items[r]:row_items[r + 1]) into out[r]."""
    i0, i1 = row_items[r], row_items[r + 1]
    num_heads, head_dim = out.shape[1], out.shape[2]
    for h in range(num_heads):
        new_max = row_max[i0, h]
        for i in range(i0 + 1, i1):
            new_max = max(new_max, row_max[i, h])
        total = np.float32(0.0)
        for d in range(head_dim):
            out[r, h, d] = 0.0
        for i in range(i0, i1):
            w = np.exp(row_max[i, h] - new_max)
            total += w * row_sum[i, h]
            for d in range(head_dim):
                out[r, h, d] += w * acc[i, h, d]
        inv = np.float32(1.0) / total
        for d in range(head_dim):
            out[r, h, d] *= inv


@njit(cache=True, parallel=True, fastmath=True)
def decode_parallel(query, key_cache, value_cache, key_scales, value_scales, block_tables, items,
                    row_items, block_size, scale, out):  # fmt: skip  # pragma: no cover
    """`decode_serial` with items and rows spread over Numba's threads."""
    num_items, num_heads, head_dim = items.shape[0], query.shape[1], query.shape[2]
    acc = np.empty((num_items, num_heads, head_dim), dtype=np.float32)
    row_max = np.empty((num_items, num_heads), dtype=np.float32)
    row_sum = np.empty((num_items, num_heads), dtype=np.float32)
    for i in prange(num_items):
        # int64 as the serial callers pass it (an unsigned prange index compiles it again)
        attend_item(np.int64(i), query, key_cache, value_cache, key_scales, value_scales,
                    block_tables, items, block_size, scale, acc[i], row_max[i],
                    row_sum[i])  # fmt: skip
    for r in prange(out.shape[0]):
        merge_row(r, row_items, acc, row_max, row_sum, out)


@njit(cache=True, fastmath=True)
def decode_serial(query, key_cache, value_cache, key_scales, value_scales, block_tables, items,
                  row_items, block_size, scale, out):  # fmt: skip  # pragma: no cover
    """Attention of the plan's kernel rows: out[r] for query row r of `query`. query: float32
    [num_rows, H, D] (the kernel rows only); caches float32, bfloat16 bits (uint16) or int8
    with scales (`attend_item`); out: float32 [num_rows, H, D]."""
    num_items, num_heads, head_dim = items.shape[0], query.shape[1], query.shape[2]
    acc = np.empty((num_items, num_heads, head_dim), dtype=np.float32)
    row_max = np.empty((num_items, num_heads), dtype=np.float32)
    row_sum = np.empty((num_items, num_heads), dtype=np.float32)
    for i in range(num_items):
        attend_item(i, query, key_cache, value_cache, key_scales, value_scales, block_tables,
                    items, block_size, scale, acc[i], row_max[i], row_sum[i])  # fmt: skip
    for r in range(out.shape[0]):
        merge_row(r, row_items, acc, row_max, row_sum, out)
