"""The product of a few input rows with rows of GGML blocks read in place
(`block_products`): what a decode step's projections and LM head run.

Each block's sub-blocks (16 or 32 weights under one scale) are multiplied by the
activations as whole vectors (`vectors.py`) and scaled once: a weight costs a few vector
instructions and is read once, in its packed size, which is what bounds a decode step. A
sub-block's offset (Q4_0 / Q4_1's -8 or m, the K-quants' mins) multiplies the sum of its
activations, summed once per call (`x_sums`, per 16). Sums run in float32. NumPy and Numba
only; compiled code cached as `pagedkv.runtime.kernel_cache` says.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from pagedkv.runtime import kernel_cache
from pagedkv.runtime.quant.blocks import Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, Q8_0, byte, half, scale_min
from pagedkv.runtime.quant.formats import FORMATS_BY_TYPE
from pagedkv.runtime.quant.vectors import dot_field, dot_int8, dot_nibbles, dot_six_bits

kernel_cache.use_shared_cache()  # before the first `cache=True` decorator

# float32 constants: an int literal times a float32 is a float64 in Numba, and one such term
# turns a whole sum float64.
_EIGHT, _SIXTEEN, _THIRTY_TWO = np.float32(8), np.float32(16), np.float32(32)


@njit(inline="always")
def _sum32(sums, base):  # pragma: no cover
    return sums[base // 16] + sums[base // 16 + 1]


@njit(inline="always")
def _q45_k(row, at, x, base, sums, fifth):  # pragma: no cover
    """Q4_K or Q5_K (`blocks._q45_k` has the layout)."""
    d, dmin = half(row, at), half(row, at + 2)
    nibbles = at + 48 if fifth else at + 16
    total = np.float32(0.0)
    for c in range(4):
        s1, m1 = scale_min(row, at + 4, 2 * c)
        s2, m2 = scale_min(row, at + 4, 2 * c + 1)
        first, second = base + 64 * c, base + 64 * c + 32
        low = dot_field(row, nibbles + 32 * c, x, first, 32, 0, 15)
        high = dot_field(row, nibbles + 32 * c, x, second, 32, 4, 15)
        if fifth:
            low += _SIXTEEN * dot_field(row, at + 16, x, first, 32, 2 * c, 1)
            high += _SIXTEEN * dot_field(row, at + 16, x, second, 32, 2 * c + 1, 1)
        total += d * (np.float32(s1) * low + np.float32(s2) * high)
        total -= dmin * (
            np.float32(m1) * _sum32(sums, first) + np.float32(m2) * _sum32(sums, second)
        )
    return total


@njit(inline="always")
def _q6_scale(row, at):  # pragma: no cover
    return np.float32((byte(row, at) ^ 128) - 128)


@njit(inline="always")
def _q6_k(row, at, x, base, sums):  # pragma: no cover
    """Q6_K (`blocks._q6_k` has the layout): 32 weights per `dot_six_bits`, a scale per 16;
    the weights' offset of 32 times the activations' sums."""
    total, offsets = np.float32(0.0), np.float32(0.0)
    for part in range(2):
        low, high, y = at + 64 * part, at + 128 + 32 * part, base + 128 * part
        sc = at + 192 + 8 * part
        s = (_q6_scale(row, sc), _q6_scale(row, sc + 1), _q6_scale(row, sc + 2),
             _q6_scale(row, sc + 3), _q6_scale(row, sc + 4), _q6_scale(row, sc + 5),
             _q6_scale(row, sc + 6), _q6_scale(row, sc + 7))  # fmt: skip
        total += dot_six_bits(row, low, high, x, y, 0, 0, s[0], s[1])
        total += dot_six_bits(row, low + 32, high, x, y + 32, 0, 2, s[2], s[3])
        total += dot_six_bits(row, low, high, x, y + 64, 4, 4, s[4], s[5])
        total += dot_six_bits(row, low + 32, high, x, y + 96, 4, 6, s[6], s[7])
        for g in range(8):
            offsets += s[g] * sums[y // 16 + g]
    return (total - _THIRTY_TWO * offsets) * half(row, at + 208)


@njit(inline="always")
def _q8_0(row, at, x, base, sums):  # pragma: no cover
    return half(row, at) * dot_int8(row, at + 2, x, base, 32)


@njit(inline="always")
def _q4_0(row, at, x, base, sums):  # pragma: no cover
    return half(row, at) * (dot_nibbles(row, at + 2, x, base) - _EIGHT * _sum32(sums, base))


@njit(inline="always")
def _q4_1(row, at, x, base, sums):  # pragma: no cover
    return half(row, at) * dot_nibbles(row, at + 4, x, base) + half(row, at + 2) * _sum32(
        sums, base
    )


@njit(inline="always")
def _q4_k(row, at, x, base, sums):  # pragma: no cover
    return _q45_k(row, at, x, base, sums, False)


@njit(inline="always")
def _q5_k(row, at, x, base, sums):  # pragma: no cover
    return _q45_k(row, at, x, base, sums, True)


def _rows(
    type_id, x, sums, blocks, block_size, block_bytes, out, col, first, end
):  # pragma: no cover
    """`block_products` for one format, `type_id` a literal: compiled once per format."""
    raise NotImplementedError("compiled only")


_DOTS = {Q8_0: _q8_0, Q4_0: _q4_0, Q4_1: _q4_1, Q4_K: _q4_k, Q5_K: _q5_k, Q6_K: _q6_k}


@overload(_rows, prefer_literal=True)
def _rows_impl(
    type_id, x, sums, blocks, block_size, block_bytes, out, col, first, end
):  # pragma: no cover
    if not isinstance(type_id, types.IntegerLiteral):
        return None
    block_dot = _DOTS[type_id.literal_value]
    fmt = FORMATS_BY_TYPE[type_id.literal_value]
    step, stride = fmt.block_size, fmt.block_bytes  # constants of the compiled variant

    def rows_of(type_id, x, sums, blocks, block_size, block_bytes, out, col, first, end):
        rows, size = x.shape
        for n in range(first, end):
            row = blocks[n]
            for m in range(rows):
                xm, sm = x[m], sums[m]
                total = np.float32(0.0)
                for b in range(size // step):
                    total += block_dot(row, b * stride, xm, b * step, sm)
                out[m, col + n] = total

    return rows_of


@njit(cache=True, fastmath=True)
def block_products(
    x, sums, blocks, type_id, block_size, block_bytes, out, col, first, end
):  # pragma: no cover
    """out[m, col + n] = x[m] . row n of `blocks` for every input row m and first <= n < end.

    x: float32 [rows, in_features]; sums: float32 [rows, in_features // 16] (`x_sums`);
    blocks: uint8 [num_out, row_bytes] in format `type_id`; out: float32 [rows, >= col +
    num_out] (other columns untouched).
    """
    # The ids as literals: `_rows` compiles a variant for each.
    if type_id == 8:
        _rows(8, x, sums, blocks, block_size, block_bytes, out, col, first, end)
    elif type_id == 2:
        _rows(2, x, sums, blocks, block_size, block_bytes, out, col, first, end)
    elif type_id == 3:
        _rows(3, x, sums, blocks, block_size, block_bytes, out, col, first, end)
    elif type_id == 12:
        _rows(12, x, sums, blocks, block_size, block_bytes, out, col, first, end)
    elif type_id == 13:
        _rows(13, x, sums, blocks, block_size, block_bytes, out, col, first, end)
    else:
        _rows(14, x, sums, blocks, block_size, block_bytes, out, col, first, end)


@njit(cache=True, fastmath=True, parallel=True)
def block_products_parallel(
    x, sums, blocks, type_id, block_size, block_bytes, out, col, parts
):  # pragma: no cover
    """`block_products` over every row of `blocks`, cut into `parts` contiguous shares."""
    num_out = blocks.shape[0]
    share = -(-num_out // parts)
    for p in prange(parts):
        first, end = p * share, min(num_out, (p + 1) * share)
        block_products(x, sums, blocks, type_id, block_size, block_bytes, out, col, first, end)


def x_sums(x: np.ndarray) -> np.ndarray:
    """x: float32 [rows, in_features] -> its sums per 16 elements, [rows, in_features // 16]."""
    return np.ascontiguousarray(x.reshape(x.shape[0], -1, 16).sum(axis=-1, dtype=np.float32))
