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
For a span of blocks (`SPAN_TOKENS`) it scores all their tokens first, raises the max once,
rescales, then accumulates.
The running max starts at a large negative finite value, never -inf: under `fastmath` the
compiler may assume no infinities, and exp(-inf - -inf) would be undefined.

The caches arrive as flat 1-D views (NHD: a token's row holds all its KV heads, so a block is
one contiguous run of block_size x num_kv_heads x head_dim elements) and the inner loops are
written with explicit 16-lane vectors (`pagedkv.ops.simd`), walking a block's rows in memory
order. With GQA (group >= 2) the scores are 4 tokens x 4 query heads of one KV head per tile
and the V accumulation walks the same tiles with their 16 weights in registers, so each K/V
vector loaded feeds four heads; a group that is not a multiple of 4 completes its last tile
with a sink row (index num_heads of the scratch arrays, never read). Software prefetch asks
for K rows a tile ahead and, for bfloat16, for the tile's V rows (`prefetch_mode`).
Without GQA (group 1) nothing is shared and a tile is 4 tokens of one head. A head's
vectors are padded to whole vectors (zeros in the query, partial loads at the end of each K/V
row), so any head_dim works. exp is plain arithmetic (`exp_neg`) because without SVML
`math.exp` is a scalar call per score. Variants and figures: benchmarks/dev_cpu_attention.py.

Item table (int64 [num_items, 6]) columns: query row, sequence, lo, hi, output row, partial
slot (-1: single item, written to the output row). Split table (int64 [num_split, 3]):
output row, first partial slot, end partial slot.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import types
from numba.extending import intrinsic

from pagedkv.ops.cpu_plan import OK, plan_items
from pagedkv.ops.simd import (
    EXP_FLOOR,
    LANES,
    LN2_POWERS,
    vadd,
    velem,
    vexp_neg,
    vfma,
    vhmax,
    vhsum,
    vkeep,
    vload,
    vload_n,
    vmax,
    vmul,
    vprefetch,
    vsplat,
    vstore,
    vstore_quarter,
    vsub,
    vsum16,
    vzero,
)

_NEG = -1.0e30
JIT = dict(fastmath=True, boundscheck=False, error_model="numpy")
"""Options of every kernel: vectorizable reductions, no bounds checks, no Python-style
division checks (they add branches and a Python exception path to inner loops)."""
ITEM_QROW, ITEM_SEQ, ITEM_LO, ITEM_HI, ITEM_OUT, ITEM_PART = range(6)
SPAN_TOKENS = 64
"""Blocks are scored this many tokens at a time before one softmax pass (at least a block)."""
NEEDS_PREFILL = -1
"""`plan_and_decode`'s status for a batch with a sequence past the decode rows' length."""


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


@njit(cache=True, inline="always", **JIT)
def exp_neg(x):  # pragma: no cover
    """exp(x) for float32 x <= 0 in plain arithmetic (`simd.vexp_neg` is the 16-lane form).

    There is no SVML here, so `math.exp` is a scalar libm call. x = (n + f) / log2(e) with
    integer n and |f| <= 1/2: 2^n is built in the exponent bits, 2^f by a degree-6 Taylor
    polynomial (relative error < 2.2e-7 on [-1, 0], < 6e-7 on [-10, 0], < 5e-6 down to
    EXP_FLOOR, where x * log2(e) rounded to float32 dominates). Inputs below EXP_FLOOR are
    clamped.
    """
    t = max(x, np.float32(EXP_FLOOR)) * np.float32(1.4426950408889634)
    n = np.float32(math.floor(t + np.float32(0.5)))
    f = t - n
    p = np.float32(LN2_POWERS[5])
    p = p * f + np.float32(LN2_POWERS[4])
    p = p * f + np.float32(LN2_POWERS[3])
    p = p * f + np.float32(LN2_POWERS[2])
    p = p * f + np.float32(LN2_POWERS[1])
    p = p * f + np.float32(LN2_POWERS[0])
    p = p * f + np.float32(1.0)
    return p * _f32_from_bits(np.uint32((np.int32(n) + np.int32(127)) << np.int32(23)))


SERIAL_BYTES = 1 << 19
"""Below this much KV to read, a batch runs on the calling thread (no parallel start)."""


@njit(cache=True)
def count_workers(kv_bytes, num_items, num_threads):  # pragma: no cover
    """Threads to split a batch of `num_items` items reading `kv_bytes` of KV between; 1
    keeps it on the calling thread: starting a parallel region costs more than small work
    (and far more on a busy machine)."""
    if num_threads == 1 or kv_bytes < SERIAL_BYTES:
        return 1
    return min(num_threads, num_items)


PREFETCH_NONE, PREFETCH_K, PREFETCH_KV = range(3)
PREFETCH_BYTES = 64 << 20
"""float32 batches reading at least this much KV prefetch K rows ahead. Measured on the
development machine (run I in docs/benchmarks.md): 1.08-1.11x at 268 MB, which streams from
DRAM, 0.91-0.97x at 4-33 MB, which stays in cache between calls."""


