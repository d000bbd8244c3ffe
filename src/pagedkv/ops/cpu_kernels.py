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

What made it fast (variants and figures: benchmarks/dev_cpu_attention.py): every loop runs
over a view from 0 and vectorizes (checked with `inspect_asm`: zmm FMAs, no libm `expf`);
exp is plain arithmetic (`exp_neg`) because without SVML `math.exp` is a scalar call per
score; bfloat16 rows are widened once per (token, KV head) into an L1 row shared by the
group; the item function asks LLVM for 512-bit vectors (`prefer_512_bit_vectors`).

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


@intrinsic
def prefer_512_bit_vectors(typingctx):  # pragma: no cover
    """Let LLVM vectorize the calling function with 512-bit registers where the CPU has them.

    LLVM's tuning for recent Intel server CPUs sets `prefer-256-bit`, so the loop vectorizer
    stops at ymm registers. Per-function string attributes lift that for the kernels only
    (NUMBA_CPU_FEATURES would change every Numba function in the process). Measured on
    the development machine (Emerald Rapids, one thread): 1.05-1.25x on the decode kernel.
    Without AVX-512 the attributes have no effect.
    """

    def codegen(context, builder, signature, args):
        # llvmlite validates only enum attributes; LLVM IR accepts "key"="value" ones here.
        set.add(builder.function.attributes, '"prefer-vector-width"="512"')
        set.add(builder.function.attributes, '"min-legal-vector-width"="512"')
        return context.get_dummy_value()

    return types.none(), codegen


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


def load_row(block, t, g, scratch, i):  # pragma: no cover
    """Row (t, g) of a block as float32 [D]: a view for float32, else widened into scratch[i]."""
    raise NotImplementedError("only callable from Numba-compiled code")


@overload(load_row, inline="always")
def _load_row(block, t, g, scratch, i):  # pragma: no cover
    if block.dtype == types.float32:
        return lambda block, t, g, scratch, i: block[t, g]

    def widen(block, t, g, scratch, i):
        # Widen once into an L1-resident row that every query head of the group then reads:
        # widening in the dot products instead repeats it per head (measured 10-15 % slower).
        src, dst = block[t, g], scratch[i]
        for d in range(src.shape[0]):
            dst[d] = to_f32(src[d])
        return dst

    return widen


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
def _score_block(kb, t0, t1, q, scale, group, scores, rows):  # pragma: no cover
    """scores[h, t] = scale * q[h] . k[t, h // group] for rows [t0, t1) of one block.

    Rows are visited in memory order (token, then KV head) and four tokens at a time, so
    each query row loaded feeds four dot products.
    """
    num_kv_heads, head_dim = kb.shape[1], kb.shape[2]
    t = t0
    while t + 4 <= t1:
        for g in range(num_kv_heads):
            k0, k1 = load_row(kb, t, g, rows, 0), load_row(kb, t + 1, g, rows, 1)
            k2, k3 = load_row(kb, t + 2, g, rows, 2), load_row(kb, t + 3, g, rows, 3)
            for h in range(g * group, (g + 1) * group):
                qrow = q[h]
                s0 = s1 = s2 = s3 = np.float32(0.0)
                for d in range(head_dim):
                    x = qrow[d]
                    s0 += x * k0[d]
                    s1 += x * k1[d]
                    s2 += x * k2[d]
                    s3 += x * k3[d]
                scores[h, t], scores[h, t + 1] = s0 * scale, s1 * scale
                scores[h, t + 2], scores[h, t + 3] = s2 * scale, s3 * scale
        t += 4
    for tail in range(t, t1):
        for g in range(num_kv_heads):
            k0 = load_row(kb, tail, g, rows, 0)
            for h in range(g * group, (g + 1) * group):
                qrow = q[h]
                s0 = np.float32(0.0)
                for d in range(head_dim):
                    s0 += qrow[d] * k0[d]
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
def _accumulate_block(vb, t0, t1, group, acc, weights, rows):  # pragma: no cover
    """acc[h] += sum_t weights[h, t] * v[t, h // group], eight tokens per pass over acc.

    Summing eight weighted V rows before touching acc cuts its loads and stores (the cost
    that dominated a one-token-at-a-time loop) by eight.
    """
    num_kv_heads, head_dim = vb.shape[1], vb.shape[2]
    t = t0
    while t + 8 <= t1:
        for g in range(num_kv_heads):
            v0, v1 = load_row(vb, t, g, rows, 0), load_row(vb, t + 1, g, rows, 1)
            v2, v3 = load_row(vb, t + 2, g, rows, 2), load_row(vb, t + 3, g, rows, 3)
            v4, v5 = load_row(vb, t + 4, g, rows, 4), load_row(vb, t + 5, g, rows, 5)
            v6, v7 = load_row(vb, t + 6, g, rows, 6), load_row(vb, t + 7, g, rows, 7)
            for h in range(g * group, (g + 1) * group):
                a, w = acc[h], weights[h]
                p0, p1, p2, p3 = w[t], w[t + 1], w[t + 2], w[t + 3]
                p4, p5, p6, p7 = w[t + 4], w[t + 5], w[t + 6], w[t + 7]
                for d in range(head_dim):
                    a[d] += (p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d]) + (
                        p4 * v4[d] + p5 * v5[d] + p6 * v6[d] + p7 * v7[d]
                    )
        t += 8
    for tail in range(t, t1):
        for g in range(num_kv_heads):
            v0 = load_row(vb, tail, g, rows, 0)
            for h in range(g * group, (g + 1) * group):
                a, p0 = acc[h], weights[h, tail]
                for d in range(head_dim):
                    a[d] += p0 * v0[d]


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
    prefer_512_bit_vectors()
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
    rows = np.empty((8, head_dim), dtype=np.float32)  # widened bfloat16 rows
    lo, hi = item[ITEM_LO], item[ITEM_HI]
    for bi in range(lo // block_size, (hi - 1) // block_size + 1):
        block = table[bi]
        t0 = max(lo - bi * block_size, 0)
        t1 = min(hi - bi * block_size, block_size)
        kb, vb = key_cache[block], value_cache[block]
        _score_block(kb, t0, t1, q, scale32, group, scores, rows)
        _softmax_block(t0, t1, m, lsum, acc, scores)
        _accumulate_block(vb, t0, t1, group, acc, scores, rows)
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


@intrinsic
def _pointer(typingctx, address, like):  # pragma: no cover
    """An integer address (`Tensor.data_ptr()`) as a pointer to elements of `like`: a NumPy
    scalar type, or an array whose element type to take."""
    if isinstance(like, types.NumberClass):
        element = like.instance_type
    elif isinstance(like, types.Array):
        element = like.dtype
    else:
        return None
    if not isinstance(address, types.Integer):
        return None
    ptr_type = types.CPointer(element)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(ptr_type))

    return ptr_type(address, like), codegen


