"""A few rows' product on the CPU (`linear_rows`): the matrix-vector kernel of `matvec.py`
on the calling thread, or split over every thread where that pays."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from pagedkv.ops import checks
from pagedkv.ops.cpu.arrays import as_numpy, sync_threads
from pagedkv.runtime import matvec
from pagedkv.runtime.threads import workers_spin
from pagedkv.runtime.tuning import CpuTuning


def linear_rows(
    weight: Tensor,
    bias: Tensor | None,
    tuning: CpuTuning | None = None,
    parallel: bool | None = None,
) -> Callable[[Tensor], Tensor]:
    """`x -> F.linear(x, weight, bias)` for a few rows of x (`matvec.py`): each weight row
    is read once, sums in float32, the result rounded once to the weight's dtype; the same
    bits on one thread or on all. The weight is read in place (an in-place update shows).

    Args:
        weight: [out_features, in_features], C-contiguous, float32 or bfloat16, on the CPU.
        bias: [out_features] of the same dtype, or None.
        tuning: `parallel_work` and `prefetch_bytes` (default: `CpuTuning()`).
        parallel: split the rows over torch's threads; default: where there is more than
            one thread and the product is at least `tuning.parallel_work` (0 where the
            workers spin: the policy as it is now, the OpenMP runtime keeps the one it
            started with).
    """
    tuning = tuning or CpuTuning()
    prefetch = tuning.prefetch_bytes
    flat_weight = as_numpy(weight)
    flat_bias = as_numpy(torch.empty(0, dtype=weight.dtype) if bias is None else bias.detach())
    out_features = weight.shape[0]
    parts = sync_threads()
    if parallel is None:
        min_work: float = 0 if workers_spin() else tuning.parallel_work
    else:
        min_work = 0 if parallel else math.inf

    def product(x: Tensor) -> Tensor:
        if x.dtype != weight.dtype:
            raise checks.fail("x", f"the weight's dtype {weight.dtype}", x.dtype)
        out = torch.empty(x.shape[0], out_features, dtype=x.dtype)
        if parts > 1 and x.shape[0] * flat_weight.size >= min_work:
            matvec.matvec_parallel(
                as_numpy(x.contiguous()), flat_weight, flat_bias, as_numpy(out), parts, prefetch
            )
        else:
            matvec.matvec(as_numpy(x.contiguous()), flat_weight, flat_bias, as_numpy(out), prefetch)
        return out

    return product
