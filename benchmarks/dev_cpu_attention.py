"""Development bench for the CPU decode kernel (llm.c `dev/` style): reference, numbered
kernel variants, validation and timing in one file. The winner moves into `pagedkv/ops/`.

    python benchmarks/dev_cpu_attention.py --batch 8 --context 4096 --block-size 16 32
    python benchmarks/dev_cpu_attention.py --threads 1 --variants 1 2 3 --serial --asm

Variants (all use the plan of `pagedkv.ops.cpu_plan` and differ only in the per-item
kernel; `--asm` counts their zmm/ymm FMAs, bfloat16 widenings and vectorized exps):
    0  grouped SDPA on contiguous K/V: the baseline (not paged)
    1  `pagedkv.ops.cpu_kernels` as shipped: scores four tokens per query-row load, one
       max/rescale per block, a vectorizable exp (no SVML: `math.exp` is a scalar libm
       call), eight weighted V rows per accumulator pass, bfloat16 rows widened once per
       (token, KV head) into an L1 scratch row, compiled for 512-bit vectors
    2  as 1, but bfloat16 widened inside the dot products (once per query head) and the
       default 256-bit vectors
    3  as 1, but two query heads per pass over each K/V row (register blocking), bfloat16
       widened inside the dot products (once per head pair)
The pre-rework kernel (scalar `expf` per score, Python error model) is in git history.

Measured 2026-11-29 22:30 UTC on the development machine (2-core Emerald Rapids VM shared
with other jobs, load average ~4; `--threads 1 --serial --rounds 40`, block 16; ratio = SDPA
time / variant time, medians of interleaved rounds):

    shape        v1 fp32  v2 fp32  v3 fp32 | v1 bf16  v2 bf16  v3 bf16
    1 x 512      0.91x    0.91x    0.87x   | 0.90x    0.83x    0.96x
    1 x 4096     1.30x    1.17x    1.27x   | 1.10x    0.98x    1.05x

Earlier quieter runs put the pre-rework kernel (scalar `expf`) at 0.77-0.88x fp32 and
0.70-0.85x bf16 on the same shapes, and showed 512-bit vectors worth 1.05-1.25x (v1 with
and without `prefer_512_bit_vectors`). Timings interleave the variants in one process
(rounds of one call each), so a busy machine slows them alike.
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

from pagedkv.ops import cpu, cpu_kernels
from pagedkv.ops.cpu_kernels import (
    JIT,
    _combine,
    _softmax_block,
    prefer_512_bit_vectors,
    to_f32,
)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128


# ---------------------------------------------------------------- variant 2: widen inline
@njit(inline="always", **JIT)
def _score_v2(kb, t0, t1, q, scale, group, scores):  # pragma: no cover
    num_kv_heads, head_dim = kb.shape[1], kb.shape[2]
    t = t0
    while t + 4 <= t1:
        for g in range(num_kv_heads):
            k0, k1, k2, k3 = kb[t, g], kb[t + 1, g], kb[t + 2, g], kb[t + 3, g]
            for h in range(g * group, (g + 1) * group):
                qrow = q[h]
                s0 = s1 = s2 = s3 = np.float32(0.0)
                for d in range(head_dim):
                    x = qrow[d]
                    s0 += x * to_f32(k0[d])
                    s1 += x * to_f32(k1[d])
                    s2 += x * to_f32(k2[d])
                    s3 += x * to_f32(k3[d])
                scores[h, t], scores[h, t + 1] = s0 * scale, s1 * scale
                scores[h, t + 2], scores[h, t + 3] = s2 * scale, s3 * scale
        t += 4
    for tail in range(t, t1):
        for g in range(num_kv_heads):
            k0 = kb[tail, g]
            for h in range(g * group, (g + 1) * group):
                qrow = q[h]
                s0 = np.float32(0.0)
                for d in range(head_dim):
                    s0 += qrow[d] * to_f32(k0[d])
                scores[h, tail] = s0 * scale


@njit(inline="always", **JIT)
def _accumulate_v2(vb, t0, t1, group, acc, weights):  # pragma: no cover
    num_kv_heads, head_dim = vb.shape[1], vb.shape[2]
    t = t0
    while t + 8 <= t1:
        for g in range(num_kv_heads):
            v0, v1, v2, v3 = vb[t, g], vb[t + 1, g], vb[t + 2, g], vb[t + 3, g]
            v4, v5, v6, v7 = vb[t + 4, g], vb[t + 5, g], vb[t + 6, g], vb[t + 7, g]
            for h in range(g * group, (g + 1) * group):
                a, w = acc[h], weights[h]
                p0, p1, p2, p3 = w[t], w[t + 1], w[t + 2], w[t + 3]
                p4, p5, p6, p7 = w[t + 4], w[t + 5], w[t + 6], w[t + 7]
                for d in range(head_dim):
                    a[d] += (
                        p0 * to_f32(v0[d]) + p1 * to_f32(v1[d]) + p2 * to_f32(v2[d])
                        + p3 * to_f32(v3[d])
                    ) + (
                        p4 * to_f32(v4[d]) + p5 * to_f32(v5[d]) + p6 * to_f32(v6[d])
                        + p7 * to_f32(v7[d])
                    )  # fmt: skip
        t += 8
    for tail in range(t, t1):
        for g in range(num_kv_heads):
            v0 = vb[tail, g]
            for h in range(g * group, (g + 1) * group):
                a, p0 = acc[h], weights[h, tail]
                for d in range(head_dim):
                    a[d] += p0 * to_f32(v0[d])


@njit(**JIT)
def _item_v2(item, query, key_cache, value_cache, block_tables, scale, out, part_acc, part_m,
             part_l):  # fmt: skip  # pragma: no cover
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size = key_cache.shape[1]
    group = num_heads // key_cache.shape[2]
    q, table = query[item[0]], block_tables[item[1]]
    m = np.full(num_heads, np.float32(-1.0e30), dtype=np.float32)
    lsum = np.zeros(num_heads, dtype=np.float32)
    acc = np.zeros((num_heads, head_dim), dtype=np.float32)
    scores = np.empty((num_heads, block_size), dtype=np.float32)
    scale32 = np.float32(scale)
    lo, hi = item[2], item[3]
    for bi in range(lo // block_size, (hi - 1) // block_size + 1):
        t0 = max(lo - bi * block_size, 0)
        t1 = min(hi - bi * block_size, block_size)
        kb, vb = key_cache[table[bi]], value_cache[table[bi]]
        _score_v2(kb, t0, t1, q, scale32, group, scores)
        _softmax_block(t0, t1, m, lsum, acc, scores)
        _accumulate_v2(vb, t0, t1, group, acc, scores)
    cpu_kernels._finish(item, acc, m, lsum, out, part_acc, part_m, part_l)


# ---------------------------------------------------------------- variant 3: 2 heads/pass
@njit(inline="always", **JIT)
def _score_v3(kb, t0, t1, q, scale, group, scores):  # pragma: no cover
    num_kv_heads, head_dim = kb.shape[1], kb.shape[2]
    t = t0
    while t + 4 <= t1:
        for g in range(num_kv_heads):
            k0, k1, k2, k3 = kb[t, g], kb[t + 1, g], kb[t + 2, g], kb[t + 3, g]
            h = g * group
            while h + 2 <= (g + 1) * group:
                qa, qb = q[h], q[h + 1]
                a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
                for d in range(head_dim):
                    x, y = qa[d], qb[d]
                    c0, c1, c2, c3 = to_f32(k0[d]), to_f32(k1[d]), to_f32(k2[d]), to_f32(k3[d])
                    a0 += x * c0
                    a1 += x * c1
                    a2 += x * c2
                    a3 += x * c3
                    b0 += y * c0
                    b1 += y * c1
                    b2 += y * c2
                    b3 += y * c3
                sa, sb = scores[h, t : t + 4], scores[h + 1, t : t + 4]
                sa[0], sa[1], sa[2], sa[3] = a0 * scale, a1 * scale, a2 * scale, a3 * scale
                sb[0], sb[1], sb[2], sb[3] = b0 * scale, b1 * scale, b2 * scale, b3 * scale
                h += 2
            if h < (g + 1) * group:
                qa = q[h]
                a0 = a1 = a2 = a3 = np.float32(0.0)
                for d in range(head_dim):
                    x = qa[d]
                    a0 += x * to_f32(k0[d])
                    a1 += x * to_f32(k1[d])
                    a2 += x * to_f32(k2[d])
                    a3 += x * to_f32(k3[d])
                sa = scores[h, t : t + 4]
                sa[0], sa[1], sa[2], sa[3] = a0 * scale, a1 * scale, a2 * scale, a3 * scale
        t += 4
    for tail in range(t, t1):
        for g in range(num_kv_heads):
            k0 = kb[tail, g]
            for h in range(g * group, (g + 1) * group):
                qrow = q[h]
                s0 = np.float32(0.0)
                for d in range(head_dim):
                    s0 += qrow[d] * to_f32(k0[d])
                scores[h, tail] = s0 * scale


@njit(inline="always", **JIT)
def _accumulate_v3(vb, t0, t1, group, acc, weights):  # pragma: no cover
    num_kv_heads, head_dim = vb.shape[1], vb.shape[2]
    t = t0
    while t + 4 <= t1:
        for g in range(num_kv_heads):
            v0, v1, v2, v3 = vb[t, g], vb[t + 1, g], vb[t + 2, g], vb[t + 3, g]
            h = g * group
            while h + 2 <= (g + 1) * group:
                a, b = acc[h], acc[h + 1]
                wa, wb = weights[h, t : t + 4], weights[h + 1, t : t + 4]
                p0, p1, p2, p3 = wa[0], wa[1], wa[2], wa[3]
                r0, r1, r2, r3 = wb[0], wb[1], wb[2], wb[3]
                for d in range(head_dim):
                    c0, c1, c2, c3 = to_f32(v0[d]), to_f32(v1[d]), to_f32(v2[d]), to_f32(v3[d])
                    a[d] += (p0 * c0 + p1 * c1) + (p2 * c2 + p3 * c3)
                    b[d] += (r0 * c0 + r1 * c1) + (r2 * c2 + r3 * c3)
                h += 2
            if h < (g + 1) * group:
                a, wa = acc[h], weights[h, t : t + 4]
                p0, p1, p2, p3 = wa[0], wa[1], wa[2], wa[3]
                for d in range(head_dim):
                    a[d] += (p0 * to_f32(v0[d]) + p1 * to_f32(v1[d])) + (
                        p2 * to_f32(v2[d]) + p3 * to_f32(v3[d])
                    )
        t += 4
    for tail in range(t, t1):
        for g in range(num_kv_heads):
            v0 = vb[tail, g]
            for h in range(g * group, (g + 1) * group):
                a, p0 = acc[h], weights[h, tail]
                for d in range(head_dim):
                    a[d] += p0 * to_f32(v0[d])


@njit(**JIT)
def _item_v3(item, query, key_cache, value_cache, block_tables, scale, out, part_acc, part_m,
             part_l):  # fmt: skip  # pragma: no cover
    prefer_512_bit_vectors()
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size = key_cache.shape[1]
    group = num_heads // key_cache.shape[2]
    q, table = query[item[0]], block_tables[item[1]]
    m = np.full(num_heads, np.float32(-1.0e30), dtype=np.float32)
    lsum = np.zeros(num_heads, dtype=np.float32)
    acc = np.zeros((num_heads, head_dim), dtype=np.float32)
    scores = np.empty((num_heads, block_size), dtype=np.float32)
    scale32 = np.float32(scale)
    lo, hi = item[2], item[3]
    for bi in range(lo // block_size, (hi - 1) // block_size + 1):
        t0 = max(lo - bi * block_size, 0)
        t1 = min(hi - bi * block_size, block_size)
        kb, vb = key_cache[table[bi]], value_cache[table[bi]]
        _score_v3(kb, t0, t1, q, scale32, group, scores)
        _softmax_block(t0, t1, m, lsum, acc, scores)
        _accumulate_v3(vb, t0, t1, group, acc, scores)
    cpu_kernels._finish(item, acc, m, lsum, out, part_acc, part_m, part_l)


# ---------------------------------------------------------------- drivers
@njit(parallel=True, **JIT)
def drive_parallel(item_fn, query, key_cache, value_cache, block_tables, items, splits, scale,
                   out, part_acc, part_m, part_l):  # fmt: skip  # pragma: no cover
    for i in prange(items.shape[0]):
        item_fn(items[i], query, key_cache, value_cache, block_tables, scale, out, part_acc,
                part_m, part_l)  # fmt: skip
    _combine(splits, out, part_acc, part_m, part_l)


@njit(**JIT)
def drive_serial(item_fn, query, key_cache, value_cache, block_tables, items, splits, scale,
                 out, part_acc, part_m, part_l):  # fmt: skip  # pragma: no cover
    for i in range(items.shape[0]):
        item_fn(items[i], query, key_cache, value_cache, block_tables, scale, out, part_acc,
                part_m, part_l)  # fmt: skip
    _combine(splits, out, part_acc, part_m, part_l)


ITEMS = {1: cpu_kernels._item, 2: _item_v2, 3: _item_v3}


def build(batch, context, block_size, dtype, gen):
    """Query, contiguous K/V [B, Hkv, L, D], the paged copy and the plan's index tensors."""
    k, v, key_cache, value_cache, tables = make_paged(batch, context, block_size, dtype, "cpu", gen)
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    starts = torch.arange(batch + 1, dtype=torch.int32)
    return query, k, v, key_cache, value_cache, tables, seq_lens, starts


