"""Planning for the CPU backend: check the batch and cut it into kernel items (Numba, serial).

One pass over the sequences validates the packed layout and block ids (cheaper here than
in NumPy for small batches) and decides, per sequence, kernel rows or the prefill path.
"""

from __future__ import annotations

import numpy as np
from numba import njit

OK, BAD_BOUNDS, BAD_QUERY_LEN, BAD_SEQ_LEN, BAD_BLOCK = range(5)
MIN_CHUNK = 256
"""Fewest key positions worth a separate item (smaller splits cost more to merge)."""


@njit(cache=True)
def plan_items(
    query_start_loc,
    seq_lens,
    block_tables,
    num_tokens,
    num_blocks,
    block_size,
    window,
    max_decode_query,
    num_threads,
):  # pragma: no cover
    """Validate the batch and split it between the decode kernel and the prefill path.

    A sequence with 1..`max_decode_query` new tokens becomes kernel rows (one per new token);
    a longer one goes to `prefill_seqs`. A row whose key range is longer than `chunk` is
    split at multiples of `chunk` (a multiple of block_size), chosen so that the batch makes
    about two items per thread.

    Returns:
        (items int64 [n, 6], splits int64 [k, 3], rows int64 [num_rows], prefill_seqs int64,
        total key positions over all rows, error code, sequence of the error); see
        `cpu_kernels` for the table columns. rows[r] is the query row of output row r.
    """
    num_seqs = seq_lens.shape[0]
    max_context = block_tables.shape[1] * block_size
    if query_start_loc[0] != 0 or query_start_loc[num_seqs] != num_tokens:
        return _empty_plan(BAD_BOUNDS, 0)
    total = 0
    num_rows = 0
    for s in range(num_seqs):
        q_len = query_start_loc[s + 1] - query_start_loc[s]
        if q_len < 0:
            return _empty_plan(BAD_QUERY_LEN, s)
        if seq_lens[s] < q_len or seq_lens[s] > max_context:
            return _empty_plan(BAD_SEQ_LEN, s)
        for bi in range((seq_lens[s] + block_size - 1) // block_size):
            if block_tables[s, bi] < 0 or block_tables[s, bi] >= num_blocks:
                return _empty_plan(BAD_BLOCK, s)
        if q_len <= max_decode_query:
            num_rows += q_len
            span = seq_lens[s] if window <= 0 else min(seq_lens[s], window)
            total += span * q_len
    chunk = max(-(-total // (2 * num_threads)), MIN_CHUNK)
    chunk = -(-chunk // block_size) * block_size
    # A row of span x makes at most x // chunk + 2 items (its ends need not be aligned).
    items = np.empty((2 * num_rows + total // chunk + 1, 6), dtype=np.int64)
    splits = np.empty((num_rows, 3), dtype=np.int64)
    rows = np.empty(num_rows, dtype=np.int64)
    prefill = np.empty(num_seqs, dtype=np.int64)
    n = k = r = num_prefill = num_parts = 0
    for s in range(num_seqs):
        q0, q1 = query_start_loc[s], query_start_loc[s + 1]
        if q1 - q0 > max_decode_query:
            prefill[num_prefill] = s
            num_prefill += 1
            continue
        for row in range(q0, q1):
            pos = seq_lens[s] - (q1 - row)
            start = 0 if window <= 0 else max(0, pos - window + 1)
            first = n
            while start <= pos:
                end = min((start // chunk + 1) * chunk, pos + 1)
                items[n, 0], items[n, 1], items[n, 2] = row, s, start
                items[n, 3], items[n, 4], items[n, 5] = end, r, -1
                n += 1
                start = end
            if n - first > 1:
                splits[k, 0], splits[k, 1], splits[k, 2] = r, num_parts, num_parts + n - first
                for i in range(first, n):
                    items[i, 5] = num_parts
                    num_parts += 1
                k += 1
            rows[r] = row
            r += 1
    return items[:n], splits[:k], rows, prefill[:num_prefill], total, OK, 0


@njit(cache=True)
def _empty_plan(code, seq):  # pragma: no cover
    return (
        np.empty((0, 6), dtype=np.int64),
        np.empty((0, 3), dtype=np.int64),
        np.empty(0, dtype=np.int64),
        np.empty(0, dtype=np.int64),
        0,
        code,
        seq,
    )
