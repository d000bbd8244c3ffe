"""bfloat16 products of more rows than a decode step's few and fewer than oneDNN's many,
on the plain weight: `tiles` multiplies four weight rows by four input rows at a time with
AVX512-BF16's dot product (`dot_tile`), so each line loaded serves four sums, not one.

oneDNN reorders a plain bfloat16 weight into its blocked layout on every call, a pass over
the whole weight that costs as much as the product itself at a few dozen rows; these
kernels read the weight where it lies. Every output is one float32 sum in one order,
whichever tile and thread computes it (a tile past the last row repeats that row and drops
the copy), so the bits do not depend on the rows beside it or the thread count; the sum is
rounded once, as `matvec` rounds it. No bias: a biased bfloat16 layer stays with torch
(`linear.Linear`). Where the CPU lacks the instruction (`bf16.HAS_DOT`) nothing here is
compiled or called. NumPy, Numba and llvmlite only.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from pagedkv.ops.cpu.bf16 import BFloat16, declare, pointer, prefetch_line
from pagedkv.runtime import kernel_cache

kernel_cache.use_shared_cache()  # before the first `cache=True` decorator

TILE = 4
"""Weight rows and input rows a tile takes: 16 vector sums and 8 lines held in registers."""
_LANES = 16
_F32 = ir.FloatType()
_I32 = ir.IntType(32)


def _sum_lanes(builder, vectors):  # type: ignore[no-untyped-def]
    """One vector whose lane i is the sum of the 16 lanes of vectors[i] (16 vectors): each
    level adds the two halves of every part of two vectors into one vector."""
    part = _LANES
    while len(vectors) > 1:
        part //= 2
        pairs = zip(vectors[::2], vectors[1::2], strict=True)
        vectors = [builder.fadd(*_halves(builder, a, b, part)) for a, b in pairs]
    return vectors[0]


def _halves(builder, a, b, half):  # type: ignore[no-untyped-def]
    """The first halves, then the second halves, of the parts (2 * half lanes) of a and b."""
    picks = []
    for shift in (0, half):
        lanes = range(0, 2 * _LANES, 2 * half)
        pick = [start + shift + t for start in lanes for t in range(half)]
        picks.append(ir.Constant(ir.VectorType(_I32, _LANES), pick))
    return [builder.shuffle_vector(a, b, pick) for pick in picks]


def _round(builder, vector):  # type: ignore[no-untyped-def]
    """float32 lanes (finite) rounded to the nearest bfloat16, ties to even: their bits."""
    i32x16 = ir.VectorType(_I32, _LANES)
    bits = builder.bitcast(vector, i32x16)

    def splat(value: int) -> ir.Constant:
        return ir.Constant(i32x16, [value] * _LANES)

    odd = builder.and_(builder.lshr(bits, splat(16)), splat(1))
    rounded = builder.lshr(builder.add(builder.add(bits, splat(0x7FFF)), odd), splat(16))
    return builder.trunc(rounded, ir.VectorType(ir.IntType(16), _LANES))


@intrinsic
def dot_tile(typingctx, w, x, dest, w_rows, x_rows, dest_rows, groups):  # pragma: no cover
    """dest.flat[dest_rows[j] + i] = the sum of w.flat[w_rows[i] + k] * x.flat[x_rows[j] + k]
    for k < 32 * groups, in float32, rounded once to bfloat16: w, x and dest C-contiguous
    arrays of bfloat16 bits (uint16); w_rows, x_rows and dest_rows tuples of TILE flat
    offsets.

    One `vdpbf16ps` per pair of 32-element lines, each pair's sum in a vector of its own;
    the 16 vectors' lanes are added into one vector, rounded, stored a row at a time."""
    if not all(isinstance(t, types.Array) and t.dtype == types.uint16 and t.layout == "C"
               for t in (w, x, dest)):  # fmt: skip
        return None
    rows = (w_rows, x_rows, dest_rows)
    if not all(isinstance(t, types.UniTuple) and t.count == TILE for t in rows):
        return None

    def codegen(context, builder, sig, args):
        f32x16 = ir.VectorType(_F32, _LANES)
        bf16x32 = ir.VectorType(BFloat16(), 2 * _LANES)
        dot = declare(builder.module, "llvm.x86.avx512bf16.dpbf16ps.512", f32x16,
                      [f32x16, bf16x32, bf16x32])  # fmt: skip
        lines = [_row_pointers(context, builder, sig, args, a, bf16x32) for a in (0, 1)]
        # acc[TILE * j + i]: weight row i by input row j, so that an input row's sums are
        # neighbouring lanes of the summed vector
        acc = [cgutils.alloca_once_value(builder, ir.Constant(f32x16, None))
               for _ in range(TILE * TILE)]  # fmt: skip
        total = context.cast(builder, args[6], sig.args[6], types.int64)
        with cgutils.for_range(builder, total) as loop:
            w_line, x_line = ([builder.load(builder.gep(p, [loop.index]), align=2) for p in ps]
                              for ps in lines)  # fmt: skip
            for j in range(TILE):
                for i in range(TILE):
                    into = acc[TILE * j + i]
                    builder.store(builder.call(dot, [builder.load(into), w_line[i], x_line[j]]),
                                  into)  # fmt: skip
        bits = _round(builder, _sum_lanes(builder, [builder.load(a) for a in acc]))
        i16x4 = ir.VectorType(ir.IntType(16), TILE)
        for j, at in enumerate(_row_pointers(context, builder, sig, args, 2, i16x4)):
            part = [TILE * j + i for i in range(TILE)]
            row = builder.shuffle_vector(bits, bits, ir.Constant(ir.VectorType(_I32, TILE), part))
            builder.store(row, at, align=2)
        return context.get_dummy_value()

    return types.none(w, x, dest, w_rows, x_rows, dest_rows, groups), codegen


