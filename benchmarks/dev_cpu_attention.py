"""Development bench for the CPU decode kernel (llm.c `dev/` style): reference, numbered
kernel variants, validation and timing in one file. The winner moves into `pagedkv/ops/`.

    python benchmarks/dev_cpu_attention.py --batch 1 8 --context 512 4096 --block-size 16 32
    python benchmarks/dev_cpu_attention.py --threads 1 --serial --asm

Variants (all use the plan of `pagedkv.ops.cpu_plan`; `--asm` counts zmm/ymm FMAs,
bfloat16 widenings, vectorized rounding (the exp) and libm `expf` calls):
    0  grouped SDPA on contiguous K/V: the baseline (not paged)
    1  `pagedkv.ops.cpu_kernels` as shipped: explicit 16-lane vectors (`pagedkv.ops.simd`),
       scores as tiles of 4 tokens x 4 query heads of one KV head reduced by one
       transposing tree, the V accumulation over the same tiles with their 16 weights in
       registers, both in memory order over flat cache views (group 1: tiles of 4 tokens x
       1 head), software prefetch as `cpu_kernels.prefetch_mode` picks
    2  the previous kernel (below, kept for the A/B): plain loops that LLVM vectorizes,
       four tokens per query-row load when scoring, eight weighted V rows per accumulator
       pass, bfloat16 rows widened once per (token, KV head) into an L1 scratch row
Older variants (bfloat16 widened inside the dot products, two heads per pass) are in git
history (before 2026-11-30).

Why variant 1 (2026-11-30, development machine). Per token of 32/8 heads x 128 (one
thread, block 16, K/V in L2), variant 2 spent ~175 ns scoring, ~40 ns in the softmax and
~105-180 ns accumulating, against ~50 ns each for scores and accumulation at the FMA rate:
the loop vectorizer wraps every 128-long dot product in alias checks and a remainder loop,
keeps one dependent FMA chain per head and reduces each score horizontally on its own.
Variant 1 takes 70 + 20 + 78 ns (176 ns per token in all). Its first version spent 105 ns
per token in the softmax at block 16 (19 at block 128): the per-head helper it called took
array arguments, and Numba's reference counting of them (atomic NRT_incref/decref calls in
the loop, visible with `inspect_asm`) cost more than a 16-token block's arithmetic; the
softmax is now one loop body per head in 16-lane vectors. Other layouts
measured: visiting a block KV head by KV head (4 KiB strides) instead of in memory order lost
10 % at DRAM-bound shapes; tiles whose four heads span KV heads (each head loading its own
rows) ran 0.6-0.75x of variant 2 at groups 1, 2, 3 and 7, so groups that are not a
multiple of 4 complete their last tile with a sink row instead; software prefetch of the
whole next block at each block start cost float32 5-30 % (a burst of prefetches fills the
fill buffers), while prefetching one tile ahead, spread over the score loop, is shipped
(bfloat16 always, float32 past 64 MB per call: docs/benchmarks.md, run I). The V
accumulation first kept four heads' accumulators in registers over 8 tokens, reloading
each weight per 16-lane slice (load-port bound); it now walks the score tiles with their
16 weights in registers (1.04-1.22x, run I). Without GQA (group 1, 32/32 heads) nothing is
shared and variant 1 is no faster in float32 (0.86x of variant 2 at 32 x 400 tokens,
DRAM-bound; 0.96x at 8 x 400), 1.1-1.25x in bfloat16.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import numba
import numpy as np
import torch
import torch.nn.functional as F
from bench_attention import make_paged  # benchmarks/ (script dir)
from numba import njit, prange
from numba.core import types
from numba.extending import overload

from pagedkv.ops import cpu, cpu_kernels
from pagedkv.ops.cpu_kernels import (
    _NEG,
    ITEM_HI,
    ITEM_LO,
    ITEM_OUT,
    ITEM_PART,
    ITEM_QROW,
    ITEM_SEQ,
    JIT,
    _combine,
    _f32_from_bits,
    exp_neg,
    prefer_512_bit_vectors,
)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128


# ---------------------------------------------------------------- variant 2: the previous kernel
def to_f32(x):  # pragma: no cover
    """A cache element as float32: float32 as is, bfloat16 bits (uint16) widened."""
    raise NotImplementedError("only callable from Numba-compiled code")


@overload(to_f32, inline="always")
def _to_f32(x):  # pragma: no cover
    if x == types.uint16:
        # bfloat16 is the high half of a float32: shift the bits up, then reinterpret.
        return lambda x: _f32_from_bits(np.uint32(np.uint32(x) << 16))
    if x == types.float32:
        return lambda x: x
    return None


def load_row(block, t, g, scratch, i):  # pragma: no cover
    """Row (t, g) of a block as float32 [D]: a view for float32, else widened into scratch[i]."""
    raise NotImplementedError("only callable from Numba-compiled code")


@overload(load_row, inline="always")
def _load_row(block, t, g, scratch, i):  # pragma: no cover
    if block.dtype == types.float32:
        return lambda block, t, g, scratch, i: block[t, g]

    def widen(block, t, g, scratch, i):
        # Widen once into an L1-resident row that every query head of the group then reads:
        # widening in the dot products instead repeats it per head (measured 10-15 % slower).
        src, dst = block[t, g], scratch[i]
        for d in range(src.shape[0]):
            dst[d] = to_f32(src[d])
        return dst

    return widen


@njit(inline="always", **JIT)
def _score_block(kb, t0, t1, q, scale, group, scores, rows):  # pragma: no cover
    """scores[h, t] = scale * q[h] . k[t, h // group] for rows [t0, t1) of one block.

    Rows are visited in memory order (token, then KV head) and four tokens at a time, so
    each query row loaded feeds four dot products.
    """
    num_kv_heads, head_dim = kb.shape[1], kb.shape[2]
    t = t0
    while t + 4 <= t1:
        for g in range(num_kv_heads):
            k0, k1 = load_row(kb, t, g, rows, 0), load_row(kb, t + 1, g, rows, 1)
            k2, k3 = load_row(kb, t + 2, g, rows, 2), load_row(kb, t + 3, g, rows, 3)
            for h in range(g * group, (g + 1) * group):
                qrow = q[h]
                s0 = s1 = s2 = s3 = np.float32(0.0)
                for d in range(head_dim):
                    x = qrow[d]
                    s0 += x * k0[d]
                    s1 += x * k1[d]
                    s2 += x * k2[d]
                    s3 += x * k3[d]
                scores[h, t], scores[h, t + 1] = s0 * scale, s1 * scale
                scores[h, t + 2], scores[h, t + 3] = s2 * scale, s3 * scale
        t += 4
    for tail in range(t, t1):
        for g in range(num_kv_heads):
            k0 = load_row(kb, tail, g, rows, 0)
            for h in range(g * group, (g + 1) * group):
                qrow = q[h]
                s0 = np.float32(0.0)
                for d in range(head_dim):
                    s0 += qrow[d] * k0[d]
                scores[h, tail] = s0 * scale


@njit(inline="always", **JIT)
def _softmax_block(t0, t1, m, lsum, acc, scores):  # pragma: no cover
    for h in range(m.shape[0]):
        row = scores[h, t0:t1]
        new_max = m[h]
        for t in range(row.shape[0]):
            new_max = max(new_max, row[t])
        if new_max > m[h]:
            alpha = exp_neg(m[h] - new_max)
            m[h] = new_max
            lsum[h] *= alpha
            a = acc[h]
            for d in range(a.shape[0]):
                a[d] *= alpha
        total = np.float32(0.0)
        for t in range(row.shape[0]):
            w = exp_neg(row[t] - new_max)
            row[t] = w
            total += w
        lsum[h] += total


@njit(inline="always", **JIT)
def _accumulate_block(vb, t0, t1, group, acc, weights, rows):  # pragma: no cover
    """acc[h] += sum_t weights[h, t] * v[t, h // group], eight tokens per pass over acc.

    Summing eight weighted V rows before touching acc cuts its loads and stores (the cost
    that dominated a one-token-at-a-time loop) by eight.
    """
    num_kv_heads, head_dim = vb.shape[1], vb.shape[2]
    t = t0
    while t + 8 <= t1:
        for g in range(num_kv_heads):
            v0, v1 = load_row(vb, t, g, rows, 0), load_row(vb, t + 1, g, rows, 1)
            v2, v3 = load_row(vb, t + 2, g, rows, 2), load_row(vb, t + 3, g, rows, 3)
            v4, v5 = load_row(vb, t + 4, g, rows, 4), load_row(vb, t + 5, g, rows, 5)
            v6, v7 = load_row(vb, t + 6, g, rows, 6), load_row(vb, t + 7, g, rows, 7)
            for h in range(g * group, (g + 1) * group):
                a, w = acc[h], weights[h]
                p0, p1, p2, p3 = w[t], w[t + 1], w[t + 2], w[t + 3]
                p4, p5, p6, p7 = w[t + 4], w[t + 5], w[t + 6], w[t + 7]
                for d in range(head_dim):
                    a[d] += (p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d]) + (
                        p4 * v4[d] + p5 * v5[d] + p6 * v6[d] + p7 * v7[d]
                    )
        t += 8
    for tail in range(t, t1):
        for g in range(num_kv_heads):
            v0 = load_row(vb, tail, g, rows, 0)
            for h in range(g * group, (g + 1) * group):
                a, p0 = acc[h], weights[h, tail]
                for d in range(head_dim):
                    a[d] += p0 * v0[d]


@njit(**JIT)
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


@njit(**JIT)
def _item_v2(
    item, query, key_cache, value_cache, block_tables, scale, out, part_acc, part_m, part_l
):  # pragma: no cover
    """One item over caches [num_blocks, bs, kv_heads, D], float32 or bfloat16 bits (uint16)."""
    prefer_512_bit_vectors()
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size = key_cache.shape[1]
    group = num_heads // key_cache.shape[2]
    q = query[item[ITEM_QROW]]
    table = block_tables[item[ITEM_SEQ]]
    m = np.full(num_heads, np.float32(_NEG), dtype=np.float32)
    lsum = np.zeros(num_heads, dtype=np.float32)
    acc = np.zeros((num_heads, head_dim), dtype=np.float32)
    scores = np.empty((num_heads, block_size), dtype=np.float32)
    scale32 = np.float32(scale)
    rows = np.empty((8, head_dim), dtype=np.float32)  # widened bfloat16 rows
    lo, hi = item[ITEM_LO], item[ITEM_HI]
    for bi in range(lo // block_size, (hi - 1) // block_size + 1):
        block = table[bi]
        t0 = max(lo - bi * block_size, 0)
        t1 = min(hi - bi * block_size, block_size)
        kb, vb = key_cache[block], value_cache[block]
        _score_block(kb, t0, t1, q, scale32, group, scores, rows)
        _softmax_block(t0, t1, m, lsum, acc, scores)
        _accumulate_block(vb, t0, t1, group, acc, scores, rows)
    _finish(item, acc, m, lsum, out, part_acc, part_m, part_l)


@njit(parallel=True, **JIT)
def drive_parallel_v2(query, key_cache, value_cache, block_tables, items, splits, scale, out,
                      part_acc, part_m, part_l):  # fmt: skip  # pragma: no cover
    for i in prange(items.shape[0]):
        _item_v2(items[i], query, key_cache, value_cache, block_tables, scale, out, part_acc,
                 part_m, part_l)  # fmt: skip
    _combine(splits, out, part_acc, part_m, part_l)


@njit(**JIT)
def drive_serial_v2(query, key_cache, value_cache, block_tables, items, splits, scale, out,
                    part_acc, part_m, part_l):  # fmt: skip  # pragma: no cover
    for i in range(items.shape[0]):
        _item_v2(items[i], query, key_cache, value_cache, block_tables, scale, out, part_acc,
                 part_m, part_l)  # fmt: skip
    _combine(splits, out, part_acc, part_m, part_l)


def _cache_args(variant: int, key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple:
    """The cache arguments each variant's driver takes after the query."""
    caches = cpu._flat_views(key_cache, value_cache)
    # 4-D views
    return caches.key.reshape(key_cache.shape), caches.value.reshape(value_cache.shape)


DRIVERS = {2: (drive_serial_v2, drive_parallel_v2)}  # variant 1 calls cpu_kernels.decode
ITEMS = {1: cpu_kernels._item, 2: _item_v2}


def build(batch, context, block_size, dtype, gen):
    """Query, contiguous K/V [B, Hkv, L, D], the paged copy and the plan's index tensors."""
    k, v, key_cache, value_cache, tables = make_paged(batch, context, block_size, dtype, "cpu", gen)
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    starts = torch.arange(batch + 1, dtype=torch.int32)
    return query, k, v, key_cache, value_cache, tables, seq_lens, starts


def run_variant(variant, is_serial, query, key_cache, value_cache, plan, scale):
    """A no-argument callable running one variant on preallocated buffers; returns out."""
    q = query.float()
    num_parts = int(plan.splits[-1, 2]) if plan.splits.shape[0] else 0
    out = torch.empty(plan.rows.shape[0], NUM_HEADS, HEAD_DIM)
    num_workers = 1 if is_serial else plan.num_workers
    if variant == 1:  # the shipped kernel, with the plan's prefetch mode
        caches = cpu._flat_views(key_cache, value_cache)

        def call():
            cpu_kernels.decode(q.data_ptr(), q.shape[0], NUM_HEADS, HEAD_DIM, caches.key,
                               caches.value, caches.block_size, caches.num_kv_heads,
                               plan.block_tables, plan.items, plan.splits, scale,
                               out.data_ptr(), out.shape[0], num_workers,
                               plan.prefetch)  # fmt: skip
            return out.numpy()

        return call
    part_acc = np.empty((num_parts, NUM_HEADS, HEAD_DIM), dtype=np.float32)
    part_m = np.empty((num_parts, NUM_HEADS), dtype=np.float32)
    part_l = np.empty((num_parts, NUM_HEADS), dtype=np.float32)
    caches = _cache_args(variant, key_cache, value_cache)
    drive = DRIVERS[variant][0 if is_serial else 1]

    def call():
        drive(q.numpy(), *caches, plan.block_tables, plan.items, plan.splits, scale, out.numpy(),
              part_acc, part_m, part_l)  # fmt: skip
        return out.numpy()

    return call


def vector_profile(fn) -> dict[str, int]:
    """Instruction counts in a compiled kernel (needs a fresh NUMBA_CACHE_DIR: no cached code)."""
    counts: dict[str, int] = {}
    patterns = (
        "vfmadd\\S*ps\\s.*zmm",
        "vfmadd\\S*ps\\s.*ymm",
        "vpmovzxwd",
        "vrndscaleps|vroundps",
        "expf",
    )
    for asm in fn.inspect_asm().values():
        for pat in patterns:
            counts[pat] = counts.get(pat, 0) + len(re.findall(pat, asm))
    return counts


def bench_shape(args, batch, context, block_size, dtype, gen) -> str:
    """Validate every variant against float32 SDPA, then time them interleaved."""
    query, k, v, kc, vc, tables, lens, starts = build(batch, context, block_size, dtype, gen)
    plan = cpu._make_plan(batch, tables, lens, starts, kc, vc, None)
    q4 = query.view(batch, NUM_KV_HEADS, -1, HEAD_DIM)  # (B, Hkv, group, D)
    ref = F.scaled_dot_product_attention(q4.float(), k.float(), v.float())
    ref = ref.reshape(batch, NUM_HEADS, HEAD_DIM).numpy()
    calls = {0: lambda: F.scaled_dot_product_attention(q4, k, v)}
    for n in args.variants:
        calls[n] = run_variant(n, args.serial, query, kc, vc, plan, HEAD_DIM**-0.5)
        err = float(np.abs(calls[n]() - ref).max())
        if err > (1e-4 if dtype == torch.float32 else 2e-2):
            raise AssertionError(f"variant {n}: expected max abs error < tolerance, got {err}")
    times: dict[int, list[float]] = {n: [] for n in calls}
    for _ in range(args.rounds):
        for n, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[n].append(time.perf_counter() - t0)
    med = {n: statistics.median(t) for n, t in times.items()}
    gb = 2 * k.numel() * k.element_size() / 1e9
    cells = " ".join(
        f"v{n} {med[n] * 1e3:7.2f}ms {med[0] / med[n]:5.2f}x {gb / med[n]:5.1f}GB/s" for n in calls
    )
    return f"{str(dtype)[6:]:8s} B={batch:2d} L={context:5d} bs={block_size:3d} | {cells}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[8])
    p.add_argument("--context", type=int, nargs="+", default=[4096])
    p.add_argument("--block-size", type=int, nargs="+", default=[16])
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=2, help="torch and numba threads")
    p.add_argument("--variants", type=int, nargs="+", default=[1, 2])
    p.add_argument("--serial", action="store_true", help="run items on the calling thread")
    p.add_argument("--asm", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    numba.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    for dtype_name in args.dtype:
        for batch in args.batch:
            for context in args.context:
                for bs in args.block_size:
                    row = bench_shape(args, batch, context, bs, getattr(torch, dtype_name), gen)
                    print(row, flush=True)
    if args.asm:
        for n in args.variants:
            print(f"variant {n}:", vector_profile(ITEMS[n]))


if __name__ == "__main__":
    main()
