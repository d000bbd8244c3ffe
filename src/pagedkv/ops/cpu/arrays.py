"""Torch tensors as the CPU kernels take them: NumPy views (bfloat16 as its bits), the
thread count the kernels share with torch, and slots checked against a pool."""

from __future__ import annotations

import numba
import numpy as np
import torch

from pagedkv.ops import checks


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A float32 or int8 tensor as NumPy, a bfloat16 or float16 one as its bits (NumPy has
    no bfloat16, and Numba's float16 arithmetic is partial)."""
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def sync_threads() -> int:
    """Give the kernels torch's thread count (both run on one OpenMP runtime's pool)."""
    threads = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]
    if numba.get_num_threads() != threads:
        numba.set_num_threads(threads)
    return threads


def checked_slots(slot_mapping: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, int]:
    """The slots as int64 and the lowest one; raises where one lies past the pool."""
    slots = slot_mapping.long()
    low, high = (int(x) for x in torch.aminmax(slots))
    if high >= num_slots:
        first = int(torch.nonzero(slot_mapping >= num_slots)[0])
        raise checks.slot_past_end(slot_mapping, first, num_slots)
    return slots, low
