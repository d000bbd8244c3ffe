"""The online softmax of the CPU kernels' spans, and the vectorizable exp it runs on.

`exp_parts` and `EXACT_ORDER` are public: the decoder stack (`pagedkv.runtime.stack`) uses
them for its SiLU and its own sums.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from pagedkv.runtime import kernel_cache

kernel_cache.use_shared_cache()  # before the first `cache=True` decorator

EXACT_ORDER = {"nnan", "ninf", "nsz", "arcp", "contract", "afn"}
"""fastmath without reassociation, for a compiled function that others call. Numba links a
copy of it into each caller's code, optimized again there, and which copy runs depends on
what the process compiled or loaded first: its own (compiled in this process) or a
caller's (loaded from the cache). Reassociation lets each copy sum in its own order, and a
process that compiled the kernels gave other bits than one that loaded them."""


@njit(cache=True, fastmath=EXACT_ORDER)
def softmax_span(scores, n, acc, row_max, row_sum, pow2):  # pragma: no cover
    """Online softmax: raise each head's max over the span's n scores, rescale acc and
    row_sum, and turn the scores into weights exp(score - max). The weights are summed in
    four lanes added in a fixed order (`EXACT_ORDER`)."""
    two_to = pow2.view(np.float32)
    for h in range(scores.shape[0]):
        new_max = row_max[h]
        for t in range(n):
            new_max = max(new_max, scores[h, t])
        for t in range(n):
            scores[h, t], pow2[t] = exp_parts(scores[h, t] - new_max)
        for t in range(n):
            scores[h, t] *= two_to[t]
        s0 = s1 = s2 = s3 = np.float32(0.0)
        for t in range(0, n - 3, 4):
            s0, s1 = s0 + scores[h, t], s1 + scores[h, t + 1]
            s2, s3 = s2 + scores[h, t + 2], s3 + scores[h, t + 3]
        for t in range(n - n % 4, n):
            s0 += scores[h, t]
        total = (s0 + s1) + (s2 + s3)
        correction = np.exp(row_max[h] - new_max)
        row_sum[h] = row_sum[h] * correction + total
        row_max[h] = new_max
        for d in range(acc.shape[1]):
            acc[h, d] *= correction


@njit(fastmath=True, inline="always")
def exp_parts(y):  # pragma: no cover
    """exp(y), y <= 0, as 2^f and the bits of 2^k (y / ln 2 = k + f, k an integer, |f| <=
    1/2), multiplied by the caller once the bits are read as float32 (through an int32 buffer
    or `bf16.bits_as_float32`): unlike libm's expf (a scalar call) this vectorizes. A degree-7
    polynomial gives 2^f to float32 rounding; arguments below -87 give about 1e-38."""
    x = max(y, np.float32(-87.0)) * np.float32(1.4426950408889634)
    k = np.floor(x + np.float32(0.5))
    f = (x - k) * np.float32(0.6931471805599453)  # f = ln(2^(x - k)), |f| <= ln2 / 2
    p = np.float32(1.0 / 5040.0)
    p = p * f + np.float32(1.0 / 720.0)
    p = p * f + np.float32(1.0 / 120.0)
    p = p * f + np.float32(1.0 / 24.0)
    p = p * f + np.float32(1.0 / 6.0)
    p = p * f + np.float32(0.5)
    p = p * f + np.float32(1.0)
    return p * f + np.float32(1.0), (np.int32(k) + 127) << 23
