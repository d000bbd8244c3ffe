"""Numba kernels of the CPU backend: paged decode attention that walks blocks in place.

Work is cut into items: one item is one query row over one range of key positions
``[lo, hi)``. Long rows are split into several items so that a single long sequence still
uses every core (flash-decoding); the partial softmax states of a split row are merged at
the end, after the parallel loop. A row with one item writes its output directly.

Each item walks its blocks through the block table::

    positions  lo                                  hi
               |--------|--------|--------|--------|
    blocks     bt[lo//bs]  ...               bt[(hi-1)//bs]   (each read contiguously)

and keeps, per query head, an online softmax state (running max m, sum l, weighted sum acc).
For a block it scores all its tokens first, raises the max once, rescales, then accumulates,
reading each K/V row once for all query heads of its group. The running max starts at a
large negative finite value, never -inf: under `fastmath` the compiler may assume no
infinities, and exp(-inf - -inf) would be undefined.

Item table (int64 [num_items, 6]) columns: query row, sequence, lo, hi, output row, partial
slot (-1: single item, written to the output row). Split table (int64 [num_split, 3]):
output row, first partial slot, end partial slot.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import njit, prange

_NEG = -1.0e30
ITEM_QROW, ITEM_SEQ, ITEM_LO, ITEM_HI, ITEM_OUT, ITEM_PART = range(6)


@njit(cache=True, fastmath=True, inline="always")
def _update_block(kb, vb, t0, t1, q, scale, group, m, lsum, acc, scores):  # pragma: no cover
    """Fold tokens [t0, t1) of one block (float32 [bs, kv_heads, D] views) into the state."""
    num_kv_heads = kb.shape[1]
    head_dim = kb.shape[2]
    for g in range(num_kv_heads):
        h0 = g * group
        for t in range(t0, t1):
            krow = kb[t, g]
            for j in range(group):
                qrow = q[h0 + j]
                s = np.float32(0.0)
                for d in range(head_dim):
                    s += qrow[d] * krow[d]
                scores[h0 + j, t] = s * scale
        for j in range(group):
            h = h0 + j
            new_max = m[h]
            for t in range(t0, t1):
                new_max = max(new_max, scores[h, t])
            alpha = math.exp(m[h] - new_max)
            m[h] = new_max
            lsum[h] *= alpha
            for d in range(head_dim):
                acc[h, d] *= alpha
            for t in range(t0, t1):
                scores[h, t] = math.exp(scores[h, t] - new_max)
                lsum[h] += scores[h, t]
        for t in range(t0, t1):
            vrow = vb[t, g]
            for j in range(group):
                a = acc[h0 + j]
                p = scores[h0 + j, t]
                for d in range(head_dim):
                    a[d] += p * vrow[d]


@njit(cache=True, fastmath=True, inline="always")
def _widen_bf16(src, dst_bits):  # pragma: no cover
    """bfloat16 bits (uint16, flat) -> float32 bits (uint32, flat): the high half of a float32."""
    for i in range(src.shape[0]):
        dst_bits[i] = np.uint32(src[i]) << 16


@njit(cache=True, fastmath=True)
def _finish(item, acc, m, lsum, out, part_acc, part_m, part_l):  # pragma: no cover
    part = item[ITEM_PART]
    if part < 0:
        row = out[item[ITEM_OUT]]
        for h in range(acc.shape[0]):
            inv = np.float32(1.0) / lsum[h]
            for d in range(acc.shape[1]):
                row[h, d] = acc[h, d] * inv
    else:
        part_acc[part] = acc
        part_m[part] = m
        part_l[part] = lsum


@njit(cache=True, fastmath=True)
def _item_f32(
    item, query, key_cache, value_cache, block_tables, scale, out, part_acc, part_m, part_l
):  # pragma: no cover
    """One item over float32 caches [num_blocks, bs, kv_heads, D]."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size = key_cache.shape[1]
    group = num_heads // key_cache.shape[2]
    q = query[item[ITEM_QROW]]
    table = block_tables[item[ITEM_SEQ]]
    m = np.full(num_heads, np.float32(_NEG), dtype=np.float32)
    lsum = np.zeros(num_heads, dtype=np.float32)
    acc = np.zeros((num_heads, head_dim), dtype=np.float32)
    scores = np.empty((num_heads, block_size), dtype=np.float32)
    lo, hi = item[ITEM_LO], item[ITEM_HI]
    for bi in range(lo // block_size, (hi - 1) // block_size + 1):
        block = table[bi]
        t0 = max(lo - bi * block_size, 0)
        t1 = min(hi - bi * block_size, block_size)
        _update_block(
            key_cache[block],
            value_cache[block],
            t0,
            t1,
            q,
            np.float32(scale),
            group,
            m,
            lsum,
            acc,
            scores,
        )
    _finish(item, acc, m, lsum, out, part_acc, part_m, part_l)


@njit(cache=True, fastmath=True)
def _item_bf16(
    item, query, key_cache, value_cache, block_tables, scale, out, part_acc, part_m, part_l
):  # pragma: no cover
    """As `_item_f32` for bfloat16 caches passed as uint16; each block is widened once."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    numel = block_size * num_kv_heads * head_dim
    q = query[item[ITEM_QROW]]
    table = block_tables[item[ITEM_SEQ]]
    m = np.full(num_heads, np.float32(_NEG), dtype=np.float32)
    lsum = np.zeros(num_heads, dtype=np.float32)
    acc = np.zeros((num_heads, head_dim), dtype=np.float32)
    scores = np.empty((num_heads, block_size), dtype=np.float32)
    k_bits = np.empty(numel, dtype=np.uint32)
    v_bits = np.empty(numel, dtype=np.uint32)
    kb = k_bits.view(np.float32).reshape((block_size, num_kv_heads, head_dim))
    vb = v_bits.view(np.float32).reshape((block_size, num_kv_heads, head_dim))
    lo, hi = item[ITEM_LO], item[ITEM_HI]
    for bi in range(lo // block_size, (hi - 1) // block_size + 1):
        block = table[bi]
        t0 = max(lo - bi * block_size, 0)
        t1 = min(hi - bi * block_size, block_size)
        # Widen the rows [t0, t1) only: a window's first block may be mostly unused.
        _widen_bf16(key_cache[block, t0:t1].reshape(-1), k_bits[t0 * num_kv_heads * head_dim :])
        _widen_bf16(value_cache[block, t0:t1].reshape(-1), v_bits[t0 * num_kv_heads * head_dim :])
        _update_block(kb, vb, t0, t1, q, np.float32(scale), group, m, lsum, acc, scores)
    _finish(item, acc, m, lsum, out, part_acc, part_m, part_l)


@njit(cache=True, fastmath=True)
def _combine(splits, out, part_acc, part_m, part_l):  # pragma: no cover
    """Merge each split row's partial states into its output row: sum(acc_i w_i) / sum(l_i w_i)."""
    num_heads, head_dim = out.shape[1], out.shape[2]
    for k in range(splits.shape[0]):
        row, p0, p1 = out[splits[k, 0]], splits[k, 1], splits[k, 2]
        for h in range(num_heads):
            top = part_m[p0, h]
            for p in range(p0 + 1, p1):
                top = max(top, part_m[p, h])
            total = np.float32(0.0)
            row[h] = 0.0
            for p in range(p0, p1):
                w = math.exp(part_m[p, h] - top)
                total += part_l[p, h] * w
                for d in range(head_dim):
                    row[h, d] += part_acc[p, h, d] * w
            for d in range(head_dim):
                row[h, d] /= total


# Four drivers: {float32, bfloat16} x {parallel, serial}. Small batches run serially because
# starting a parallel region costs more than the work (and far more on a busy machine).
@njit(cache=True, fastmath=True, parallel=True)
def decode_f32_parallel(
    query, key_cache, value_cache, block_tables, items, splits, scale, out, part_acc, part_m, part_l
):  # pragma: no cover
    """Run every item across threads, then merge split rows; out: float32 [num_rows, H, D]."""
    for i in prange(items.shape[0]):
        _item_f32(
            items[i],
            query,
            key_cache,
            value_cache,
            block_tables,
            scale,
            out,
            part_acc,
            part_m,
            part_l,
        )
    _combine(splits, out, part_acc, part_m, part_l)


@njit(cache=True, fastmath=True)
def decode_f32_serial(
    query, key_cache, value_cache, block_tables, items, splits, scale, out, part_acc, part_m, part_l
):  # pragma: no cover
    """As `decode_f32_parallel`, on the calling thread."""
    for i in range(items.shape[0]):
        _item_f32(
            items[i],
            query,
            key_cache,
            value_cache,
            block_tables,
            scale,
            out,
            part_acc,
            part_m,
            part_l,
        )
    _combine(splits, out, part_acc, part_m, part_l)


@njit(cache=True, fastmath=True, parallel=True)
def decode_bf16_parallel(
    query, key_cache, value_cache, block_tables, items, splits, scale, out, part_acc, part_m, part_l
):  # pragma: no cover
    """As `decode_f32_parallel` for bfloat16 caches (uint16 views)."""
    for i in prange(items.shape[0]):
        _item_bf16(
            items[i],
            query,
            key_cache,
            value_cache,
            block_tables,
            scale,
            out,
            part_acc,
            part_m,
            part_l,
        )
    _combine(splits, out, part_acc, part_m, part_l)


@njit(cache=True, fastmath=True)
def decode_bf16_serial(
    query, key_cache, value_cache, block_tables, items, splits, scale, out, part_acc, part_m, part_l
):  # pragma: no cover
    """As `decode_bf16_parallel`, on the calling thread."""
    for i in range(items.shape[0]):
        _item_bf16(
            items[i],
            query,
            key_cache,
            value_cache,
            block_tables,
            scale,
            out,
            part_acc,
            part_m,
            part_l,
        )
    _combine(splits, out, part_acc, part_m, part_l)


@njit(cache=True)
def write_rows(key, value, key_cache, value_cache, slot_mapping):  # pragma: no cover
    """Copy row t of key/value to row slot_mapping[t] of the caches; skip negative slots.

    All arrays are raw-bit views ([num_tokens | num_slots, kv_heads * D] of a same-width
    integer type), so one compiled kernel serves every float dtype.

    Returns:
        -1, or the first token whose slot is past the end (nothing was written for it).
    """
    num_slots = key_cache.shape[0]
    for t in range(slot_mapping.shape[0]):
        slot = slot_mapping[t]
        if slot < 0:
            continue
        if slot >= num_slots:
            return t
        key_cache[slot] = key[t]
        value_cache[slot] = value[t]
    return -1


def num_threads() -> int:
    """Threads the parallel kernels use (numba's setting)."""
    return numba.get_num_threads()