@njit(cache=True)
def prefetch_mode(element_size, kv_bytes):  # pragma: no cover
    """Software prefetch for a batch: bfloat16 always asks for the next tile's K and this
    tile's V (a 16-lane load covers half a cache line, so demand loads alone keep too few
    lines in flight: 1.02-1.49x); float32 asks for K ahead once the batch is too large to
    stay in cache (`PREFETCH_BYTES`)."""
    if element_size == 2:
        return PREFETCH_KV
    return PREFETCH_K if kv_bytes >= PREFETCH_BYTES else PREFETCH_NONE


@njit(cache=True, inline="always", **JIT)
def _prefetch_tile(key_cache, value_cache, base, next_base, t, t1, block_size, row, head_offset,
                   head_dim, r0, r1, r2, r3, prefetch):  # fmt: skip  # pragma: no cover
    """Prefetch one KV head's slice of the K rows four tokens after the tile at token t
    (from the next block past t1) and, for PREFETCH_KV, of the tile's own V rows r0..r3."""
    line = 16 if key_cache.itemsize == 4 else 32  # elements per 64-byte cache line
    for ahead in range(t + 4, t + 8):
        if ahead < t1:
            r = base + ahead * row + head_offset
        elif next_base >= 0:
            r = next_base + (ahead - block_size) * row + head_offset
        else:
            break
        for c in range(0, head_dim, line):
            vprefetch(key_cache, r + c)
    if prefetch == PREFETCH_KV:
        for c in range(0, head_dim, line):
            vprefetch(value_cache, r0 + c)
            vprefetch(value_cache, r1 + c)
            vprefetch(value_cache, r2 + c)
            vprefetch(value_cache, r3 + c)


@njit(cache=True, inline="always", **JIT)
def _score_shared(key_cache, base, t0, t1, q_pad, padded_dim, scale, num_heads, group,
                  num_kv_heads, head_dim, scores, stride, off, value_cache, next_base,
                  block_size, prefetch):  # fmt: skip  # pragma: no cover
    """scores[h * stride + off + t] = scale * q[h] . k[t, h // group] for tokens [t0, t1) of
    the block starting at element `base` of the flat key cache; `group` >= 2.

    Four tokens at a time in memory order (their rows are adjacent), and within them each KV
    head's query heads four at a time: a 4 x 4 tile of dot products, 16 FMAs per 8 vector
    loads, reduced together by `vsum16`. When the group is not a multiple of 4 its last
    tile is completed with the sink row `num_heads` (a zero query whose scores are never
    read): wasting part of one tile per group (half for group 2, a quarter for group 3)
    measured faster than narrower tiles or tiles spanning KV heads. Past t1 a tile re-reads
    the last row; its extra scores land after t1: in the next block's columns (written
    after) or in the padding.

    `prefetch` (see `prefetch_mode`) asks for the K rows one tile ahead (in the next block,
    at `next_base`, when past this one; -1: none) and, with PREFETCH_KV, for this tile's V
    rows, which `_accumulate_shared` reads after the softmax.
    """
    row = num_kv_heads * head_dim
    vscale = vsplat(scale)
    z = vzero()
    last = t1 - 1
    t = t0
    while t < t1:
        r0 = base + t * row
        r1 = base + min(t + 1, last) * row
        r2 = base + min(t + 2, last) * row
        r3 = base + min(t + 3, last) * row
        for g in range(num_kv_heads):
            end = (g + 1) * group
            if prefetch != PREFETCH_NONE:
                _prefetch_tile(key_cache, value_cache, base, next_base, t, t1, block_size, row,
                               g * head_dim, head_dim, r0, r1, r2, r3, prefetch)  # fmt: skip
            for h in range(g * group, end, 4):
                h1, h2, h3 = _tile_heads(h, end, num_heads)
                q0, q1, q2, q3 = h * padded_dim, h1 * padded_dim, h2 * padded_dim, h3 * padded_dim
                s00 = s01 = s02 = s03 = s10 = s11 = s12 = s13 = z
                s20 = s21 = s22 = s23 = s30 = s31 = s32 = s33 = z
                for c in range(0, head_dim, LANES):
                    n = head_dim - c
                    k0, k1 = vload_n(key_cache, r0 + c, n), vload_n(key_cache, r1 + c, n)
                    k2, k3 = vload_n(key_cache, r2 + c, n), vload_n(key_cache, r3 + c, n)
                    s00, s01, s02, s03 = _fma4(vload(q_pad, q0 + c), k0, k1, k2, k3,
                                               s00, s01, s02, s03)  # fmt: skip
                    s10, s11, s12, s13 = _fma4(vload(q_pad, q1 + c), k0, k1, k2, k3,
                                               s10, s11, s12, s13)  # fmt: skip
                    s20, s21, s22, s23 = _fma4(vload(q_pad, q2 + c), k0, k1, k2, k3,
                                               s20, s21, s22, s23)  # fmt: skip
                    s30, s31, s32, s33 = _fma4(vload(q_pad, q3 + c), k0, k1, k2, k3,
                                               s30, s31, s32, s33)  # fmt: skip
                tile = vsum16(s00, s01, s02, s03, s10, s11, s12, s13,
                              s20, s21, s22, s23, s30, s31, s32, s33)  # fmt: skip
                tile = vmul(tile, vscale)  # lanes 4i + j: the tile's head i, token t + j
                vstore_quarter(scores, h * stride + off + t, tile, 0)
                vstore_quarter(scores, h1 * stride + off + t, tile, 1)
                vstore_quarter(scores, h2 * stride + off + t, tile, 2)
                vstore_quarter(scores, h3 * stride + off + t, tile, 3)
            r0, r1, r2, r3 = r0 + head_dim, r1 + head_dim, r2 + head_dim, r3 + head_dim
        t += 4


