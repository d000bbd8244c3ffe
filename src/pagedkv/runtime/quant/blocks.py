"""GGML blocks (`formats.py`) decoded into float32 numbers, read in place: one block
(`decode_block`), or rows of them (`dequantize_rows`, the reference and the tiles of a
many-row product). NumPy and Numba only; compiled code cached as
`pagedkv.runtime.kernel_cache` says. The format is a run-time argument (`type_id`, the
GGML type id) branched on once per block.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from pagedkv.ops.cpu.bf16 import bits_as_float32
from pagedkv.runtime import kernel_cache

kernel_cache.use_shared_cache()  # before the first `cache=True` decorator

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = (
    2,
    3,
    6,
    7,
    8,
    12,
    13,
    14,
)  # GGML type ids (`formats.py`)


@njit(inline="always")
def byte(row, at):  # pragma: no cover
    return np.int64(row[at])


@njit(inline="always")
def half(row, at):  # pragma: no cover
    """The IEEE half-precision number in bytes at, at + 1 (little-endian) as float32."""
    h = byte(row, at) | (byte(row, at + 1) << 8)
    sign, exponent, mantissa = (h & 0x8000) << 16, (h >> 10) & 0x1F, h & 0x3FF
    if exponent == 0:  # zero or subnormal: mantissa * 2^-24
        value = _float(mantissa) * np.float32(5.9604644775390625e-08)
        return -value if sign else value
    if exponent == 31:
        return bits_as_float32(sign | 0x7F800000 | (mantissa << 13))
    return bits_as_float32(sign | ((exponent + 112) << 23) | (mantissa << 13))


@njit(inline="always")
def _float(value):  # pragma: no cover
    """A small integer as float32, through int32: the vector units convert 32-bit lanes."""
    return np.float32(np.int32(value))


@njit(inline="always")
def _signed(value):  # pragma: no cover
    """A byte (0..255) as the int8 it is the bits of."""
    return (value ^ 128) - 128


@njit(inline="always")
def _q8_0(row, at, out):  # pragma: no cover
    d = half(row, at)
    for k in range(32):
        out[k] = d * _float(_signed(byte(row, at + 2 + k)))


@njit(inline="always")
def _q4(row, at, d, m, out):  # pragma: no cover
    """Q4_0 / Q4_1's 16 bytes at `at`: weight j in byte j's low nibble, j + 16 in its high."""
    for j in range(16):
        b = byte(row, at + j)
        out[j] = d * _float(b & 15) + m
        out[j + 16] = d * _float(b >> 4) + m


@njit(inline="always")
def _q5(row, at, d, m, out):  # pragma: no cover
    """Q5_0 / Q5_1's 4 bytes of fifth bits at `at` (bit j of the little-endian word: weight
    j's) and 16 bytes of nibbles after them, laid out as `_q4`'s."""
    high = byte(row, at) | (byte(row, at + 1) << 8) | (byte(row, at + 2) << 16)
    high |= byte(row, at + 3) << 24
    for j in range(16):
        b = byte(row, at + 4 + j)
        out[j] = d * _float((b & 15) | (((high >> j) & 1) << 4)) + m
        out[j + 16] = d * _float((b >> 4) | (((high >> (j + 16)) & 1) << 4)) + m


@njit(inline="always")
def scale_min(row, at, j):  # pragma: no cover
    """The 6-bit scale and min of sub-block j (0..7) of a K-quant's 12 bytes at `at`."""
    if j < 4:
        return byte(row, at + j) & 63, byte(row, at + j + 4) & 63
    low = byte(row, at + j + 4)
    scale = (low & 15) | ((byte(row, at + j - 4) >> 6) << 4)
    return scale, (low >> 4) | ((byte(row, at + j) >> 6) << 4)


@njit(inline="always")
def _q45_k(row, at, fifth, out):  # pragma: no cover
    """Q4_K (`fifth` False) or Q5_K: four runs of 64 weights, each two sub-blocks of 32
    sharing 32 bytes of nibbles (low: the first, high: the second); Q5_K's fifth bits are
    bits 2c, 2c + 1 of 32 bytes after the scales."""
    d, dmin = half(row, at), half(row, at + 2)
    high = at + 16
    nibbles = at + 48 if fifth else at + 16
    for c in range(4):
        s1, m1 = scale_min(row, at + 4, 2 * c)
        s2, m2 = scale_min(row, at + 4, 2 * c + 1)
        d1, o1 = d * _float(s1), dmin * _float(m1)
        d2, o2 = d * _float(s2), dmin * _float(m2)
        for k in range(32):
            b = byte(row, nibbles + 32 * c + k)
            lo, hi = b & 15, b >> 4
            if fifth:
                h = byte(row, high + k)
                lo += ((h >> (2 * c)) & 1) << 4
                hi += ((h >> (2 * c + 1)) & 1) << 4
            out[64 * c + k] = d1 * _float(lo) - o1
            out[64 * c + 32 + k] = d2 * _float(hi) - o2


@njit(inline="always")
def _q6_k(row, at, out):  # pragma: no cover
    """Two halves of 128 weights: 64 bytes of low nibbles, 32 of 2-bit high pairs and 8
    int8 scales (one per 16 weights) each; d last."""
    d = half(row, at + 208)
    for part in range(2):
        low, high, scales, y = at + 64 * part, at + 128 + 32 * part, at + 192 + 8 * part, 128 * part
        for k in range(32):
            s = k // 16
            h = byte(row, high + k)
            a, b = byte(row, low + k), byte(row, low + k + 32)
            q = ((a & 15) | ((h & 3) << 4), (b & 15) | (((h >> 2) & 3) << 4),
                 (a >> 4) | (((h >> 4) & 3) << 4), (b >> 4) | (((h >> 6) & 3) << 4))  # fmt: skip
            for i in range(4):
                scale = d * _float(_signed(byte(row, scales + s + 2 * i)))
                out[y + 32 * i + k] = scale * _float(q[i] - 32)


@njit(inline="always")
def decode_block(type_id, row, at, out):  # pragma: no cover
    """Write the block at byte `at` of `row` (uint8) as float32 into out[:block_size]."""
    if type_id == Q8_0:
        _q8_0(row, at, out)
    elif type_id == Q4_0:
        d = half(row, at)
        _q4(row, at + 2, d, np.float32(-8.0) * d, out)
    elif type_id == Q4_1:
        _q4(row, at + 4, half(row, at), half(row, at + 2), out)
    elif type_id == Q5_0:
        d = half(row, at)
        _q5(row, at + 2, d, np.float32(-16.0) * d, out)
    elif type_id == Q5_1:
        _q5(row, at + 4, half(row, at), half(row, at + 2), out)
    elif type_id == Q6_K:
        _q6_k(row, at, out)
    else:
        _q45_k(row, at, type_id == Q5_K, out)


@njit(cache=True, parallel=True)
def dequantize_rows(blocks, type_id, block_size, block_bytes, row_ids, out):  # pragma: no cover
    """out[i] = row `row_ids[i]` of `blocks` as float32.

    blocks: uint8 [rows, row_bytes]; row_ids: int64 [n]; out: float32 [n, in_features].
    """
    for i in prange(row_ids.shape[0]):
        row = blocks[row_ids[i]]
        for b in range(out.shape[1] // block_size):
            decode_block(type_id, row, b * block_bytes, out[i, b * block_size :])
