"""The accumulate step of the CPU decode kernel over an int8 cache (`spans.accumulate_span`
chooses it where the scales are an array; scores take `spans.py`'s loop, which converts each
K element once for two or three heads already).

Four tokens at a time through `tiles.accumulate_tile`: each V row is converted once for its
whole GQA group, and a token's V scale multiplies its weights before the row loop. The
span's last few tokens (fewer than four) take a plain loop.
"""

from __future__ import annotations

from numba import njit

from pagedkv.ops.cpu import bf16
from pagedkv.ops.cpu.bf16 import as_float32
from pagedkv.ops.cpu.int8 import token_scale
from pagedkv.ops.cpu.tiles import TOKENS, accumulate_tile
from pagedkv.runtime import kernel_cache

kernel_cache.use_shared_cache()  # before the first `cache=True` decorator


@njit(cache=True, fastmath=True)
def accumulate_span(key_cache, value_cache, value_scales, slots, n, known, weights,
                    acc):  # fmt: skip  # pragma: no cover
    """`spans.accumulate_span` for an int8 cache (V scales [num_slots, num_kv_heads] float16
    bits); acc: float32 [H, D]. Each weight is multiplied by its token's V scale in place."""
    num_heads, head_dim = acc.shape
    num_kv_heads = value_cache.shape[1]
    group = num_heads // num_kv_heads
    row = num_kv_heads * head_dim
    span = weights.shape[1]
    last = known - 1
    t = 0
    while t + TOKENS <= n:
        j0, j1, j2, j3 = slots[t], slots[t + 1], slots[t + 2], slots[t + 3]
        ahead = (slots[min(n + t, last)], slots[min(n + t + 1, last)],
                 slots[min(n + t + 2, last)], slots[min(n + t + 3, last)])  # fmt: skip
        for g in range(num_kv_heads):
            if n + t < known:
                bf16.prefetch_head(key_cache, ahead, g)
            f0, f1 = token_scale(value_scales, j0, g), token_scale(value_scales, j1, g)
            f2, f3 = token_scale(value_scales, j2, g), token_scale(value_scales, j3, g)
            h0 = g * group
            for h in range(h0, h0 + group):
                weights[h, t] *= f0
                weights[h, t + 1] *= f1
                weights[h, t + 2] *= f2
                weights[h, t + 3] *= f3
            at = g * head_dim
            v_at = (j0 * row + at, j1 * row + at, j2 * row + at, j3 * row + at)
            accumulate_tile(value_cache, v_at, head_dim, weights, h0 * span + t, span, group,
                            acc, h0 * head_dim)  # fmt: skip
        t += TOKENS
    for rest in range(t, n):
        j = slots[rest]
        for h in range(num_heads):
            p = weights[h, rest] * token_scale(value_scales, j, h // group)
            for d in range(head_dim):
                acc[h, d] += p * as_float32(value_cache[j, h // group, d])