@njit(cache=True, inline="always", **JIT)
def _score_single(key_cache, base, t0, t1, q_pad, padded_dim, scale, num_heads, head_dim,
                  scores, stride, off):  # fmt: skip  # pragma: no cover
    """As `_score_shared` when every query head has its own KV head (group 1): no K row is
    shared, so a tile is 4 tokens of one head, still in memory order."""
    row = num_heads * head_dim
    vscale = vsplat(scale)
    z = vzero()
    last = t1 - 1
    for t in range(t0, t1, 4):
        r0 = base + t * row
        r1 = base + min(t + 1, last) * row
        r2 = base + min(t + 2, last) * row
        r3 = base + min(t + 3, last) * row
        for h in range(num_heads):
            s0 = s1 = s2 = s3 = z
            for c in range(0, head_dim, LANES):
                n = head_dim - c
                q = vload(q_pad, h * padded_dim + c)
                s0 = vfma(q, vload_n(key_cache, r0 + c, n), s0)
                s1 = vfma(q, vload_n(key_cache, r1 + c, n), s1)
                s2 = vfma(q, vload_n(key_cache, r2 + c, n), s2)
                s3 = vfma(q, vload_n(key_cache, r3 + c, n), s3)
            tile = vsum16(s0, s1, s2, s3, z, z, z, z, z, z, z, z, z, z, z, z)
            vstore_quarter(scores, h * stride + off + t, vmul(tile, vscale), 0)
            r0, r1, r2, r3 = r0 + head_dim, r1 + head_dim, r2 + head_dim, r3 + head_dim


@njit(cache=True, inline="always", **JIT)
def _softmax_span(t0, t1, m, lsum, acc, scores, stride):  # pragma: no cover
    """Fold each head's span of scores (columns [t0, t1) of its row) into its online softmax
    state: raise the running max m[h] once for the span, rescale lsum[h] and the
    accumulator, turn the scores into exp weights, 16 lanes at a time.

    Whole vectors may run up to 15 elements past the span's scores (still inside the
    head's padded row); those lanes count as -1e30 for the max and 0 for the sum. One loop
    body per head, no helper call: per-call reference counting of the array arguments
    cost more than the arithmetic of a 16-token block.
    """
    num_heads, count = m.shape[0], t1 - t0
    padded_dim = acc.shape[0] // (num_heads + 1)
    floor = np.float32(_NEG)
    for h in range(num_heads):
        start = h * stride + t0
        running = vsplat(m[h])
        for c in range(0, count, LANES):
            running = vmax(running, vkeep(vload(scores, start + c), count - c, floor))
        new_max = vhmax(running)
        if new_max > m[h]:
            alpha = exp_neg(m[h] - new_max)
            m[h] = new_max
            lsum[h] *= alpha
            for c in range(h * padded_dim, (h + 1) * padded_dim, LANES):
                vstore(acc, c, vmul(vload(acc, c), vsplat(alpha)))
        shift, total = vsplat(new_max), vzero()
        for c in range(0, count, LANES):
            weights = vexp_neg(vsub(vload(scores, start + c), shift))
            weights = vkeep(weights, count - c, np.float32(0.0))
            vstore(scores, start + c, weights)
            total = vadd(total, weights)
        lsum[h] += vhsum(total)


@njit(cache=True, inline="always", **JIT)
def _fma4(q, k0, k1, k2, k3, s0, s1, s2, s3):  # pragma: no cover
    """One query vector against four key vectors: (s_j + q * k_j for j in 0..3)."""
    return vfma(q, k0, s0), vfma(q, k1, s1), vfma(q, k2, s2), vfma(q, k3, s3)


@njit(cache=True, inline="always", **JIT)
def _axpy(weights, i, v, acc):  # pragma: no cover
    """acc + weights[i] * v."""
    return vfma(vsplat(velem(weights, i)), v, acc)


