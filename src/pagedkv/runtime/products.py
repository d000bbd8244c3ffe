"""Products of a few rows on the CPU, on the plain weight: the matrix-vector kernel of
`matvec.py` (`linear_rows`), and for bfloat16 past a decode step's few rows the tiled
kernel of `bf16_tiles.py` (`tiled_rows`); each on the calling thread, or split over every thread
where that pays."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from types import ModuleType

import numpy as np
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
    parts = sync_threads()
    return _product(
        weight,
        lambda x, out: matvec.matvec(x, flat_weight, flat_bias, out, prefetch),
        lambda x, out: matvec.matvec_parallel(x, flat_weight, flat_bias, out, parts, prefetch),
        parts,
        _min_work(tuning, parallel),
    )


def tiles_apply(weight: Tensor, bias: Tensor | None) -> bool:
    """Whether `tiled_rows` multiplies `weight`: bfloat16 without a bias, rows a multiple
    of 32 elements long, on a CPU with AVX512-BF16's dot product."""
    from pagedkv.ops.cpu.bf16 import HAS_DOT

    bf16 = weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
    return HAS_DOT and bf16 and bias is None and weight.shape[1] % 32 == 0


def tiled_rows(
    weight: Tensor, tuning: CpuTuning | None = None, parallel: bool | None = None
) -> Callable[[Tensor], Tensor]:
    """`x -> F.linear(x, weight)` by `bf16_tiles.py`'s kernel, where `tiles_apply`: float32 sums
    rounded once, each output's bits the same whatever the other rows and the threads.
    The weight is read in place.

    Args:
        weight: [out_features, in_features], C-contiguous bfloat16 on the CPU.
        tuning, parallel: as `linear_rows` takes them.
    """
    tiles, flat_weight, parts = _tiles(), as_numpy(weight), sync_threads()
    return _product(
        weight,
        lambda x, out: tiles.tiles(x, flat_weight, out),
        lambda x, out: tiles.tiles_parallel(x, flat_weight, out, parts),
        parts,
        _min_work(tuning or CpuTuning(), parallel),
    )


def _product(
    weight: Tensor,
    serial: Callable[[np.ndarray, np.ndarray], None],
    parallel: Callable[[np.ndarray, np.ndarray], None],
    parts: int,
    min_work: float,
) -> Callable[[Tensor], Tensor]:
    """`x -> x @ weight.T` by a kernel that writes into `out` ([rows, out_features]): on the
    calling thread, or `parallel` (over `parts` threads) where there is more than one and
    the product is at least `min_work` multiply-adds."""
    out_features, size = weight.shape[0], weight.numel()

    def product(x: Tensor) -> Tensor:
        if x.dtype != weight.dtype:
            raise checks.fail("x", f"the weight's dtype {weight.dtype}", x.dtype)
        out = torch.empty(x.shape[0], out_features, dtype=x.dtype)
        split = parts > 1 and x.shape[0] * size >= min_work
        (parallel if split else serial)(as_numpy(x.contiguous()), as_numpy(out))
        return out

    return product


@functools.cache
def _tiles() -> ModuleType:
    """`bf16_tiles.py`, its kernels compiled (or loaded) by a call on the smallest arrays, when
    the model is set up rather than at its first product."""
    from pagedkv.runtime import bf16_tiles as tiles  # compiled for AVX512-BF16 only

    x, out = np.zeros((1, 32), np.uint16), np.empty((1, 1), np.uint16)
    tiles.tiles(x, x, out)
    tiles.tiles_parallel(x, x, out, 1)
    return tiles


def _min_work(tuning: CpuTuning, parallel: bool | None) -> float:
    """Multiply-adds from which a product is split over every thread: `tuning`'s
    `parallel_work` (0 where the workers spin), or as `parallel` says."""
    if parallel is None:
        return 0 if workers_spin() else tuning.parallel_work
    return 0 if parallel else math.inf
