"""The span steps of the CPU decode kernel (`kernels.attend_item`): score a span of tokens
(every cache dtype), and add their weighted V rows (float32 and bfloat16 caches; an int8
cache's take `int8_spans.py`'s, which `accumulate_span` chooses from the scales' type).
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from pagedkv.ops.cpu import bf16, int8_spans
from pagedkv.ops.cpu.bf16 import as_float32
from pagedkv.ops.cpu.int8 import token_scale
from pagedkv.runtime import kernel_cache

kernel_cache.use_shared_cache()  # before the first `cache=True` decorator


def accumulate_span(key_cache, value_cache, value_scales, slots, n, known, weights,
                    acc):  # fmt: skip  # pragma: no cover
    """acc[h] += weights[h, t] * V scale * V[slots[t], h // group], t < n (weights may be
    overwritten); prefetches the K rows of the next span's tokens (slots[n:known])."""
    raise NotImplementedError("compiled only")


@overload(accumulate_span, inline="always")
def _accumulate_span_impl(key_cache, value_cache, value_scales, slots, n, known, weights, acc):
    step = int8_spans.accumulate_span if isinstance(value_scales, types.Array) else _accumulate_span
    return lambda key_cache, value_cache, value_scales, slots, n, known, weights, acc: step(
        key_cache, value_cache, value_scales, slots, n, known, weights, acc
    )


@njit(cache=True)
def fill_slots(table, block_size, first, count, slots):  # pragma: no cover
    """slots[t] = the cache slot of position first + t, t < count (one division, not one each)."""
    b, offset = first // block_size, first % block_size
    for t in range(count):
        slots[t] = table[b] * block_size + offset
        offset += 1
        if offset == block_size:
            b, offset = b + 1, 0


# The span steps are separate functions, each called once per span: their inner loops then
# vectorize (in one large function LLVM left the dot products scalar), and Numba's per-call
# reference counting stays off the hot path. Each loop asks for the rows the other reads
# next (V rows in the score loop, the next span's K rows in the accumulate loop), so the
# memory is busy through both. Both take four tokens at once, so that each q load serves four
# tokens and each accumulator's load and store four V rows. The score loop takes two or three
# heads of a GQA group per K load; the accumulate loop one head at a time over the four V rows
# (1-D views): after the first head those rows are L1 hits, and a loop with one output row
# is what LLVM vectorizes best (several heads per pass widened each bfloat16 V element once
# per head, and cost more than the loads they saved). An int8 cache's accumulate step is
# vector code of its own that converts each V element once per group (`int8_spans.py`).