@njit(cache=True, inline="always", **JIT)
def _splat4(weights, w, t, t1):  # pragma: no cover
    """Splats of weights[w + t .. w + t + 3]; zero for tokens at or past t1 (a tail tile's
    extra rows repeat the last one)."""
    zero = np.float32(0.0)
    return (
        vsplat(velem(weights, w + t)),
        vsplat(velem(weights, w + t + 1) if t + 1 < t1 else zero),
        vsplat(velem(weights, w + t + 2) if t + 2 < t1 else zero),
        vsplat(velem(weights, w + t + 3) if t + 3 < t1 else zero),
    )


@njit(cache=True, inline="always", **JIT)
def _add4(acc, i, p0, p1, p2, p3, v0, v1, v2, v3):  # pragma: no cover
    """acc[i : i + 16] += p0 v0 + p1 v1 + p2 v2 + p3 v3."""
    x = vfma(p0, v0, vload(acc, i))
    x = vfma(p1, v1, x)
    x = vfma(p2, v2, x)
    vstore(acc, i, vfma(p3, v3, x))


@njit(cache=True, inline="always", **JIT)
def _accumulate_shared(value_cache, base, t0, t1, num_heads, group, num_kv_heads, head_dim,
                       acc, padded_dim, weights, stride, off):  # fmt: skip  # pragma: no cover
    """acc[h] += sum_t weights[h * stride + off + t] * v[t, h // group] over tokens [t0, t1);
    `group` >= 2.

    The tiles of `_score_shared`, in the same memory order: 4 tokens x 4 query heads of one
    KV head. The tile's 16 weights are splat into registers once, then every 16-lane slice
    of the four V rows feeds all four heads: 16 FMAs per 4 V loads and 4 accumulator
    loads/stores (keeping the accumulators in registers instead, and loading each weight
    per slice, was load-port bound: 5 loads per 4 FMAs, 1.04-1.19x slower). A group's last
    tile is completed with the sink row `num_heads`.
    """
    row = num_kv_heads * head_dim
    last = t1 - 1
    for t in range(t0, t1, 4):
        for g in range(num_kv_heads):
            end = (g + 1) * group
            r0 = base + g * head_dim + t * row
            r1 = base + g * head_dim + min(t + 1, last) * row
            r2 = base + g * head_dim + min(t + 2, last) * row
            r3 = base + g * head_dim + min(t + 3, last) * row
            for h in range(g * group, end, 4):
                h1, h2, h3 = _tile_heads(h, end, num_heads)
                p00, p01, p02, p03 = _splat4(weights, h * stride + off, t, t1)
                p10, p11, p12, p13 = _splat4(weights, h1 * stride + off, t, t1)
                p20, p21, p22, p23 = _splat4(weights, h2 * stride + off, t, t1)
                p30, p31, p32, p33 = _splat4(weights, h3 * stride + off, t, t1)
                a0, a1, a2, a3 = h * padded_dim, h1 * padded_dim, h2 * padded_dim, h3 * padded_dim
                for c in range(0, head_dim, LANES):
                    n = head_dim - c
                    v0, v1 = vload_n(value_cache, r0 + c, n), vload_n(value_cache, r1 + c, n)
                    v2, v3 = vload_n(value_cache, r2 + c, n), vload_n(value_cache, r3 + c, n)
                    _add4(acc, a0 + c, p00, p01, p02, p03, v0, v1, v2, v3)
                    _add4(acc, a1 + c, p10, p11, p12, p13, v0, v1, v2, v3)
                    _add4(acc, a2 + c, p20, p21, p22, p23, v0, v1, v2, v3)
                    _add4(acc, a3 + c, p30, p31, p32, p33, v0, v1, v2, v3)


@njit(cache=True, inline="always", **JIT)
def _accumulate_single(value_cache, base, t0, t1, num_heads, head_dim, acc, padded_dim, weights,
                       stride, off):  # fmt: skip  # pragma: no cover
    """As `_accumulate_shared` when every query head has its own KV head (group 1): one
    head at a time; over a whole 8-token tile its eight weights are splat once and each
    16-lane slice takes eight V rows in two FMA chains (per-slice weight loads and fewer
    rows per slice measured 4-14 % slower at DRAM-bound shapes)."""
    row = num_heads * head_dim
    first = t0
    while first < t1:
        stop = min(first + 8, t1)
        for h in range(num_heads):
            w, a = h * stride + off, h * padded_dim
            if stop - first == 8:  # a whole tile: its eight weights stay in registers
                i = w + first
                p0, p1 = vsplat(velem(weights, i)), vsplat(velem(weights, i + 1))
                p2, p3 = vsplat(velem(weights, i + 2)), vsplat(velem(weights, i + 3))
                p4, p5 = vsplat(velem(weights, i + 4)), vsplat(velem(weights, i + 5))
                p6, p7 = vsplat(velem(weights, i + 6)), vsplat(velem(weights, i + 7))
                for c in range(0, head_dim, LANES):
                    n = head_dim - c
                    r = base + first * row + h * head_dim + c
                    x, y = vload(acc, a + c), vzero()
                    x = vfma(p0, vload_n(value_cache, r, n), x)
                    y = vfma(p1, vload_n(value_cache, r + row, n), y)
                    x = vfma(p2, vload_n(value_cache, r + 2 * row, n), x)
                    y = vfma(p3, vload_n(value_cache, r + 3 * row, n), y)
                    x = vfma(p4, vload_n(value_cache, r + 4 * row, n), x)
                    y = vfma(p5, vload_n(value_cache, r + 5 * row, n), y)
                    x = vfma(p6, vload_n(value_cache, r + 6 * row, n), x)
                    y = vfma(p7, vload_n(value_cache, r + 7 * row, n), y)
                    vstore(acc, a + c, vadd(x, y))
                continue
            for c in range(0, head_dim, LANES):
                n = head_dim - c
                r = base + h * head_dim + c
                x0 = vload(acc, a + c)
                for t in range(first, stop):
                    x0 = _axpy(weights, w + t, vload_n(value_cache, r + t * row, n), x0)
                vstore(acc, a + c, x0)
        first = stop


