"""The accumulate step of the CPU decode kernel over an int8 cache (`spans.accumulate_span`
chooses it where the scales are an array; scores take `spans.py`'s loop, which converts each
K element once for two or three heads already).

`tiles.accumulate_rows` adds the weighted V rows of the whole span into each head's output
row, a KV head's group at a time: the sums stay in registers across the span, each V row is
converted once for the group, and a token's V scale multiplies its weights as they are read.
"""

from __future__ import annotations

from numba import njit

from pagedkv.ops.cpu.tiles import accumulate_rows
from pagedkv.runtime import kernel_cache

kernel_cache.use_shared_cache()  # before the first `cache=True` decorator


@njit(cache=True, fastmath=True)
def accumulate_span(key_cache, value_cache, value_scales, slots, n, known, weights,
                    acc):  # fmt: skip  # pragma: no cover
    """`spans.accumulate_span` for an int8 cache (V scales [num_slots, num_kv_heads] float16
    bits); acc: float32 [H, D]."""
    group = acc.shape[0] // value_cache.shape[1]
    for g in range(value_cache.shape[1]):
        accumulate_rows(value_cache, key_cache, value_scales, slots, n, known, g, weights, acc,
                        g * group, group)  # fmt: skip