@njit(cache=True, **JIT)
def write_rows(key_address, value_address, slot_address, is_slot_int64, num_tokens, key_cache,
               value_cache):  # fmt: skip  # pragma: no cover
    """Copy token t's K/V row to slot slot_mapping[t] of the caches; skip negative slots.

    The new rows and slots arrive as addresses of contiguous tensors: turning a tensor into
    a NumPy array costs ~0.7 us, a tenth of a decode step's whole write (target < 10 us for
    32 tokens). Rows are copied as raw words of the views' type.

    Args:
        key_address, value_address: `data_ptr()` of contiguous [num_tokens, kv_heads, D]
            tensors of the cache's dtype.
        slot_address: `data_ptr()` of the contiguous int64 (`is_slot_int64`) or int32 slots.
        num_tokens: rows in each.
        key_cache, value_cache: [num_slots, row_words] views of the caches, uint64 words
            when a row is a multiple of 8 bytes (10 % faster than bytes), else uint8.

    Returns:
        -1, or the first token whose slot is past the end (nothing was written for it).
    """
    num_slots, row_words = key_cache.shape
    key = numba.carray(_pointer(key_address, key_cache), (num_tokens, row_words))
    value = numba.carray(_pointer(value_address, key_cache), (num_tokens, row_words))
    slots64 = numba.carray(_pointer(slot_address, np.int64), (num_tokens if is_slot_int64 else 0,))
    slots32 = numba.carray(_pointer(slot_address, np.int32), (num_tokens,))
    for t in range(num_tokens):
        slot = slots64[t] if is_slot_int64 else np.int64(slots32[t])
        if slot < 0:
            continue
        if slot >= num_slots:
            return t
        # Explicit loops: numba's row assignment checks for overlap and is ~2x slower.
        k_dst, v_dst, k_src, v_src = key_cache[slot], value_cache[slot], key[t], value[t]
        for i in range(row_words):
            k_dst[i] = k_src[i]
        for i in range(row_words):
            v_dst[i] = v_src[i]
    return -1


def num_threads() -> int:
    """Threads the parallel kernels use (numba's setting)."""
    return numba.get_num_threads()