@njit(cache=True, inline="always")
def _tile_heads(h, end, num_heads):  # pragma: no cover
    """The other three heads of the tile starting at head h of a group ending at `end`:
    h + 1 .. h + 3, or the sink row `num_heads` past the group's end."""
    return (
        h + 1 if h + 1 < end else num_heads,
        h + 2 if h + 2 < end else num_heads,
        h + 3 if h + 3 < end else num_heads,
    )


@njit(cache=True, inline="always", **JIT)
def _scaled_copy(src, s, dst, d, n, factor):  # pragma: no cover
    """dst[d : d + n] = src[s : s + n] * factor, 16 lanes at a time (then element by element:
    a whole vector past n would write into the next row)."""
    vfactor = vsplat(factor)
    c = 0
    while c + LANES <= n:
        vstore(dst, d + c, vmul(vload(src, s + c), vfactor))
        c += LANES
    for i in range(c, n):
        dst[d + i] = src[s + i] * factor


@njit(cache=True, inline="always", **JIT)
def _scaled_add(src, s, dst, d, n, factor):  # pragma: no cover
    """dst[d : d + n] += src[s : s + n] * factor (as `_scaled_copy`)."""
    vfactor = vsplat(factor)
    c = 0
    while c + LANES <= n:
        vstore(dst, d + c, vfma(vload(src, s + c), vfactor, vload(dst, d + c)))
        c += LANES
    for i in range(c, n):
        dst[d + i] += src[s + i] * factor


@njit(cache=True, inline="always", **JIT)
def _finish(item, acc, m, lsum, out, part_acc, part_m, part_l):  # pragma: no cover
    """Write a single item's normalized output row, or a split item's partial state."""
    num_heads, head_dim = out.shape[1], out.shape[2]
    padded_dim = acc.shape[0] // (num_heads + 1)
    part = item[ITEM_PART]
    if part < 0:
        out_flat = out.reshape(out.size)
        base = item[ITEM_OUT] * num_heads * head_dim
        for h in range(num_heads):
            _scaled_copy(acc, h * padded_dim, out_flat, base + h * head_dim, head_dim,
                         np.float32(1.0) / lsum[h])  # fmt: skip
    else:
        part_flat = part_acc.reshape(part_acc.size)
        base = part * num_heads * head_dim
        for h in range(num_heads):
            _scaled_copy(acc, h * padded_dim, part_flat, base + h * head_dim, head_dim,
                         np.float32(1.0))  # fmt: skip
            part_m[part, h] = m[h]
            part_l[part, h] = lsum[h]


