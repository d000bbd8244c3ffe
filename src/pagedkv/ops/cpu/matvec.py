"""Matrix-vector products for a few rows: a decode step's matmuls, bound by reading weights.

NumPy and Numba only, loaded through `pagedkv.kernel_cache` like `kernels.py`.

A decode step of one to a few sequences multiplies a handful of rows by every weight matrix
once: its time is the weights' read from memory. torch's CPU matmul splits each product
over its thread team, and on a small machine waking that team costs about as much as the
product itself (a virtual CPU that went idle between two layers must be rescheduled). One
thread streaming the weight row by row keeps the memory busy with no hand-off: each weight
row is read once and multiplied by every input row while it is in the L1 cache.

Sums run in float32 in index order; a bfloat16 weight (its bits, uint16) is widened exactly,
as torch's bfloat16 matmul does before it rounds the float32 sum once.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from pagedkv.ops.cpu.bf16 import as_float32


@njit(cache=True, fastmath=True)
def matvec(x, weight, out):  # pragma: no cover
    """out[m, n] = x[m] . weight[n] for every input row m and weight row n.

    Args:
        x: float32 [rows, in_features], C-contiguous.
        weight: float32 or bfloat16 bits (uint16) [out_features, in_features], C-contiguous.
        out: float32 [rows, out_features], overwritten.
    """
    rows, size = x.shape
    for n in range(weight.shape[0]):
        w = weight[n]
        for m in range(rows):
            xm = x[m]
            total = np.float32(0.0)
            for k in range(size):
                total += as_float32(w[k]) * xm[k]
            out[m, n] = total
