"""Matrix-vector products for a few rows: a decode step's matmuls, bound by reading weights.
NumPy and Numba only; compiled code cached as `pagedkv.runtime.kernel_cache` says.

torch's CPU matmul splits each product over its thread team, and on a small machine waking
that team costs about as much as a decode step's product (a virtual CPU idle between two
layers must be rescheduled). `matvec` streams each weight row once on the calling thread,
multiplying it by every input row while it is in the L1 cache, and keeps the memory busy
with no hand-off. Where the workers spin between parallel regions instead of sleeping (the
user chose ``OMP_WAIT_POLICY=ACTIVE``: a machine of its own), the hand-off is cheap and
`matvec_parallel` gives each thread a contiguous share of the weight's rows.

Sums run in float32. The input rows are in the weight's dtype (a bfloat16 model's
activations are bfloat16 values, as its matmul takes them); bfloat16 values (their bits,
uint16) are widened exactly, and a bfloat16 result is the float32 sum (bias included)
rounded once, as torch's bfloat16 matmul gives it. Both kernels compute every output the
same way, so they agree bit for bit. Where the CPU has a bfloat16 dot product instruction
(`bf16.dot32`) a bfloat16 row takes one instruction per 32 elements; elsewhere each element
is widened by itself.

Each weight row's lines are asked for `prefetch` bytes ahead (`CpuTuning.prefetch_bytes`,
an argument: a module constant would be frozen into the cached machine code) as data read
once (`prefetch_once`, x86's `prefetchnta`). A decode step streams every weight through the
caches; fetched the ordinary way they push out of L2 and L3 all that the step reads next:
the KV cache, the step's buffers and, after the call, the interpreter's code and objects.
Asked for this way they leave most of that in place. With one input row the lines are
asked for just as they are read (`_products_dot`), or not at all (float32:
`_products_widened`).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from pagedkv.ops.cpu.bf16 import HAS_DOT, as_float32, dot32, prefetch_once, round_to_bf16
from pagedkv.runtime import kernel_cache

kernel_cache.use_shared_cache()  # before the first `cache=True` decorator


@njit(cache=True, fastmath=True)
def matvec(x, weight, bias, out, prefetch):  # pragma: no cover
    """out[m, n] = x[m] . weight[n] + bias[n] for every input row m and weight row n.

    x: [rows, in]; weight: [out, in]; bias: [out] or empty; out: [rows, out], overwritten;
    all of one dtype, float32 or bfloat16 bits (uint16), C-contiguous. prefetch: bytes ahead
    of a weight row that its lines are asked for.
    """
    # An int64 start, as `stack.py` passes: a literal 0 would compile `products` once more.
    products(x, weight, bias, out, np.int64(0), weight.shape[0], prefetch)


@njit(cache=True, fastmath=True, parallel=True)
def matvec_parallel(x, weight, bias, out, parts, prefetch):  # pragma: no cover
    """`matvec` with the weight's rows cut into `parts` contiguous shares, one per task."""
    num_out = weight.shape[0]
    share = -(-num_out // parts)
    for p in prange(parts):
        products(x, weight, bias, out, p * share, min(num_out, (p + 1) * share), prefetch)


def products(x, weight, bias, out, first, end, prefetch):  # pragma: no cover
    """out[:, n] for weight rows first <= n < end (x in the weight's dtype)."""
    raise NotImplementedError("compiled only")


@overload(products)
def _products_impl(x, weight, bias, out, first, end, prefetch):  # pragma: no cover
    if weight.dtype == types.uint16 and HAS_DOT:
        return lambda x, weight, bias, out, first, end, prefetch: _products_dot(
            x, weight, bias, out, first, end, prefetch)  # fmt: skip
    return lambda x, weight, bias, out, first, end, prefetch: _products_widened(
        x, weight, bias, out, first, end, prefetch)  # fmt: skip


@njit(cache=True, fastmath=True)
def _products_widened(x, weight, bias, out, first, end, prefetch):  # pragma: no cover
    """`products` widening each element by itself (float32: as it is), input rows four at a
    time: each element of the weight row is loaded and widened once for several sums, not
    once per row, which at a few rows is what bounds the loop."""
    rows, size = x.shape
    # With one input row the loop is a load and a multiply-add per element, and the
    # prefetches' own instructions cost it more than the caches they spare.
    ahead = rows > 1
    for n in range(first, end):
        if ahead:
            _prefetch_ahead(weight, n * size, size, prefetch)
        w = weight[n]
        shift = as_float32(bias[n]) if bias.shape[0] else np.float32(0.0)
        m = 0
        while m + 4 <= rows:
            x0, x1, x2, x3 = x[m], x[m + 1], x[m + 2], x[m + 3]
            t0 = t1 = t2 = t3 = np.float32(0.0)
            for k in range(size):
                wk = as_float32(w[k])
                t0 += wk * as_float32(x0[k])
                t1 += wk * as_float32(x1[k])
                t2 += wk * as_float32(x2[k])
                t3 += wk * as_float32(x3[k])
            out[m, n], out[m + 1, n] = narrow(t0 + shift, out), narrow(t1 + shift, out)
            out[m + 2, n], out[m + 3, n] = narrow(t2 + shift, out), narrow(t3 + shift, out)
            m += 4
        for r in range(m, rows):
            xr = x[r]
            total = np.float32(0.0)
            for k in range(size):
                total += as_float32(w[k]) * as_float32(xr[k])
            out[r, n] = narrow(total + shift, out)


@njit(cache=True, fastmath=True)
def _products_dot(x, weight, bias, out, first, end, prefetch):  # pragma: no cover
    """`products` for bfloat16 by `dot32`, one input row at a time (after the first, the
    weight row is read from the L1 cache), the last `size % 32` elements one by one."""
    rows, size = x.shape
    groups = size // 32
    # With one input row the loop streams the weight as fast as memory gives it, and the
    # hardware prefetcher keeps ahead of it: lines asked for ahead only compete with its
    # requests. The hint on the line about to be read still keeps it out of the caches.
    ahead = prefetch if rows > 1 else 0
    for n in range(first, end):
        at = n * size  # weight row n's first element
        _prefetch_ahead(weight, at, size, ahead)
        shift = as_float32(bias[n]) if bias.shape[0] else np.float32(0.0)
        for m in range(rows):
            total = dot32(weight, at, x, m * size, groups)
            for k in range(32 * groups, size):
                total += as_float32(weight[n, k]) * as_float32(x[m, k])
            out[m, n] = narrow(total + shift, out)


@njit(inline="always")
def _prefetch_ahead(weight, at, size, prefetch):  # pragma: no cover
    """Ask for the `size` elements `prefetch` bytes past flat offset `at` of `weight`, a line
    at a time, to be read once."""
    last = weight.size - 1
    ahead = at + prefetch // weight.itemsize
    for c in range(0, size, 64 // weight.itemsize):
        prefetch_once(weight, min(ahead + c, last))


def narrow(value, like):  # pragma: no cover
    """A float32 as an element of the array `like`: itself, or rounded to bfloat16 bits."""
    raise NotImplementedError("compiled only")


@overload(narrow)
def _narrow_impl(value, like):  # pragma: no cover
    if like.dtype == types.uint16:
        return lambda value, like: np.uint16(round_to_bf16(value))
    return lambda value, like: value