@njit(cache=True, **JIT)
def _item(item, query, key_cache, value_cache, block_size, num_kv_heads, block_tables, scale,
          out, part_acc, part_m, part_l, prefetch, q_pad, m, lsum, acc,
          scores):  # fmt: skip  # pragma: no cover
    """One item over flat caches (float32, or bfloat16 bits as uint16); `prefetch` as
    `prefetch_mode` (GQA layouts only); q_pad ... scores: the worker's scratch
    (`_run_worker`)."""
    prefer_512_bit_vectors()
    num_heads, head_dim = query.shape[1], query.shape[2]
    group = num_heads // num_kv_heads
    padded_dim = acc.shape[0] // (num_heads + 1)
    span_blocks = max(1, SPAN_TOKENS // block_size)
    stride = scores.shape[0] // (num_heads + 1)
    # Fresh softmax state; the padding of q_pad and its sink row stay zero from allocation,
    # the sink row of acc is written by sink tiles and never read.
    # Whole vectors: element loops here cost ~3 us per item, as much as scoring ten tokens.
    query_flat = query.reshape(query.size)
    q_base = item[ITEM_QROW] * num_heads * head_dim
    z = vzero()
    for h in range(num_heads):
        m[h] = np.float32(_NEG)
        lsum[h] = np.float32(0.0)
        a = h * padded_dim
        _scaled_copy(query_flat, q_base + h * head_dim, q_pad, a, head_dim, np.float32(1.0))
        for c in range(a, a + padded_dim, LANES):
            vstore(acc, c, z)
    table = block_tables[item[ITEM_SEQ]]
    scale32 = np.float32(scale)
    block_elements = block_size * num_kv_heads * head_dim
    lo, hi = item[ITEM_LO], item[ITEM_HI]
    first_block, last_block = lo // block_size, (hi - 1) // block_size
    for span_first in range(first_block, last_block + 1, span_blocks):
        span_end = min(span_first + span_blocks, last_block + 1)
        for bi in range(span_first, span_end):
            base = table[bi] * block_elements
            next_base = table[bi + 1] * block_elements if bi < last_block else -1
            t0 = max(lo - bi * block_size, 0)
            t1 = min(hi - bi * block_size, block_size)
            off = (bi - span_first) * block_size
            if group > 1:
                _score_shared(key_cache, base, t0, t1, q_pad, padded_dim, scale32, num_heads,
                              group, num_kv_heads, head_dim, scores, stride, off, value_cache,
                              next_base, block_size, prefetch)  # fmt: skip
            else:
                _score_single(key_cache, base, t0, t1, q_pad, padded_dim, scale32, num_heads,
                              head_dim, scores, stride, off)  # fmt: skip
        # The span's positions [lo, hi) as columns of its score rows.
        span_lo = max(lo - span_first * block_size, 0)
        span_hi = min(hi - span_first * block_size, (span_end - span_first) * block_size)
        _softmax_span(span_lo, span_hi, m, lsum, acc, scores, stride)
        for bi in range(span_first, span_end):
            base = table[bi] * block_elements
            t0 = max(lo - bi * block_size, 0)
            t1 = min(hi - bi * block_size, block_size)
            off = (bi - span_first) * block_size
            if group > 1:
                _accumulate_shared(value_cache, base, t0, t1, num_heads, group, num_kv_heads,
                                   head_dim, acc, padded_dim, scores, stride, off)  # fmt: skip
            else:
                _accumulate_single(value_cache, base, t0, t1, num_heads, head_dim, acc,
                                   padded_dim, scores, stride, off)  # fmt: skip
    _finish(item, acc, m, lsum, out, part_acc, part_m, part_l)


@njit(cache=True, inline="always")
def _partial_states(splits, num_heads, head_dim):  # pragma: no cover
    """Scratch for the split rows' partial states, (acc [P, H, D], m [P, H], l [P, H]), in one
    allocation (each costs ~0.2 us, ~1 us on a cold cache)."""
    num_parts = splits[-1, 2] if splits.shape[0] else 0
    buffer = np.empty(num_parts * num_heads * (head_dim + 2), dtype=np.float32)
    return partial_state_views(buffer, num_parts, num_heads, head_dim)


@njit(cache=True, inline="always")
def partial_state_views(buffer, num_parts, num_heads, head_dim):  # pragma: no cover
    """(acc [P, H, D], m [P, H], l [P, H]) laid out one after the other in a flat float32
    `buffer` of P * H * (D + 2) elements, acc first (so acc's address is the buffer's)."""
    size = num_parts * num_heads
    return (
        buffer[: size * head_dim].reshape((num_parts, num_heads, head_dim)),
        buffer[size * head_dim : size * (head_dim + 1)].reshape((num_parts, num_heads)),
        buffer[size * (head_dim + 1) :].reshape((num_parts, num_heads)),
    )


@njit(cache=True, **JIT)
def _combine(splits, out, part_acc, part_m, part_l):  # pragma: no cover
    """Merge each split row's partial states into its output row:
    sum_i acc_i w_i / sum_i l_i w_i with w_i = exp(m_i - max_i m_i)."""
    num_heads, head_dim = out.shape[1], out.shape[2]
    out_flat, parts = out.reshape(out.size), part_acc.reshape(part_acc.size)
    for k in range(splits.shape[0]):
        row, p0, p1 = splits[k, 0], splits[k, 1], splits[k, 2]
        for h in range(num_heads):
            top = part_m[p0, h]
            for p in range(p0 + 1, p1):
                top = max(top, part_m[p, h])
            total = np.float32(0.0)
            for p in range(p0, p1):
                total += part_l[p, h] * exp_neg(part_m[p, h] - top)
            inv = np.float32(1.0) / total
            d = (row * num_heads + h) * head_dim
            for p in range(p0, p1):
                weight = exp_neg(part_m[p, h] - top) * inv
                src = (p * num_heads + h) * head_dim
                if p == p0:
                    _scaled_copy(parts, src, out_flat, d, head_dim, weight)
                else:
                    _scaled_add(parts, src, out_flat, d, head_dim, weight)


@njit(cache=True, **JIT)
def _run_worker(worker, num_workers, query, key_cache, value_cache, block_size, num_kv_heads,
                block_tables, items, scale, out, part_acc, part_m, part_l,
                prefetch):  # fmt: skip  # pragma: no cover
    """Worker `worker`'s share of the items: a contiguous run, as a static schedule would
    give it, with one scratch buffer for all of them (five arrays allocated and zeroed per
    item cost ~1 us hot, several times that on a cold cache)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    padded_dim = -(-head_dim // LANES) * LANES  # whole vectors per head, zeros past head_dim
    # One softmax pass per span of consecutive blocks (its per-head max, rescale and sums
    # cost about as much per block as scoring a few tokens); a span's scores plus room for
    # the overhang of whole vectors.
    stride = max(1, SPAN_TOKENS // block_size) * block_size + LANES
    # Per-head rows plus a sink row (index num_heads) for tiles that run past the last head;
    # one allocation (each costs ~0.2 us, several on a cold cache).
    rows = (num_heads + 1) * padded_dim
    scratch = np.empty(2 * rows + (num_heads + 1) * stride + 2 * num_heads, dtype=np.float32)
    q_pad, acc = scratch[:rows], scratch[rows : 2 * rows]
    # Zeros that `_item` never writes: the sink row and each head's padding past head_dim
    # (whole 16-lane vectors read them; every other element is set per item).
    z = vzero()
    for c in range(num_heads * padded_dim, rows, LANES):
        vstore(q_pad, c, z)
    if padded_dim != head_dim:
        for h in range(num_heads):
            vstore(q_pad, (h + 1) * padded_dim - LANES, z)
    scores = scratch[2 * rows : 2 * rows + (num_heads + 1) * stride]
    scores[:] = np.float32(0.0)  # vectors past a span's columns read them (masked lanes)
    m = scratch[scratch.shape[0] - 2 * num_heads : scratch.shape[0] - num_heads]
    lsum = scratch[scratch.shape[0] - num_heads :]
    num_items = items.shape[0]
    for i in range(worker * num_items // num_workers, (worker + 1) * num_items // num_workers):
        _item(items[i], query, key_cache, value_cache, block_size, num_kv_heads, block_tables,
              scale, out, part_acc, part_m, part_l, prefetch, q_pad, m, lsum, acc,
              scores)  # fmt: skip


@njit(cache=True, inline="always", **JIT)
def _run_items(query, key_cache, value_cache, block_size, num_kv_heads, block_tables, items,
               splits, scale, out, part_acc, part_m, part_l, num_workers,
               prefetch):  # fmt: skip  # pragma: no cover
    """Every item, split between `num_workers` threads (1: the calling thread), then the
    merges.

    Inlined into each parallel entry point: a compiled function that calls a parallel one
    cannot be cached on disk, so each entry point holds its own parallel loop.
    """
    if num_workers <= 1:
        _run_worker(0, 1, query, key_cache, value_cache, block_size, num_kv_heads, block_tables,
                    items, scale, out, part_acc, part_m, part_l, prefetch)  # fmt: skip
    else:
        for w in prange(num_workers):
            _run_worker(w, num_workers, query, key_cache, value_cache, block_size,
                        num_kv_heads, block_tables, items, scale, out, part_acc, part_m,
                        part_l, prefetch)  # fmt: skip
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


# Each entry point is compiled for float32 and for bfloat16 bits; small batches run serially
# (`count_workers`).
@njit(cache=True, parallel=True, **JIT)
def decode(query_address, num_tokens, num_heads, head_dim, key_cache, value_cache, block_size,
           num_kv_heads, block_tables, items, splits, scale, out_address, num_rows,
           num_workers, prefetch):  # fmt: skip  # pragma: no cover
    """Run a planned batch's items, then merge split rows.

    Args:
        query_address: `data_ptr()` of a contiguous float32 [num_tokens, num_heads,
            head_dim] tensor.
        key_cache, value_cache: flat (1-D) C-contiguous views of caches [num_blocks,
            block_size, num_kv_heads, head_dim], float32 or uint16 (bfloat16 bits).
        block_tables: int32 [num_seqs, max_blocks].
        items, splits: the plan (module docstring).
        out_address: `data_ptr()` of a contiguous float32 [num_rows, num_heads, head_dim]
            tensor, the kernel rows' output.
        num_workers: `count_workers`. prefetch: `prefetch_mode` of the batch.
    """
    query = numba.carray(_pointer(query_address, np.float32), (num_tokens, num_heads, head_dim))
    out = numba.carray(_pointer(out_address, np.float32), (num_rows, num_heads, head_dim))
    part_acc, part_m, part_l = _partial_states(splits, num_heads, head_dim)
    _run_items(query, key_cache, value_cache, block_size, num_kv_heads, block_tables, items,
               splits, scale, out, part_acc, part_m, part_l, num_workers, prefetch)  # fmt: skip


@intrinsic
def _call_int_function(typingctx, address):  # pragma: no cover
    """Call the C function `int f(void)` at an integer address; its value as an int64."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        function_type = ir.FunctionType(ir.IntType(32), [])
        function = builder.inttoptr(args[0], function_type.as_pointer())
        return builder.sext(builder.call(function, []), ir.IntType(64))

    return types.int64(address), codegen


@njit(cache=True, parallel=True, **JIT)
def plan_and_decode(query_address, num_tokens, num_heads, key_cache, value_cache, block_size,
                    num_kv_heads, head_dim, tables_address, num_seqs, max_blocks, lens_address,
                    starts_address, window, max_decode_query, threads_address, scale,
                    out_address):  # fmt: skip  # pragma: no cover
    """Plan a batch and run it, in one call, when every sequence is a decode row.

    The plain `paged_attention` call plans afresh each time; doing that and the kernel in one
    compiled call, with tensors passed by address, saves the Python between them (NumPy
    views, scratch arrays, a second dispatch): tens of microseconds on a 0.1 ms call.

    Args:
        query_address, out_address: `data_ptr()` of contiguous float32 [num_tokens,
            num_heads, head_dim] tensors (the output is written only on success).
        key_cache, value_cache: flat views of contiguous caches (`decode`).
        tables_address, lens_address, starts_address: `data_ptr()` of the contiguous int32
            block_tables [num_seqs, max_blocks], seq_lens [num_seqs] and query_start_loc
            [num_seqs + 1].
        window: sliding window, 0 for none. max_decode_query: longest decode row
            (`cpu.MAX_DECODE_QUERY`). threads_address: `thread_count_address()` (Numba's
            own `numba.get_num_threads()` in compiled code is not cached on disk, and
            reading the count in Python costs ~3 us on a cold cache).

    Returns:
        (status, seq): status `cpu_plan.OK` when the output is written, a `cpu_plan` error
        code (seq: the sequence at fault) or `NEEDS_PREFILL`; the caller then takes the
        general path, which names the error or runs the prefill.
    """
    query = numba.carray(_pointer(query_address, np.float32), (num_tokens, num_heads, head_dim))
    out = numba.carray(_pointer(out_address, np.float32), (num_tokens, num_heads, head_dim))
    tables = numba.carray(_pointer(tables_address, np.int32), (num_seqs, max_blocks))
    lens = numba.carray(_pointer(lens_address, np.int32), (num_seqs,))
    starts = numba.carray(_pointer(starts_address, np.int32), (num_seqs + 1,))
    num_blocks = key_cache.shape[0] // (block_size * num_kv_heads * head_dim)
    num_threads = _call_int_function(threads_address)
    items, splits, rows, prefill, total, error, seq = plan_items(
        starts, lens, tables, num_tokens, num_blocks, block_size, window, max_decode_query,
        num_threads,
    )  # fmt: skip
    if error != OK:
        return error, seq
    if prefill.shape[0]:
        return NEEDS_PREFILL, prefill[0]
    part_acc, part_m, part_l = _partial_states(splits, num_heads, head_dim)
    # Every row is a decode row here, so output row r is query row r.
    kv_bytes = total * 2 * num_kv_heads * head_dim * key_cache.itemsize
    _run_items(query, key_cache, value_cache, block_size, num_kv_heads, tables, items, splits,
               scale, out, part_acc, part_m, part_l,
               count_workers(kv_bytes, items.shape[0], num_threads),
               prefetch_mode(key_cache.itemsize, kv_bytes))  # fmt: skip
    return OK, 0


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


@functools.cache
def thread_count_address() -> int:
    """Address of a C function `int f(void)` returning `num_threads()`, for `plan_and_decode`:
    Numba's threading layer's own, or a ctypes callback into `numba.get_num_threads` if
    Numba's internals move."""
    reader = _thread_count_reader()
    if not isinstance(reader, ctypes._CFuncPtr):
        reader = _THREAD_COUNT_CALLBACK
    return ctypes.cast(reader, ctypes.c_void_p).value


_THREAD_COUNT_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int)(lambda: numba.get_num_threads())


def num_threads() -> int:
    """Threads the parallel kernels use (numba's setting, which `numba.set_num_threads`
    changes per calling thread)."""
    return _thread_count_reader()()


@functools.cache
def _thread_count_reader() -> Callable[[], int]:
    """The threading layer's own counter, read directly: `numba.get_num_threads` first takes
    a lock to check that the layer is up, ~1 us per call and several on a cold cache, and
    plain calls read it every time. Falls back to the public function if Numba's internals
    move."""
    numba.get_num_threads()  # starts the threading layer
    from numba.np.ufunc import parallel

    reader = getattr(parallel, "_get_num_threads", None)
    if reader is None or reader() != numba.get_num_threads():
        return numba.get_num_threads
    return reader
