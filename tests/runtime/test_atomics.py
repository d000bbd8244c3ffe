"""The atomic counters the CPU decode stack's threads share (`runtime/atomics.py`)."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from pagedkv.ops.cpu.arrays import sync_threads
from pagedkv.runtime import atomics


@njit(parallel=True)
def _count(counters, times, threads):  # pragma: no cover
    seen = np.zeros(threads, dtype=np.int64)
    for me in prange(threads):
        for _ in range(times):
            atomics.fetch_add(counters, 0, 1)
            atomics.fetch_add(counters, 1, 3)
        atomics.pause()
        atomics.yield_cpu()
        seen[me] = atomics.load(counters, 0)
    return seen


@njit
def _elapsed():  # pragma: no cover
    start = atomics.ticks()
    total = 0.0
    for i in range(100_000):
        total += np.sqrt(float(i))
    return atomics.ticks() - start, total


def test_no_increment_is_lost_between_threads():
    threads = max(2, sync_threads())
    counters = np.zeros(8, dtype=np.int64)
    seen = _count(counters, 200_000, threads)
    assert counters[0] == 200_000 * threads and counters[1] == 3 * 200_000 * threads
    # Each thread read the counter after its own increments: at least its share.
    assert (seen >= 200_000).all() and (seen <= 200_000 * threads).all()


def test_the_cycle_counter_moves_forward_where_there_is_one():
    elapsed, _ = _elapsed()
    assert elapsed > 0 if atomics._X86 else elapsed == 0
