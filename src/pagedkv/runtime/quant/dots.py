"""The product of a few input rows with rows of GGML blocks read in place
(`block_products`): what a decode step's projections and LM head run.

The input rows are first quantized to integers (`quantize_rows`), as llama.cpp does: one
float32 scale per group of a block's size (32 for Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1, 256 for the
K-quants), the values rounded to the nearest integer in int16 lanes (`LEVELS`). Each
block's sub-blocks (16 or 32 weights under one integer scale) are then multiplied by the
activations as whole integer vectors (`vectors.py`), and a block's integer sum is scaled
once, by the weight's and the activations' scales: a weight costs a few integer vector
instructions and is read once, in its packed size, which is what bounds a decode step. A
sub-block's float offset (Q4_1 / Q5_1's m, the K-quants' mins) multiplies the sum of its float32
activations, summed once per call (`x_sums`, per 32); integer offsets (Q4_0's -8, Q5_0's -16, Q6_K's
-32) are taken off the weights before the product. Each product differs from the float32
one by at most half an activation step per element. NumPy and Numba only; compiled code cached
as `pagedkv.runtime.kernel_cache` says.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from pagedkv.ops.cpu.bf16 import as_float32, bits_as_float32, magnitude_bits
from pagedkv.runtime import kernel_cache
from pagedkv.runtime.quant.literal import format_switch
from pagedkv.runtime.quant.vectors import dot_rows

kernel_cache.use_shared_cache()  # before the first `cache=True` decorator

LEVELS = {32: 32767, 256: 2047}
"""The largest activation integer, by group (block) size. The lanes are int16 either way,
so more levels cost nothing; 8 bits (llama.cpp's 127) moved the real SmolLM2's logprobs
past what its checks allow. A K-quant block's 256 products of weight (times its integer
scale: at most 4096 in magnitude, Q6_K's) and activation are summed in an int32: 2047 is
the most that cannot overflow it."""


def _rows(type_id, args):  # pragma: no cover
    """`block_products` for one format, `type_id` a literal: compiled once per format; args:
    `block_products`' after type_id."""
    raise NotImplementedError("compiled only")


@overload(_rows, prefer_literal=True)
def _rows_impl(type_id, args):  # pragma: no cover
    if not isinstance(type_id, types.IntegerLiteral):
        return None

    def rows_of(type_id, args):
        xq, xd, sums, blocks, block_size, block_bytes, out, col, first, end = args
        rows = xq.shape[0]
        if rows == 1:  # a loop of its own: with the others' constants it kept fewer registers
            for n in range(first, end):
                out[0, col + n] = dot_rows(blocks[n], xq, xd, sums, 0, type_id, 1)[0]
            return
        for n in range(first, end):
            row = blocks[n]
            m = 0
            while m + 4 <= rows:  # each weight block unpacked once for four input rows
                a, b, c, d = dot_rows(row, xq, xd, sums, m, type_id, 4)
                out[m, col + n], out[m + 1, col + n] = a, b
                out[m + 2, col + n], out[m + 3, col + n] = c, d
                m += 4
            if m + 2 <= rows:
                a, b = dot_rows(row, xq, xd, sums, m, type_id, 2)
                out[m, col + n], out[m + 1, col + n] = a, b
                m += 2
            if m < rows:
                out[m, col + n] = dot_rows(row, xq, xd, sums, m, type_id, 1)[0]

    return rows_of


_by_format = format_switch(_rows)


@njit(cache=True, fastmath=True)
def block_products(
    xq, xd, sums, blocks, type_id, block_size, block_bytes, out, col, first, end
):  # pragma: no cover
    """out[m, col + n] = x[m] . row n of `blocks` for every input row m and first <= n < end.

    xq: int16 [rows, in_features], xd: float32 [rows, in_features // block_size] (x
    quantized by `quantize_rows` in groups of the format's block size); sums: float32
    [rows, in_features // 32] (`x_sums`); blocks: uint8 [num_out, row_bytes] in format
    `type_id`; out: float32 [rows, >= col + num_out] (other columns untouched).
    """
    args = (xq, xd, sums, blocks, block_size, block_bytes, out, col, first, end)
    _by_format(type_id, args)


@njit(cache=True, fastmath=True, parallel=True)
def block_products_parallel(
    xq, xd, sums, blocks, type_id, block_size, block_bytes, out, col, parts
):  # pragma: no cover
    """`block_products` over every row of `blocks`, cut into `parts` contiguous shares."""
    num_out = blocks.shape[0]
    share = -(-num_out // parts)
    for p in prange(parts):
        first, end = p * share, min(num_out, (p + 1) * share)
        block_products(xq, xd, sums, blocks, type_id, block_size, block_bytes, out, col, first, end)


@njit(cache=True)
def quantize_rows(x, group, levels):  # pragma: no cover
    """x: float32 [rows, in_features] -> (int16 [rows, in_features], float32 [rows,
    in_features // group] scales), as `quantize_into` makes them."""
    rows, size = x.shape
    xq = np.empty((rows, size), dtype=np.int16)
    xd = np.empty((rows, size // group), dtype=np.float32)
    quantize_into(x, group, levels, xq, xd)
    return xq, xd


@njit(cache=True)
def quantize_into(x, group, levels, xq, xd):  # pragma: no cover
    """xq, xd = x quantized in groups of `group`: each group's scale its largest magnitude
    over `levels`, its elements integers rounded to nearest, so an element is off by at most
    half its group's scale.

    x: [rows, in_features], float32 or bfloat16 bits (uint16); xq: int16 [rows,
    in_features]; xd: float32 [rows, in_features // group]. Without fast-math: wherever it
    is compiled in, the same bits. The largest magnitude is found as the largest of the
    values' bits without their sign (the same order as the magnitudes'), which LLVM takes in
    vector lanes where it keeps a float maximum scalar.
    """
    rows, size = x.shape
    for m in range(rows):
        values, out = x[m], xq[m]
        for g in range(size // group):
            base = g * group
            largest = np.uint32(0)
            for k in range(group):
                largest = max(largest, magnitude_bits(values[base + k]))
            scale = bits_as_float32(largest) / np.float32(levels)
            inverse = np.float32(1.0) / scale if scale > 0 else np.float32(0.0)
            xd[m, g] = scale
            for k in range(group):
                out[base + k] = np.int16(np.rint(as_float32(values[base + k]) * inverse))


def x_sums(x: np.ndarray) -> np.ndarray:
    """x: float32 [rows, in_features] -> its sums per 32 elements, [rows, in_features // 32]."""
    sums = np.empty((x.shape[0], x.shape[1] // 32), dtype=np.float32)
    sums_into(x, sums)
    return sums


@njit(cache=True)
def sums_into(x, sums):  # pragma: no cover
    """sums[m, j] = the sum of x[m, 32 j : 32 j + 32], left to right (no fast-math: the
    same bits wherever it is compiled in). x: [rows, in_features], float32 or bfloat16
    bits; sums: float32 [rows, in_features // 32]."""
    for m in range(x.shape[0]):
        for j in range(sums.shape[1]):
            total = np.float32(0.0)
            for k in range(32 * j, 32 * j + 32):
                total += as_float32(x[m, k])
            sums[m, j] = total
