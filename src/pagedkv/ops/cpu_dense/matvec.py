"""Matrix-vector products for a few rows: a decode step's matmuls, bound by reading weights.
NumPy and Numba only, loaded through `pagedkv.kernel_cache` like `kernels.py`.

torch's CPU matmul splits each product over its thread team, and on a small machine waking
that team costs about as much as a decode step's product (a virtual CPU idle between two
layers must be rescheduled). `matvec` streams each weight row once on the calling thread,
multiplying it by every input row while it is in the L1 cache, and keeps the memory busy
with no hand-off. Where the workers spin between parallel regions instead of sleeping (the
user chose ``OMP_WAIT_POLICY=ACTIVE``: a machine of its own), the hand-off is cheap and
`matvec_parallel` gives each thread a contiguous share of the weight's rows.

Sums run in float32; bfloat16 values (their bits, uint16) are widened exactly, and a
bfloat16 result is the float32 sum (bias included) rounded once, as torch's bfloat16 matmul
gives it. Both kernels compute every output the same way, so they agree bit for bit.

A bfloat16 weight row is read as 32-bit words of two elements: the even element is the
word shifted left by 16 bits, the odd one the word with its low half cleared, two plain
vector operations per word. (Widening element by element zero-extends 16-bit lanes to 32,
a shuffle across the vector, which left the loop short of the memory's speed.) The input
row is therefore held in *pair order*, its even elements first and then its odd ones
(`place_inputs`), so that both halves of a word meet their inputs with plain loads.

Each weight row's lines are asked for a few KB ahead as data read once (`prefetch_once`,
x86's `prefetchnta`). A decode step streams every weight, hundreds of MB, through the
caches; fetched the ordinary way they push out of L2 and L3 all that the step reads next:
the KV cache, the step's buffers and, after the call, the interpreter's code and objects.
Asked for this way they leave most of that in place. (Not for one float32 input row: see
`_products_widened`.)
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from pagedkv.ops.cpu.bf16 import (
    as_float32,
    bits_as_float32,
    pair_bits,
    prefetch_once,
    round_to_bf16,
)

PREFETCH_BYTES = 4096
"""How far ahead of the row being multiplied its weight lines are asked for."""


@njit(cache=True, fastmath=True)
def matvec(x, weight, bias, out):  # pragma: no cover
    """out[m, n] = x[m] . weight[n] + bias[n] for every input row m and weight row n.

    x: [rows, in]; weight: [out, in]; bias: [out] or empty; out: [rows, out], overwritten;
    each float32 or bfloat16 bits (uint16), C-contiguous.
    """
    # An int64 start, as `layers.py` passes: a literal 0 would compile `_products` once more.
    _products(_widen(x), weight, bias, out, np.int64(0), weight.shape[0])


@njit(cache=True, fastmath=True, parallel=True)
def matvec_parallel(x, weight, bias, out, parts):  # pragma: no cover
    """`matvec` with the weight's rows cut into `parts` contiguous shares, one per task."""
    wide = _widen(x)
    num_out = weight.shape[0]
    share = -(-num_out // parts)
    for p in prange(parts):
        _products(wide, weight, bias, out, p * share, min(num_out, (p + 1) * share))


@njit(cache=True, fastmath=True)
def _widen(x):  # pragma: no cover
    """The input rows as float32, in `_products`' order for x's dtype."""
    wide = np.empty(x.shape, dtype=np.float32)
    for m in range(x.shape[0]):
        place_inputs(x[m], wide[m], 0, x)
    return wide


def place_inputs(values, row, first, like):  # pragma: no cover
    """row[first + j] = values[j] as float32, for `_products` with weights of `like`'s dtype:
    for bfloat16 of an even row size, at its place in pair order (element k of the row at
    k // 2 for even k, size // 2 + k // 2 for odd k)."""
    raise NotImplementedError("compiled only")


@overload(place_inputs)
def _place_inputs_impl(values, row, first, like):  # pragma: no cover
    if like.dtype != types.uint16:
        return lambda values, row, first, like: _place_in_order(values, row, first, like)

    def in_pair_order(values, row, first, like):  # type: ignore[no-untyped-def]
        size = row.shape[0]
        if not _in_pairs(size):
            _place_in_order(values, row, first, like)
            return
        pairs = row.reshape((2, size >> 1))
        for j in range(values.shape[0]):
            at = first + j
            pairs[at & 1, at >> 1] = as_float32(values[j])

    return in_pair_order


@njit(inline="always")
def _in_pairs(size):  # pragma: no cover
    """Whether bfloat16 rows of `size` elements are read a word of two at a time (and their
    inputs placed in pair order): an even size, which a word never straddles."""
    return size % 2 == 0


@njit(inline="always")
def _place_in_order(values, row, first, like):  # pragma: no cover
    for j in range(values.shape[0]):
        row[first + j] = as_float32(values[j])


def _products(wide, weight, bias, out, first, end):  # pragma: no cover
    """out[:, n] for weight rows first <= n < end (inputs already float32, placed by
    `place_inputs`).

    Input rows a few at a time (four widened, two or four in pairs): each element of the
    weight row is loaded and widened once for several sums, not once per row, which at a few
    rows is what bounds the loop."""
    raise NotImplementedError("compiled only")


@overload(_products)
def _products_impl(wide, weight, bias, out, first, end):  # pragma: no cover
    if weight.dtype == types.uint16:

        def pairs_where_even(wide, weight, bias, out, first, end):  # type: ignore[no-untyped-def]
            if _in_pairs(wide.shape[1]):
                _products_pairs(wide, weight, bias, out, first, end)
            else:
                _products_widened(wide, weight, bias, out, first, end)

        return pairs_where_even
    return lambda wide, weight, bias, out, first, end: _products_widened(
        wide, weight, bias, out, first, end)  # fmt: skip


@njit(cache=True, fastmath=True)
def _products_widened(wide, weight, bias, out, first, end):  # pragma: no cover
    """`_products` widening each weight element by itself (float32: as it is)."""
    rows, size = wide.shape
    # With one input row the loop is a load and a multiply-add per element, and the
    # prefetches' own instructions cost it more than the caches they spare.
    ahead = rows > 1
    for n in range(first, end):
        if ahead:
            _prefetch_ahead(weight, n * size, size)
        w = weight[n]
        shift = as_float32(bias[n]) if bias.shape[0] else np.float32(0.0)
        m = 0
        while m + 4 <= rows:
            x0, x1, x2, x3 = wide[m], wide[m + 1], wide[m + 2], wide[m + 3]
            t0 = t1 = t2 = t3 = np.float32(0.0)
            for k in range(size):
                wk = as_float32(w[k])
                t0 += wk * x0[k]
                t1 += wk * x1[k]
                t2 += wk * x2[k]
                t3 += wk * x3[k]
            out[m, n], out[m + 1, n] = narrow(t0 + shift, out), narrow(t1 + shift, out)
            out[m + 2, n], out[m + 3, n] = narrow(t2 + shift, out), narrow(t3 + shift, out)
            m += 4
        for r in range(m, rows):
            xr = wide[r]
            total = np.float32(0.0)
            for k in range(size):
                total += as_float32(w[k]) * xr[k]
            out[r, n] = narrow(total + shift, out)


@njit(cache=True, fastmath=True)
def _products_pairs(wide, weight, bias, out, first, end):  # pragma: no cover
    """`_products` for bfloat16 weights of an even row size, a word of two elements at a
    time (`_pair`)."""
    rows, size = wide.shape
    half = size >> 1
    # [row, even or odd, k], C-contiguous: with `wide[m, half + k]` the loops would check
    # the index for wraparound, with a slice `wide[:, half:]` not know its unit stride, and
    # either keeps LLVM from vectorizing them.
    x = wide.reshape((rows, 2, half))
    for n in range(first, end):
        at = n * size  # weight row n's first element
        _prefetch_ahead(weight, at, size)
        shift = as_float32(bias[n]) if bias.shape[0] else np.float32(0.0)
        m = 0
        # Four input rows per pass only in batches of eight or more: there they halve the
        # widening of an L1-resident weight row, while a batch of four ran faster in pairs.
        while rows >= 8 and m + 4 <= rows:
            t0 = t1 = t2 = t3 = np.float32(0.0)
            for k in range(half):
                we, wo = _pair(weight, at + 2 * k)
                t0 += we * x[m, 0, k] + wo * x[m, 1, k]
                t1 += we * x[m + 1, 0, k] + wo * x[m + 1, 1, k]
                t2 += we * x[m + 2, 0, k] + wo * x[m + 2, 1, k]
                t3 += we * x[m + 3, 0, k] + wo * x[m + 3, 1, k]
            out[m, n], out[m + 1, n] = narrow(t0 + shift, out), narrow(t1 + shift, out)
            out[m + 2, n], out[m + 3, n] = narrow(t2 + shift, out), narrow(t3 + shift, out)
            m += 4
        while m + 2 <= rows:
            t0 = t1 = np.float32(0.0)
            for k in range(half):
                we, wo = _pair(weight, at + 2 * k)
                t0 += we * x[m, 0, k] + wo * x[m, 1, k]
                t1 += we * x[m + 1, 0, k] + wo * x[m + 1, 1, k]
            out[m, n], out[m + 1, n] = narrow(t0 + shift, out), narrow(t1 + shift, out)
            m += 2
        if m < rows:
            total = np.float32(0.0)
            for k in range(half):
                we, wo = _pair(weight, at + 2 * k)
                total += we * x[m, 0, k] + wo * x[m, 1, k]
            out[m, n] = narrow(total + shift, out)


@njit(inline="always")
def _prefetch_ahead(weight, at, size):  # pragma: no cover
    """Ask for the `size` elements `PREFETCH_BYTES` past flat offset `at` of `weight`, a line
    at a time, to be read once."""
    last = weight.size - 1
    ahead = at + PREFETCH_BYTES // weight.itemsize
    for c in range(0, size, 64 // weight.itemsize):
        prefetch_once(weight, min(ahead + c, last))


@njit(inline="always")
def _pair(weight, at):  # pragma: no cover
    """The bfloat16 elements at flat offsets at and at + 1 of `weight`, widened from one
    32-bit load: (even, odd)."""
    word = pair_bits(weight, at)
    return bits_as_float32(word << np.uint32(16)), bits_as_float32(word & np.uint32(0xFFFF0000))


def narrow(value, like):  # pragma: no cover
    """A float32 as an element of the array `like`: itself, or rounded to bfloat16 bits."""
    raise NotImplementedError("compiled only")


@overload(narrow)
def _narrow_impl(value, like):  # pragma: no cover
    if like.dtype == types.uint16:
        return lambda value, like: np.uint16(round_to_bf16(value))
    return lambda value, like: value