def _row_pointers(context, builder, sig, args, a, to):  # type: ignore[no-untyped-def]
    """Pointers (to `to`) at the TILE flat offsets that argument 3 + a gives array `a`."""
    offsets = cgutils.unpack_tuple(builder, args[3 + a], TILE)
    kind = sig.args[3 + a].dtype
    return [pointer(context, builder, sig.args[a], args[a], at, kind, to) for at in offsets]


@njit(cache=True)
def tiles(x, weight, out):  # pragma: no cover
    """out[m, n] = x[m] . weight[n], on the calling thread.

    x: [rows, in]; weight: [out, in]; out: [rows, out], overwritten; all bfloat16 bits
    (uint16), C-contiguous; `in` a multiple of 32."""
    _tile_rows(x, weight, out, 0, weight.shape[0])


@njit(cache=True, parallel=True)
def tiles_parallel(x, weight, out, parts):  # pragma: no cover
    """`tiles` with the weight's rows cut into `parts` contiguous shares, one per task."""
    num_out = weight.shape[0]
    share = -(-num_out // (parts * TILE)) * TILE
    for p in prange(parts):
        _tile_rows(x, weight, out, p * share, min(num_out, (p + 1) * share))


@njit(cache=True)
def _tile_rows(x, weight, out, first, end):  # pragma: no cover
    """out[:, n] for weight rows first <= n < end. A tile that runs past the last row (of
    either) is written to `spare` and its rows in range copied out."""
    rows, size = x.shape
    num_out = out.shape[1]
    spare = np.empty(TILE * TILE, np.uint16)
    in_spare = (0, TILE, 2 * TILE, 3 * TILE)
    for n0 in range(first, end, TILE):
        w_rows = _offsets(n0, end - 1, size)
        _prefetch_next(weight, n0 + TILE, size)
        for m0 in range(0, rows, TILE):
            x_rows = _offsets(m0, rows - 1, size)
            if n0 + TILE <= end and m0 + TILE <= rows:
                dest_rows = _offsets(m0, rows, num_out)
                dot_tile(weight, x, out, w_rows, x_rows, (dest_rows[0] + n0, dest_rows[1] + n0,
                         dest_rows[2] + n0, dest_rows[3] + n0), size // 32)  # fmt: skip
                continue
            dot_tile(weight, x, spare, w_rows, x_rows, in_spare, size // 32)
            for j in range(min(TILE, rows - m0)):
                for i in range(min(TILE, end - n0)):
                    out[m0 + j, n0 + i] = spare[TILE * j + i]


@njit(inline="always")
def _prefetch_next(weight, n, size):  # pragma: no cover
    """Ask for the lines of the TILE weight rows from n (the last TILE where fewer are
    left) while this tile's are multiplied: the hardware prefetcher does not run ahead
    across the four rows a tile reads at once."""
    at = max(0, min(n * size, weight.size - TILE * size))
    for c in range(0, TILE * size, 32):
        prefetch_line(weight, at + c)


@njit(inline="always")
def _offsets(first, last, size):  # pragma: no cover
    """Flat offsets of rows first, first + 1, ... (TILE of them, none past `last`)."""
    return (first * size, min(first + 1, last) * size, min(first + 2, last) * size,
            min(first + 3, last) * size)  # fmt: skip
