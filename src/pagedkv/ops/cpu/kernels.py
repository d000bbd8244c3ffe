"""The CPU backend's compiled code: plan a batch, attend decode rows over the paged cache.

NumPy and Numba only (no torch: tensors arrive as NumPy views), and from pagedkv only the
bfloat16 helpers of `bf16.py` and `pagedkv.runtime.kernel_cache`, which keeps the compiled
code in the user's cache directory, keyed by the kernel files' source, so that every
checkout and venv of one pagedkv version shares it. `attend_item`, `merge_row` and
`exp_parts` are public: the decoder stack (`pagedkv.runtime.stack`) calls them too.

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
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from pagedkv.ops.cpu import bf16
from pagedkv.ops.cpu.bf16 import as_float32
from pagedkv.ops.cpu.int8 import token_scale
from pagedkv.runtime import kernel_cache

kernel_cache.use_shared_cache()  # before the first `cache=True` decorator

OK, BAD_BOUNDS, BAD_QUERY_LEN, BAD_SEQ_LEN, BAD_BLOCK = range(5)
SPAN = 64
"""Tokens scored between two online-softmax updates."""
NEG_INIT = -1e30
"""Running max before any score (fastmath assumes no infinities)."""
EXACT_ORDER = {"nnan", "ninf", "nsz", "arcp", "contract", "afn"}
"""fastmath without reassociation, for a compiled function that others call. Numba links a
copy of it into each caller's code, optimized again there, and which copy runs depends on
what the process compiled or loaded first: its own (compiled in this process) or a
caller's (loaded from the cache). Reassociation lets each copy sum in its own order, and a
process that compiled the kernels gave other bits than one that loaded them."""


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
        _fill_slots(table, block_size, t0, known, slots)
        _score_span(query[row], key_cache, value_cache, key_scales, slots, n, t0 == start,
                    np.float32(scale), scores)  # fmt: skip
        _softmax_span(scores, n, acc, row_max, row_sum, pow2)
        _accumulate_span(key_cache, value_cache, value_scales, slots, n, known, scores, acc)


@njit(cache=True)
def _fill_slots(table, block_size, first, count, slots):  # pragma: no cover
    """slots[t] = the cache slot of position first + t, t < count (one division, not one each)."""
    b, offset = first // block_size, first % block_size
    for t in range(count):
        slots[t] = table[b] * block_size + offset
        offset += 1
        if offset == block_size:
            b, offset = b + 1, 0


# The span steps are separate functions, each called once per span: their inner loops then
# vectorize (in one large function LLVM left the dot products scalar), and Numba's per-call
# reference counting stays off the hot path. Each loop asks for the rows the other reads
# next (V rows in the score loop, the next span's K rows in the accumulate loop), so the
# memory is busy through both. Both take four tokens at once, so that each q load serves four
# tokens and each accumulator's load and store four V rows. The score loop takes two or three
# heads of a GQA group per K load; the accumulate loop one head at a time over the four V rows
# (1-D views): after the first head those rows are L1 hits, and a loop with one output row
# is what LLVM vectorizes best (several heads per pass widened each bfloat16 V element once
# per head, and cost more than the loads they saved).


@njit(cache=True, fastmath=True)
def _score_span(q, key_cache, value_cache, key_scales, slots, n, first, scale,
                scores):  # fmt: skip  # pragma: no cover
    """scores[h, t] = scale * K scale * q[h] . K[slots[t], h // group], t < n; prefetches
    the V rows of each group of tokens and, in an item's `first` span, the K rows a group
    ahead (the accumulate loop asks for the other spans' K rows)."""
    num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[1]
    group = num_heads // num_kv_heads
    k = key_cache
    last = n - 1
    t = 0
    while t + bf16.TOKENS <= n:
        j0, j1, j2, j3 = slots[t], slots[t + 1], slots[t + 2], slots[t + 3]
        # The next group's slots, read once here: the head loop's stores may alias `slots`.
        ahead = (slots[min(t + 4, last)], slots[min(t + 5, last)], slots[min(t + 6, last)],
                 slots[min(t + 7, last)])  # fmt: skip
        for g in range(num_kv_heads):
            if first:
                bf16.prefetch_head(key_cache, ahead, g)
            bf16.prefetch_head(value_cache, (j0, j1, j2, j3), g)
            # the softmax scale times each token's K scale
            ks = key_scales
            c = (scale * token_scale(ks, j0, g), scale * token_scale(ks, j1, g),
                 scale * token_scale(ks, j2, g), scale * token_scale(ks, j3, g))  # fmt: skip
            h, end = g * group, (g + 1) * group
            while h + 2 <= end:
                three = end - h == 3  # a group of three, or the last three of an odd one
                _score_heads(q, k, j0, j1, j2, j3, g, h, three, t, c, scores)
                h += 3 if three else 2
            if h < end:  # a group of one
                s0 = s1 = s2 = s3 = np.float32(0.0)
                for d in range(head_dim):
                    qd = q[h, d]
                    s0 += qd * as_float32(k[j0, g, d])
                    s1 += qd * as_float32(k[j1, g, d])
                    s2 += qd * as_float32(k[j2, g, d])
                    s3 += qd * as_float32(k[j3, g, d])
                scores[h, t], scores[h, t + 1] = s0 * c[0], s1 * c[1]
                scores[h, t + 2], scores[h, t + 3] = s2 * c[2], s3 * c[3]
        t += bf16.TOKENS
    for rest in range(t, n):  # the item's last few tokens
        j = slots[rest]
        for h in range(num_heads):
            s = np.float32(0.0)
            for d in range(head_dim):
                s += q[h, d] * as_float32(k[j, h // group, d])
            scores[h, rest] = s * (scale * token_scale(key_scales, j, h // group))


@njit(cache=True, fastmath=True, inline="always")
def _score_heads(q, k, j0, j1, j2, j3, g, h, three, t, c, scores):  # pragma: no cover
    """`_score_span`'s loop for heads h, h + 1 (and h + 2 where `three`) of KV head g, one K
    load for all, each token's sum times its factor in `c`; `three` is fixed for the loop,
    which LLVM compiles once per case."""
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = c0 = c1 = c2 = c3 = np.float32(0.0)
    for d in range(q.shape[1]):
        k0, k1 = as_float32(k[j0, g, d]), as_float32(k[j1, g, d])
        k2, k3 = as_float32(k[j2, g, d]), as_float32(k[j3, g, d])
        qa, qb = q[h, d], q[h + 1, d]
        a0 += qa * k0
        a1 += qa * k1
        a2 += qa * k2
        a3 += qa * k3
        b0 += qb * k0
        b1 += qb * k1
        b2 += qb * k2
        b3 += qb * k3
        if three:
            qc = q[h + 2, d]
            c0 += qc * k0
            c1 += qc * k1
            c2 += qc * k2
            c3 += qc * k3
    scores[h, t], scores[h, t + 1] = a0 * c[0], a1 * c[1]
    scores[h, t + 2], scores[h, t + 3] = a2 * c[2], a3 * c[3]
    scores[h + 1, t], scores[h + 1, t + 1] = b0 * c[0], b1 * c[1]
    scores[h + 1, t + 2], scores[h + 1, t + 3] = b2 * c[2], b3 * c[3]
    if three:
        scores[h + 2, t], scores[h + 2, t + 1] = c0 * c[0], c1 * c[1]
        scores[h + 2, t + 2], scores[h + 2, t + 3] = c2 * c[2], c3 * c[3]


@njit(cache=True, fastmath=EXACT_ORDER)
def _softmax_span(scores, n, acc, row_max, row_sum, pow2):  # pragma: no cover
    """Online softmax: raise each head's max over the span's n scores, rescale acc and
    row_sum, and turn the scores into weights exp(score - max). The weights are summed in
    four lanes added in a fixed order (`EXACT_ORDER`)."""
    two_to = pow2.view(np.float32)
    for h in range(scores.shape[0]):
        new_max = row_max[h]
        for t in range(n):
            new_max = max(new_max, scores[h, t])
        for t in range(n):
            scores[h, t], pow2[t] = exp_parts(scores[h, t] - new_max)
        for t in range(n):
            scores[h, t] *= two_to[t]
        s0 = s1 = s2 = s3 = np.float32(0.0)
        for t in range(0, n - 3, 4):
            s0, s1 = s0 + scores[h, t], s1 + scores[h, t + 1]
            s2, s3 = s2 + scores[h, t + 2], s3 + scores[h, t + 3]
        for t in range(n - n % 4, n):
            s0 += scores[h, t]
        total = (s0 + s1) + (s2 + s3)
        correction = np.exp(row_max[h] - new_max)
        row_sum[h] = row_sum[h] * correction + total
        row_max[h] = new_max
        for d in range(acc.shape[1]):
            acc[h, d] *= correction


@njit(fastmath=True, inline="always")
def exp_parts(y):  # pragma: no cover
    """exp(y), y <= 0, as 2^f and the bits of 2^k (y / ln 2 = k + f, k an integer, |f| <=
    1/2), multiplied by the caller once the bits are read as float32 (through an int32 buffer
    or `bf16.bits_as_float32`): unlike libm's expf (a scalar call) this vectorizes. A degree-7
    polynomial gives 2^f to float32 rounding; arguments below -87 give about 1e-38."""
    x = max(y, np.float32(-87.0)) * np.float32(1.4426950408889634)
    k = np.floor(x + np.float32(0.5))
    f = (x - k) * np.float32(0.6931471805599453)  # f = ln(2^(x - k)), |f| <= ln2 / 2
    p = np.float32(1.0 / 5040.0)
    p = p * f + np.float32(1.0 / 720.0)
    p = p * f + np.float32(1.0 / 120.0)
    p = p * f + np.float32(1.0 / 24.0)
    p = p * f + np.float32(1.0 / 6.0)
    p = p * f + np.float32(0.5)
    p = p * f + np.float32(1.0)
    return p * f + np.float32(1.0), (np.int32(k) + 127) << 23


@njit(cache=True, fastmath=True)
def _accumulate_span(key_cache, value_cache, value_scales, slots, n, known, weights,
                     acc):  # fmt: skip  # pragma: no cover
    """acc[h] += weights[h, t] * V scale * V[slots[t], h // group], t < n; prefetches the K
    rows of the next span's tokens (slots[n:known]) as it goes."""
    num_heads, head_dim = acc.shape
    num_kv_heads = value_cache.shape[1]
    group = num_heads // num_kv_heads
    last = known - 1
    t = 0
    while t + bf16.TOKENS <= n:
        j0, j1, j2, j3 = slots[t], slots[t + 1], slots[t + 2], slots[t + 3]
        # The next span's tokens t..t + 3 (while n + t < known): requests spread over the loop
        ahead = (slots[min(n + t, last)], slots[min(n + t + 1, last)],
                 slots[min(n + t + 2, last)], slots[min(n + t + 3, last)])  # fmt: skip
        for g in range(num_kv_heads):
            if n + t < known:
                bf16.prefetch_head(key_cache, ahead, g)
            v0, v1 = value_cache[j0, g], value_cache[j1, g]
            v2, v3 = value_cache[j2, g], value_cache[j3, g]
            f0, f1 = token_scale(value_scales, j0, g), token_scale(value_scales, j1, g)
            f2, f3 = token_scale(value_scales, j2, g), token_scale(value_scales, j3, g)
            for h in range(g * group, (g + 1) * group):
                a0, a1 = weights[h, t] * f0, weights[h, t + 1] * f1
                a2, a3 = weights[h, t + 2] * f2, weights[h, t + 3] * f3
                out = acc[h]
                for d in range(head_dim):
                    out[d] += (a0 * as_float32(v0[d]) + a1 * as_float32(v1[d])
                               + a2 * as_float32(v2[d]) + a3 * as_float32(v3[d]))  # fmt: skip
        t += bf16.TOKENS
    for rest in range(t, n):
        j = slots[rest]
        for h in range(num_heads):
            p = weights[h, rest] * token_scale(value_scales, j, h // group)
            for d in range(head_dim):
                acc[h, d] += p * as_float32(value_cache[j, h // group, d])


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
