"""Matrix-vector products for a few rows: a decode step's matmuls, bound by reading weights.
NumPy and Numba only, loaded through `pagedkv.kernel_cache` like `kernels.py`.

torch's CPU matmul splits each product over its thread team, and on a small machine waking
that team costs about as much as a decode step's product (a virtual CPU idle between two
layers must be rescheduled). `matvec` streams each weight row once on the calling thread,
multiplying it by every input row while it is in the L1 cache, and keeps the memory busy
with no hand-off. Where the workers spin between parallel regions instead of sleeping (the
user chose ``OMP_WAIT_POLICY=ACTIVE``: a machine of its own), the hand-off is cheap and
`matvec_parallel` gives each thread a contiguous share of the weight's rows.

Sums run in float32 in index order; bfloat16 values (their bits, uint16) are widened
exactly, and a bfloat16 result is the float32 sum (bias included) rounded once, as torch's
bfloat16 matmul gives it. Both kernels compute every output the same way, so they agree
bit for bit.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from pagedkv.ops.cpu.bf16 import as_float32, round_to_bf16


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
    """The input rows as float32."""
    rows, size = x.shape
    wide = np.empty((rows, size), dtype=np.float32)
    for m in range(rows):
        for k in range(size):
            wide[m, k] = as_float32(x[m, k])
    return wide


@njit(cache=True, fastmath=True)
def _products(wide, weight, bias, out, first, end):  # pragma: no cover
    """out[:, n] for weight rows first <= n < end (inputs already float32).

    Input rows four at a time: each element of the weight row is loaded (and widened) once
    for four sums, not once per row, which at a few rows is what bounds the loop."""
    rows, size = wide.shape
    for n in range(first, end):
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


def narrow(value, like):  # pragma: no cover
    """A float32 as an element of the array `like`: itself, or rounded to bfloat16 bits."""
    raise NotImplementedError("compiled only")


@overload(narrow)
def _narrow_impl(value, like):  # pragma: no cover
    if like.dtype == types.uint16:
        return lambda value, like: np.uint16(round_to_bf16(value))
    return lambda value, like: value
