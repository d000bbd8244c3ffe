"""Numba kernels of the CPU backend: paged decode attention that walks blocks in place.

Work is cut into items: one item is one query row over one range of key positions
``[lo, hi)``. Long rows are split into several items so that a single long sequence still
uses every core (flash-decoding); the partial softmax states of a split row are merged at
the end, after the parallel loop. A row with one item writes its output directly.

Each item walks its blocks through the block table::

    positions  lo                                  hi
               |--------|--------|--------|--------|
    blocks     bt[lo//bs]  ...               bt[(hi-1)//bs]   (each read contiguously)

and keeps, per query head, an online softmax state (running max m, sum l, weighted sum acc).
For a block it scores all its tokens first, raises the max once, rescales, then accumulates,
reading each K/V row once for all query heads of its group, in memory order. The running
max starts at a large negative finite value, never -inf: under `fastmath` the compiler may
assume no infinities, and exp(-inf - -inf) would be undefined.

Item table (int64 [num_items, 6]) columns: query row, sequence, lo, hi, output row, partial
slot (-1: single item, written to the output row). Split table (int64 [num_split, 3]):
output row, first partial slot, end partial slot.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import types
from numba.extending import intrinsic, overload

_NEG = -1.0e30
JIT = dict(fastmath=True, boundscheck=False, error_model="numpy")
"""Options of every kernel: vectorizable reductions, no bounds checks, no Python-style
division checks (they add branches and a Python exception path to inner loops)."""
ITEM_QROW, ITEM_SEQ, ITEM_LO, ITEM_HI, ITEM_OUT, ITEM_PART = range(6)


@intrinsic
def _f32_from_bits(typingctx, bits):  # pragma: no cover
    """Reinterpret uint32 bits as a float32 (a bit cast, no conversion)."""
    if bits != types.uint32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


def to_f32(x):  # pragma: no cover
    """A cache element as float32: float32 as is, bfloat16 bits (uint16) widened."""
    raise NotImplementedError("only callable from Numba-compiled code")


@overload(to_f32, inline="always")
def _to_f32(x):  # pragma: no cover
    if x == types.uint16:
        # bfloat16 is the high half of a float32: shift the bits up, then reinterpret.
        return lambda x: _f32_from_bits(np.uint32(np.uint32(x) << 16))
    if x == types.float32:
        return lambda x: x
    return None


_LN2_POWERS = (0.6931471805599453, 0.2402265069591007, 0.05550410866482158,
               0.009618129107628477, 0.0013333558146428443, 0.0001540353039338161)  # fmt: skip
"""ln(2)^k / k! for k = 1..6: Taylor coefficients of 2^f = exp(f ln 2)."""


@njit(cache=True, inline="always", **JIT)
def exp_neg(x):  # pragma: no cover
    """exp(x) for float32 x <= 0, in plain arithmetic so that loops over it vectorize.

    There is no SVML here, so `math.exp` is a scalar libm call per score (a third of the
    kernel's time). x = (n + f) / log2(e) with integer n and |f| <= 1/2: 2^n is built in the
    exponent bits, 2^f by a degree-6 Taylor polynomial (relative error < 2e-7). Inputs below
    -87 are clamped (exp(-87) ~ 1.6e-38, still a normal float32).
    """
    t = max(x, np.float32(-87.0)) * np.float32(1.4426950408889634)
    n = np.float32(math.floor(t + np.float32(0.5)))
    f = t - n
    p = np.float32(_LN2_POWERS[5])
    p = p * f + np.float32(_LN2_POWERS[4])
    p = p * f + np.float32(_LN2_POWERS[3])
    p = p * f + np.float32(_LN2_POWERS[2])
    p = p * f + np.float32(_LN2_POWERS[1])
    p = p * f + np.float32(_LN2_POWERS[0])
    p = p * f + np.float32(1.0)
    return p * _f32_from_bits(np.uint32((np.int32(n) + np.int32(127)) << np.int32(23)))


@njit(cache=True, inline="always", **JIT)
def _score_block(kb, t0, t1, q, scale, group, scores):  # pragma: no cover
    """scores[h, t] = scale * q[h] . k[t, h // group] for rows [t0, t1) of one block.

    Rows are visited in memory order (token, then KV head) and four tokens at a time, so
    each query row loaded feeds four dot products; bfloat16 rows widen in registers.
    """
    num_kv_heads, head_dim = kb.shape[1], kb.shape[2]
    t = t0
    while t + 4 <= t1:
        for g in range(num_kv_heads):
            k0, k1, k2, k3 = kb[t, g], kb[t + 1, g], kb[t + 2, g], kb[t + 3, g]
            for h in range(g * group, (g + 1) * group):
                qrow = q[h]
                s0 = s1 = s2 = s3 = np.float32(0.0)
                for d in range(head_dim):
                    x = qrow[d]
                    s0 += x * to_f32(k0[d])
                    s1 += x * to_f32(k1[d])
                    s2 += x * to_f32(k2[d])
                    s3 += x * to_f32(k3[d])
                scores[h, t], scores[h, t + 1] = s0 * scale, s1 * scale
                scores[h, t + 2], scores[h, t + 3] = s2 * scale, s3 * scale
        t += 4
    for tail in range(t, t1):
        for g in range(num_kv_heads):
            k0 = kb[tail, g]
            for h in range(g * group, (g + 1) * group):
                qrow = q[h]
                s0 = np.float32(0.0)
                for d in range(head_dim):
                    s0 += qrow[d] * to_f32(k0[d])
                scores[h, tail] = s0 * scale


@njit(cache=True, inline="always", **JIT)
def _softmax_block(t0, t1, m, lsum, acc, scores):  # pragma: no cover
    """Raise each head's running max over the block's scores, rescale, scores -> exp weights.

    One max and at most one rescale of acc per head and block, not per token; the exps run
    over a contiguous view from 0 so that they vectorize.
    """
    for h in range(m.shape[0]):
        row = scores[h, t0:t1]
        new_max = m[h]
        for t in range(row.shape[0]):
            new_max = max(new_max, row[t])
        if new_max > m[h]:
            alpha = exp_neg(m[h] - new_max)
            m[h] = new_max
            lsum[h] *= alpha
            a = acc[h]
            for d in range(a.shape[0]):
                a[d] *= alpha
        total = np.float32(0.0)
        for t in range(row.shape[0]):
            w = exp_neg(row[t] - new_max)
            row[t] = w
            total += w
        lsum[h] += total


@njit(cache=True, inline="always", **JIT)
def _accumulate_block(vb, t0, t1, group, acc, weights):  # pragma: no cover
    """acc[h] += sum_t weights[h, t] * v[t, h // group], eight tokens per pass over acc.

    Summing eight weighted V rows before touching acc cuts its loads and stores (the cost
    that dominated a one-token-at-a-time loop) by eight.
    """
    num_kv_heads, head_dim = vb.shape[1], vb.shape[2]
    t = t0
    while t + 8 <= t1:
        for g in range(num_kv_heads):
            v0, v1, v2, v3 = vb[t, g], vb[t + 1, g], vb[t + 2, g], vb[t + 3, g]
            v4, v5, v6, v7 = vb[t + 4, g], vb[t + 5, g], vb[t + 6, g], vb[t + 7, g]
            for h in range(g * group, (g + 1) * group):
                a, w = acc[h], weights[h]
                p0, p1, p2, p3 = w[t], w[t + 1], w[t + 2], w[t + 3]
                p4, p5, p6, p7 = w[t + 4], w[t + 5], w[t + 6], w[t + 7]
                for d in range(head_dim):
                    a[d] += (
                        p0 * to_f32(v0[d]) + p1 * to_f32(v1[d])
                        + p2 * to_f32(v2[d]) + p3 * to_f32(v3[d])
                    ) + (
                        p4 * to_f32(v4[d]) + p5 * to_f32(v5[d])
                        + p6 * to_f32(v6[d]) + p7 * to_f32(v7[d])
                    )  # fmt: skip
        t += 8
    for tail in range(t, t1):
        for g in range(num_kv_heads):
            v0 = vb[tail, g]
            for h in range(g * group, (g + 1) * group):
                a, p0 = acc[h], weights[h, tail]
                for d in range(head_dim):
                    a[d] += p0 * to_f32(v0[d])


@njit(cache=True, **JIT)
def _finish(item, acc, m, lsum, out, part_acc, part_m, part_l):  # pragma: no cover
    part = item[ITEM_PART]
    if part < 0:
        row = out[item[ITEM_OUT]]
        for h in range(acc.shape[0]):
            inv = np.float32(1.0) / lsum[h]
            for d in range(acc.shape[1]):
                row[h, d] = acc[h, d] * inv
    else:
        part_acc[part] = acc
        part_m[part] = m
        part_l[part] = lsum


@njit(cache=True, **JIT)
def _item(
    item, query, key_cache, value_cache, block_tables, scale, out, part_acc, part_m, part_l
):  # pragma: no cover
    """One item over caches [num_blocks, bs, kv_heads, D], float32 or bfloat16 bits (uint16)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size = key_cache.shape[1]
    group = num_heads // key_cache.shape[2]
    q = query[item[ITEM_QROW]]
    table = block_tables[item[ITEM_SEQ]]
    m = np.full(num_heads, np.float32(_NEG), dtype=np.float32)
    lsum = np.zeros(num_heads, dtype=np.float32)
    acc = np.zeros((num_heads, head_dim), dtype=np.float32)
    scores = np.empty((num_heads, block_size), dtype=np.float32)
    scale32 = np.float32(scale)
    lo, hi = item[ITEM_LO], item[ITEM_HI]
    for bi in range(lo // block_size, (hi - 1) // block_size + 1):
        block = table[bi]
        t0 = max(lo - bi * block_size, 0)
        t1 = min(hi - bi * block_size, block_size)
        kb, vb = key_cache[block], value_cache[block]
        _score_block(kb, t0, t1, q, scale32, group, scores)
        _softmax_block(t0, t1, m, lsum, acc, scores)
        _accumulate_block(vb, t0, t1, group, acc, scores)
    _finish(item, acc, m, lsum, out, part_acc, part_m, part_l)


@njit(cache=True, **JIT)
def _combine(splits, out, part_acc, part_m, part_l):  # pragma: no cover
    """Merge each split row's partial states into its output row: sum(acc_i w_i) / sum(l_i w_i)."""
    num_heads, head_dim = out.shape[1], out.shape[2]
    for k in range(splits.shape[0]):
        row, p0, p1 = out[splits[k, 0]], splits[k, 1], splits[k, 2]
        for h in range(num_heads):
            top = part_m[p0, h]
            for p in range(p0 + 1, p1):
                top = max(top, part_m[p, h])
            total = np.float32(0.0)
            row[h] = 0.0
            for p in range(p0, p1):
                w = math.exp(part_m[p, h] - top)
                total += part_l[p, h] * w
                for d in range(head_dim):
                    row[h, d] += part_acc[p, h, d] * w
            for d in range(head_dim):
                row[h, d] /= total


# Two drivers (each compiled for float32 and for bfloat16 bits). Small batches run serially:
# starting a parallel region costs more than the work (and far more on a busy machine).
@njit(cache=True, parallel=True, **JIT)
def decode_parallel(query, key_cache, value_cache, block_tables, items, splits, scale, out,
                    part_acc, part_m, part_l):  # fmt: skip  # pragma: no cover
    """Run every item across threads, then merge split rows.

    Args:
        query: float32 [num_tokens, H, D]. key_cache, value_cache: float32 or uint16
        (bfloat16 bits) [num_blocks, bs, kv_heads, D]. block_tables: int32 [num_seqs, max].
        items, splits: the plan (module docstring). out: float32 [num_rows, H, D].
        part_acc/part_m/part_l: float32 [num_parts, H, D] / [num_parts, H] scratch.
    """
    for i in prange(items.shape[0]):
        _item(items[i], query, key_cache, value_cache, block_tables, scale, out, part_acc,
              part_m, part_l)  # fmt: skip
    _combine(splits, out, part_acc, part_m, part_l)


@njit(cache=True, **JIT)
def decode_serial(query, key_cache, value_cache, block_tables, items, splits, scale, out,
                  part_acc, part_m, part_l):  # fmt: skip  # pragma: no cover
    """As `decode_parallel`, on the calling thread."""
    for i in range(items.shape[0]):
        _item(items[i], query, key_cache, value_cache, block_tables, scale, out, part_acc,
              part_m, part_l)  # fmt: skip
    _combine(splits, out, part_acc, part_m, part_l)


@njit(cache=True, boundscheck=False)
def write_rows(key, value, key_cache, value_cache, slot_mapping):  # pragma: no cover
    """Copy token t of key/value to slot slot_mapping[t] of the caches; skip negative slots.

    key/value: [num_tokens, kv_heads, D]; caches: [num_slots, kv_heads, D]; all of one
    dtype (bfloat16/float16 as int16 bits: a row copy is a bit copy).

    Returns:
        -1, or the first token whose slot is past the end (nothing was written for it).
    """
    num_slots, num_heads, head_dim = key_cache.shape
    for t in range(slot_mapping.shape[0]):
        slot = slot_mapping[t]
        if slot < 0:
            continue
        if slot >= num_slots:
            return t
        # Explicit loops: numba's row assignment checks for overlap and is ~2x slower.
        for h in range(num_heads):
            k_dst, v_dst, k_src, v_src = (
                key_cache[slot, h],
                value_cache[slot, h],
                key[t, h],
                value[t, h],
            )
            for d in range(head_dim):
                k_dst[d] = k_src[d]
            for d in range(head_dim):
                v_dst[d] = v_src[d]
    return -1


def num_threads() -> int:
    """Threads the parallel kernels use (numba's setting)."""
    return numba.get_num_threads()