def run_variant(item_fn, is_serial, query, key_cache, value_cache, plan, scale):
    """A no-argument callable running one variant on preallocated buffers; returns out."""
    q = query.float().numpy()
    out = np.empty((plan.rows.shape[0], NUM_HEADS, HEAD_DIM), dtype=np.float32)
    part_acc = np.empty((plan.num_parts, NUM_HEADS, HEAD_DIM), dtype=np.float32)
    part_m = np.empty((plan.num_parts, NUM_HEADS), dtype=np.float32)
    part_l = np.empty((plan.num_parts, NUM_HEADS), dtype=np.float32)
    kc, vc = cpu._cached_view(key_cache, "numba"), cpu._cached_view(value_cache, "numba")
    drive = drive_serial if is_serial else drive_parallel

    def call():
        drive(item_fn, q, kc, vc, plan.block_tables, plan.items, plan.splits, scale, out,
              part_acc, part_m, part_l)  # fmt: skip
        return out

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
    plan = cpu._make_plan(batch, tables, lens, starts, kc, None)
    q4 = query.view(batch, NUM_KV_HEADS, -1, HEAD_DIM)  # (B, Hkv, group, D)
    ref = F.scaled_dot_product_attention(q4.float(), k.float(), v.float())
    ref = ref.reshape(batch, NUM_HEADS, HEAD_DIM).numpy()
    calls = {0: lambda: F.scaled_dot_product_attention(q4, k, v)}
    for n in args.variants:
        calls[n] = run_variant(ITEMS[n], args.serial, query, kc, vc, plan, HEAD_DIM**-0.5)
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
    p.add_argument("--variants", type=int, nargs="+", default=[1, 2, 3])
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