@njit(cache=True, fastmath=True)
def score_span(q, key_cache, value_cache, key_scales, slots, n, first, scale,
               scores):  # fmt: skip  # pragma: no cover
    """scores[h, t] = scale * K scale * q[h] . K[slots[t], h // group], t < n; prefetches
    the V rows of each group of tokens and, in an item's `first` span, the K rows a group
    ahead (the accumulate loop asks for the other spans' K rows)."""
    num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[1]
    group = num_heads // num_kv_heads
    k = key_cache
    last = n - 1
    t = 0
    while t + bf16.TOKENS <= n:
        j0, j1, j2, j3 = slots[t], slots[t + 1], slots[t + 2], slots[t + 3]
        # The next group's slots, read once here: the head loop's stores may alias `slots`.
        ahead = (slots[min(t + 4, last)], slots[min(t + 5, last)], slots[min(t + 6, last)],
                 slots[min(t + 7, last)])  # fmt: skip
        for g in range(num_kv_heads):
            if first:
                bf16.prefetch_head(key_cache, ahead, g)
            bf16.prefetch_head(value_cache, (j0, j1, j2, j3), g)
            # the softmax scale times each token's K scale
            ks = key_scales
            c = (scale * token_scale(ks, j0, g), scale * token_scale(ks, j1, g),
                 scale * token_scale(ks, j2, g), scale * token_scale(ks, j3, g))  # fmt: skip
            h, end = g * group, (g + 1) * group
            while h + 2 <= end:
                three = end - h == 3  # a group of three, or the last three of an odd one
                _score_heads(q, k, j0, j1, j2, j3, g, h, three, t, c, scores)
                h += 3 if three else 2
            if h < end:  # a group of one
                s0 = s1 = s2 = s3 = np.float32(0.0)
                for d in range(head_dim):
                    qd = q[h, d]
                    s0 += qd * as_float32(k[j0, g, d])
                    s1 += qd * as_float32(k[j1, g, d])
                    s2 += qd * as_float32(k[j2, g, d])
                    s3 += qd * as_float32(k[j3, g, d])
                scores[h, t], scores[h, t + 1] = s0 * c[0], s1 * c[1]
                scores[h, t + 2], scores[h, t + 3] = s2 * c[2], s3 * c[3]
        t += bf16.TOKENS
    for rest in range(t, n):  # the item's last few tokens
        j = slots[rest]
        for h in range(num_heads):
            s = np.float32(0.0)
            for d in range(head_dim):
                s += q[h, d] * as_float32(k[j, h // group, d])
            scores[h, rest] = s * (scale * token_scale(key_scales, j, h // group))


@njit(cache=True, fastmath=True, inline="always")
def _score_heads(q, k, j0, j1, j2, j3, g, h, three, t, c, scores):  # pragma: no cover
    """`score_span`'s loop for heads h, h + 1 (and h + 2 where `three`) of KV head g, one K
    load for all, each token's sum times its factor in `c`; `three` is fixed for the loop,
    which LLVM compiles once per case."""
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = c0 = c1 = c2 = c3 = np.float32(0.0)
    for d in range(q.shape[1]):
        k0, k1 = as_float32(k[j0, g, d]), as_float32(k[j1, g, d])
        k2, k3 = as_float32(k[j2, g, d]), as_float32(k[j3, g, d])
        qa, qb = q[h, d], q[h + 1, d]
        a0 += qa * k0
        a1 += qa * k1
        a2 += qa * k2
        a3 += qa * k3
        b0 += qb * k0
        b1 += qb * k1
        b2 += qb * k2
        b3 += qb * k3
        if three:
            qc = q[h + 2, d]
            c0 += qc * k0
            c1 += qc * k1
            c2 += qc * k2
            c3 += qc * k3
    scores[h, t], scores[h, t + 1] = a0 * c[0], a1 * c[1]
    scores[h, t + 2], scores[h, t + 3] = a2 * c[2], a3 * c[3]
    scores[h + 1, t], scores[h + 1, t + 1] = b0 * c[0], b1 * c[1]
    scores[h + 1, t + 2], scores[h + 1, t + 3] = b2 * c[2], b3 * c[3]
    if three:
        scores[h + 2, t], scores[h + 2, t + 1] = c0 * c[0], c1 * c[1]
        scores[h + 2, t + 2], scores[h + 2, t + 3] = c2 * c[2], c3 * c[3]


@njit(cache=True, fastmath=True)
def _accumulate_span(key_cache, value_cache, value_scales, slots, n, known, weights,
                     acc):  # fmt: skip  # pragma: no cover
    """acc[h] += weights[h, t] * V scale * V[slots[t], h // group], t < n; prefetches the K
    rows of the next span's tokens (slots[n:known]) as it goes."""
    num_heads, head_dim = acc.shape
    num_kv_heads = value_cache.shape[1]
    group = num_heads // num_kv_heads
    last = known - 1
    t = 0
    while t + bf16.TOKENS <= n:
        j0, j1, j2, j3 = slots[t], slots[t + 1], slots[t + 2], slots[t + 3]
        # The next span's tokens t..t + 3 (while n + t < known): requests spread over the loop
        ahead = (slots[min(n + t, last)], slots[min(n + t + 1, last)],
                 slots[min(n + t + 2, last)], slots[min(n + t + 3, last)])  # fmt: skip
        for g in range(num_kv_heads):
            if n + t < known:
                bf16.prefetch_head(key_cache, ahead, g)
            v0, v1 = value_cache[j0, g], value_cache[j1, g]
            v2, v3 = value_cache[j2, g], value_cache[j3, g]
            f0, f1 = token_scale(value_scales, j0, g), token_scale(value_scales, j1, g)
            f2, f3 = token_scale(value_scales, j2, g), token_scale(value_scales, j3, g)
            for h in range(g * group, (g + 1) * group):
                a0, a1 = weights[h, t] * f0, weights[h, t + 1] * f1
                a2, a3 = weights[h, t + 2] * f2, weights[h, t + 3] * f3
                out = acc[h]
                for d in range(head_dim):
                    out[d] += (a0 * as_float32(v0[d]) + a1 * as_float32(v1[d])
                               + a2 * as_float32(v2[d]) + a3 * as_float32(v3[d]))  # fmt: skip
        t += bf16.TOKENS
    for rest in range(t, n):
        j = slots[rest]
        for h in range(num_heads):
            p = weights[h, rest] * token_scale(value_scales, j, h // group)
            for d in range(head_dim):
                acc[h, d] += p * as_float32(value_cache[j, h // group, d])
