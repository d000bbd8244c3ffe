"""Tune the Triton decode kernel on a GPU in one run; locate the per-call fixed cost.

Sweeps `decode_attention`'s launch configuration (keys per tile, warps, pipeline stages,
partitions) on bf16, GQA 32/8, head_dim 128, block 16, coarse first and then around the
best, and times each config with CUDA events (median, L2 flushed before each call) against
SDPA on the same KV held contiguously. Every output is checked against
`pagedkv.ops.reference`; a wrong config is reported, never ranked. Alongside, in the llm.c
way: variant ``v2`` (block ids prefetched one tile ahead, so the K/V loads are no longer
indirect within an iteration and Triton's pipeliner can double-buffer them), a streaming
probe that only reads K/V through the block table (the access pattern's own ceiling), and
the host-side cost of one call split into Python, Triton's launcher and any host sync.

    python benchmarks/tune_triton.py                     # GPU: < 4 minutes on an H200
    TRITON_INTERPRET=1 python benchmarks/tune_triton.py --smoke   # CPU: checks the script

Writes ``$OUT/tune_triton.json`` when OUT is set, else ``benchmarks/results/``.
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv and "triton" not in sys.modules:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

import argparse
import cProfile
import functools
import io
import pstats
import re
import statistics
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from _common import print_table, write_results  # benchmarks/ (script dir)
from bench_attention import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, make_paged, read_bandwidth

import pagedkv.ops as ops
import pagedkv.ops.triton as tops
from pagedkv.ops import reference
from pagedkv.ops.triton import decode
from pagedkv.ops.triton.attend import NEG_FLOOR
from pagedkv.ops.triton.indexing import scale_args

TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}  # max err / max |ref|
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# ---------------------------------------------------------------- variant v2 and the probe
@triton.jit
def _decode_v2_kernel(
    query,
    key_cache,
    value_cache,
    block_tables,
    seq_lens,
    out,
    part_max,
    part_sum,
    part_acc,
    scale_log2,
    partition_size,
    max_parts,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_BLOCKS: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    STREAM_ONLY: tl.constexpr,
):
    """Decode rows (row s = sequence s), no window; power-of-two block_size and head_dim.

    The next tile's block ids are loaded while this tile is consumed and carried in
    registers, so the K/V addresses do not hang off a load of the same iteration.
    STREAM_ONLY: read K/V the same way and only sum them (the access pattern's ceiling).
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    TILE: tl.constexpr = TILE_BLOCKS * BLOCK_SIZE
    seq_len = tl.load(seq_lens + seq)
    start = part * partition_size  # block-aligned: partition_size is a multiple of TILE
    end = tl.minimum(start + partition_size, seq_len)
    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    dims = tl.arange(0, HEAD_DIM)
    row = seq.to(tl.int64)
    q = tl.load(
        query + row * stride_qt + heads[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    table = block_tables + seq * stride_bt
    lanes = tl.arange(0, TILE)
    in_block = tl.arange(0, BLOCK_SIZE)
    blocks = start // BLOCK_SIZE + tl.arange(0, TILE_BLOCKS)
    ids = tl.load(table + blocks, mask=blocks * BLOCK_SIZE < end, other=0)
    m_i = tl.full([GROUP_PAD], NEG_FLOOR, tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    total = tl.zeros([HEAD_DIM], tl.float32)
    for tile_start in range(start, end, TILE):
        cur = ids
        blocks = (tile_start + TILE) // BLOCK_SIZE + tl.arange(0, TILE_BLOCKS)
        ids = tl.load(table + blocks, mask=blocks * BLOCK_SIZE < end, other=0)
        offset = cur.to(tl.int64)[:, None] * stride_kb + in_block[None, :] * stride_kt
        offset = kv_head * stride_kh + tl.reshape(offset, [TILE])  # (TILE,) row starts
        is_valid = tile_start + lanes < end
        k = tl.load(key_cache + offset[:, None] + dims[None, :], mask=is_valid[:, None], other=0.0)
        v = tl.load(
            value_cache + offset[:, None] + dims[None, :], mask=is_valid[:, None], other=0.0
        )
        if STREAM_ONLY:
            total += tl.sum(k.to(tl.float32) + v.to(tl.float32), 0)
        else:
            scores = tl.dot(q, tl.trans(k)) * scale_log2  # (GROUP_PAD, TILE)
            scores = tl.where(is_valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
    if STREAM_ONLY:
        pid = (row * tl.num_programs(1) + kv_head) * tl.num_programs(2) + part
        tl.store(part_sum + pid, tl.sum(total, 0))
    elif IS_SPLIT:  # the layout `decode._reduce_kernel` merges
        slot = (row * tl.num_programs(1) * GROUP + heads) * max_parts + part
        tl.store(part_max + slot, m_i, mask=row_ok)
        tl.store(part_sum + slot, l_i, mask=row_ok)
        tl.store(part_acc + slot[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None])
    else:
        o = acc / l_i[:, None]
        tl.store(
            out + row * stride_ot + heads[:, None] * stride_oh + dims[None, :],
            o.to(out.dtype.element_ty),
            mask=row_ok[:, None],
        )


@triton.jit
def _noop_kernel(x):
    tl.store(x, 1.0)


@dataclass
class Case:
    """One decode batch: paged tensors, the same KV contiguous for SDPA, the reference output."""

    batch: int
    context: int
    args: tuple  # query, key_cache, value_cache, block_tables, seq_lens, query_start_loc
    q4: torch.Tensor  # (B, Hkv, group, D)
    k: torch.Tensor  # (B, Hkv, L, D)
    v: torch.Tensor
    expected: torch.Tensor  # float32 [B, H, D]
    kv_bytes: int

    @property
    def name(self) -> str:
        block_size = self.args[1].shape[1]
        return f"{self.batch}x{self.context}" + ("" if block_size == 16 else f"/bs{block_size}")


def build_case(batch, context, block_size, dtype, device, gen) -> Case:
    k, v, key_cache, value_cache, tables, _ = make_paged(
        batch, context, block_size, dtype, device, gen
    )
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen, device=device).to(dtype)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    starts = torch.arange(batch + 1, dtype=torch.int32, device=device)
    args = (query, key_cache, value_cache, tables, seq_lens, starts)
    expected = reference.paged_attention(*args, scale=HEAD_DIM**-0.5, sliding_window=None)
    group = NUM_HEADS // NUM_KV_HEADS
    q4 = query.view(batch, NUM_KV_HEADS, group, HEAD_DIM)
    return Case(batch, context, args, q4, k, v, expected.float(), 2 * k.numel() * k.element_size())


# ------------------------------------------------------------------------------- timing
class Timer:
    """Median seconds per call: CUDA events with L2 flushed before each call, else perf_counter."""

    def __init__(self, device: str, max_reps: int = 1000):
        self.is_cuda, self.max_reps = device == "cuda", max_reps
        # 512 MiB zeroed before each timed call: evicts L2 (50 MiB on H200) and
        # gives the host a head start, so launch overhead below that is not what is timed.
        self.flush = torch.empty(2**27, dtype=torch.int32, device=device) if self.is_cuda else None

    def __call__(self, fn, reps: int) -> float:
        reps = min(reps, self.max_reps)
        fn()
        if not self.is_cuda:
            samples = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
            return statistics.median(samples)
        torch.cuda.synchronize()
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(reps)
        ]
        for start, stop in events:
            self.flush.zero_()
            start.record()
            fn()
            stop.record()
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) for a, b in events) / 1e3


def reps_for(seconds: float, budget: float = 0.08) -> int:
    return max(5, min(50, int(budget / max(seconds, 1e-6))))


# ------------------------------------------------------------------------------- configs
@dataclass(frozen=True)
class Config:
    variant: str  # "v1" (decode.py) | "v2" (prefetched block ids)
    tile_blocks: int
    num_warps: int
    num_stages: int
    num_parts: int  # 1 = no split (no reduce launch)

    def label(self, block_size: int) -> str:
        return (
            f"{self.variant} tile={self.tile_blocks * block_size} w={self.num_warps} "
            f"s={self.num_stages} parts={self.num_parts}"
        )


def partition_size(context: int, tile_tokens: int, num_parts: int) -> int:
    return triton.cdiv(triton.cdiv(context, num_parts), tile_tokens) * tile_tokens


def run_v2(case: Case, cfg: Config, stream_only: bool = False, tables=None) -> torch.Tensor:
    query, key_cache, value_cache, block_tables, seq_lens, _ = case.args
    block_tables = block_tables if tables is None else tables
    block_size = key_cache.shape[1]
    part = partition_size(case.context, cfg.tile_blocks * block_size, cfg.num_parts)
    num_parts = triton.cdiv(case.context, part)
    out = torch.empty_like(query)
    shape = (case.batch, NUM_HEADS, num_parts)
    part_max = torch.empty(shape, dtype=torch.float32, device=query.device)
    part_sum = torch.empty_like(part_max)  # also the probe's [batch, kv heads, parts] sums
    part_acc = torch.empty((*shape, HEAD_DIM), dtype=torch.float32, device=query.device)
    group = NUM_HEADS // NUM_KV_HEADS
    _decode_v2_kernel[(case.batch, NUM_KV_HEADS, num_parts)](
        query, key_cache, value_cache, block_tables, seq_lens, out, part_max, part_sum, part_acc,
        HEAD_DIM**-0.5 * 1.4426950408889634, part, num_parts, query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=HEAD_DIM, BLOCK_SIZE=block_size, TILE_BLOCKS=cfg.tile_blocks,
        IS_SPLIT=num_parts > 1, STREAM_ONLY=stream_only, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    if num_parts > 1 and not stream_only:
        decode._reduce_kernel[(case.batch, NUM_HEADS)](
            out, part_max, part_sum, part_acc, num_parts, out.stride(0), out.stride(1),
            **decode.reduce_meta(head_dim=HEAD_DIM, num_parts=num_parts),
        )  # fmt: skip
    return out


def run_config(case: Case, cfg: Config, tables=None) -> torch.Tensor:
    if cfg.variant == "v2":
        return run_v2(case, cfg, tables=tables)
    query, key_cache, value_cache, block_tables, seq_lens, starts = case.args
    block_size = key_cache.shape[1]
    span = block_tables.shape[1] * block_size
    return decode.decode_attention(
        query,
        key_cache,
        value_cache,
        block_tables if tables is None else tables,
        seq_lens,
        starts,
        scale=HEAD_DIM**-0.5,
        sliding_window=None,
        max_span=span,
        partition_size=partition_size(span, cfg.tile_blocks * block_size, cfg.num_parts),
        tile_blocks=cfg.tile_blocks,
        meta=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    )


def _routed_meta(block_size: int, tile_blocks: int, *, is_fp32: bool, is_split: bool) -> dict:
    """`decode_meta` for this script's geometry (GQA 32/8, head_dim 128, no window)."""
    return decode.decode_meta(
        is_fp32=is_fp32,
        group=NUM_HEADS // NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=block_size,
        tile_blocks=tile_blocks,
        use_window=False,
        is_split=is_split,
    )


def default_config(case: Case, num_sms: int) -> Config:
    """What `pagedkv.ops.triton` routes this batch to today."""
    block_size = case.args[1].shape[1]
    tile_blocks = tops.tile_blocks_for(block_size, tops._DECODE_TILE_LANES)
    part = tops.choose_partition_size(
        case.batch, NUM_KV_HEADS, case.context, tile_blocks * block_size, num_sms
    )
    options = _routed_meta(block_size, tile_blocks, is_fp32=False, is_split=True)
    num_parts = triton.cdiv(case.context, part)
    return Config("v1", tile_blocks, options["num_warps"], options["num_stages"], num_parts)


class Sweep:
    """Runs configs on one case under a wall-clock budget; remembers every result."""

    def __init__(self, case, timer, bandwidth, baseline_s, deadline, tol, block_size):
        self.case, self.timer, self.bandwidth = case, timer, bandwidth
        self.baseline_s, self.deadline = baseline_s, deadline
        self.tol, self.block_size = tol, block_size
        self.rows: dict[Config, dict] = {}

    def run(self, cfg: Config, stage: str) -> dict | None:
        if cfg in self.rows:
            return self.rows[cfg]
        if time.monotonic() > self.deadline:
            print(f"  [budget] skip {cfg.label(self.block_size)}", flush=True)
            return None
        row = dict(
            shape=self.case.name,
            stage=stage,
            variant=cfg.variant,
            tile=cfg.tile_blocks * self.block_size,
            warps=cfg.num_warps,
            stages=cfg.num_stages,
            parts=cfg.num_parts,
        )
        t0 = time.monotonic()
        try:
            out = run_config(self.case, cfg).float()
            err = float((out - self.case.expected).abs().max())
            rel = err / float(self.case.expected.abs().max())
            row.update(
                first_call_s=time.monotonic() - t0,
                max_abs_err=err,
                rel_err=rel,
                ok=bool(rel < self.tol),
            )
            if row["ok"]:
                seconds = self.timer(lambda: run_config(self.case, cfg), reps_for(self.baseline_s))
                gbs = self.case.kv_bytes / seconds / 1e9
                row.update(
                    ms=seconds * 1e3,
                    gbs=gbs,
                    pct_bw=100 * gbs * 1e9 / self.bandwidth,
                    x_sdpa=self.baseline_s / seconds,
                )
            else:
                row["error"] = f"WRONG: rel err {rel:.2e} >= {self.tol}"
        except Exception as exc:  # a config that fails to compile or launch: log, go on
            row.update(
                ok=False, error=f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"
            )
        self.rows[cfg] = row
        shown = (
            f"{row['ms']:.3f} ms {row['gbs']:.0f} GB/s {row['pct_bw']:.0f}% {row['x_sdpa']:.2f}x"
            if "ms" in row
            else row.get("error", "")
        )
        print(f"  {self.case.name} {stage:7s} {cfg.label(self.block_size):42s} {shown}", flush=True)
        return row

    def best(self, variant: str | None = None) -> Config | None:
        timed = [
            (r["ms"], c)
            for c, r in self.rows.items()
            if "ms" in r and (variant is None or c.variant == variant)
        ]
        return min(timed, key=lambda t: t[0])[1] if timed else None


def sweep_case(sweep: Sweep, default: Config, smoke: bool, full: bool) -> None:
    """Default, v2, coarse tiles x warps, then (full) warps x stages around the best, partitions.

    Later shapes (``full`` false) get the coarse pass and the partition pass only: the
    budget goes to the target shape first.
    """
    run = sweep.run
    if smoke:  # one of each path: routed default, split + reduce, no split, v2 split
        run(default, "default")
        run(Config("v1", 1, 4, 3, 2), "parts")
        run(Config("v2", 1, 4, 3, 2), "v2")
        run(Config("v2", 2, 4, 3, 1), "v2")
        return
    parts = default.num_parts
    bs = sweep.case.args[1].shape[1]
    tiles = [k // bs for k in (16, 32, 64, 128, 256) if bs <= k <= sweep.case.context]
    run(default, "default")
    v2_keys = ((64, 4, 3), (64, 4, 2), (128, 4, 3), (32, 4, 3), (64, 8, 3), (128, 4, 2))
    for keys, warps, stages in v2_keys:  # v2 first: the likely fix, measured before the budget ends
        if keys // bs in tiles:
            run(Config("v2", keys // bs, warps, stages, parts), "v2")
    for tile in tiles:
        for warps in (4, 8) if full else (4,):
            run(Config("v1", tile, warps, 3, parts), "coarse")
    best = sweep.best("v1") or default
    if full:
        grid = [(w, st) for w in (2, 4, 8) for st in (1, 2, 3)] + [(best.num_warps, 4)]
        for warps, stages in grid:
            run(Config("v1", best.tile_blocks, warps, stages, parts), "refine")
        for tile in (best.tile_blocks // 2, best.tile_blocks * 2):
            if tile in tiles:
                run(Config("v1", tile, best.num_warps, 2, parts), "refine")
    for variant in ("v1", "v2"):
        best = sweep.best(variant)
        if best is None:
            continue
        tile_tokens = best.tile_blocks * sweep.block_size
        for n in (1, 2, 4, 8, 16, 32, 64):
            if n == 1 or partition_size(sweep.case.context, tile_tokens, n) >= 64:
                run(Config(variant, best.tile_blocks, best.num_warps, best.num_stages, n), "parts")


def locality_probe(case: Case, timer: Timer, bandwidth: float, cfgs: list[Config]) -> list[dict]:
    """The access pattern alone: stream K/V through the table (shuffled, and identity)."""
    _, key_cache, _, tables, _, _ = case.args
    block_size = key_cache.shape[1]
    identity = torch.arange(tables.numel(), dtype=torch.int32, device=tables.device)
    identity = identity.view_as(tables)  # blocks in memory order: the DRAM/TLB-friendly case
    rows = []
    for cfg in cfgs:
        for table_name, table in (("shuffled", tables), ("identity", identity)):
            for what in ("stream", "attend"):
                row = dict(
                    shape=case.name, what=what, table=table_name, config=cfg.label(block_size)
                )
                try:
                    if what == "stream":
                        fn = functools.partial(run_v2, case, cfg, stream_only=True, tables=table)
                    else:
                        fn = functools.partial(run_config, case, cfg, tables=table)
                    seconds = timer(fn, 10)
                    gbs = case.kv_bytes / seconds / 1e9
                    row.update(ms=seconds * 1e3, gbs=gbs, pct_bw=100 * gbs * 1e9 / bandwidth)
                except Exception as exc:
                    row["error"] = repr(exc)[:160]
                rows.append(row)
                print(
                    f"  probe {case.name} {what:6s} {table_name:8s} {row['config']:42s} "
                    f"{row.get('pct_bw', float('nan')):.0f}% of read bw",
                    flush=True,
                )
    return rows


# --------------------------------------------------------------------------- host cost
def _bare_decode(case: Case):
    """`_decode_kernel` launched directly, no split: Triton's launcher and nothing else."""
    query, key_cache, value_cache, tables, seq_lens, starts = case.args
    block_size = key_cache.shape[1]
    span = tables.shape[1] * block_size
    tile_blocks = tops.tile_blocks_for(block_size, tops._DECODE_TILE_LANES)
    out = torch.empty_like(query)
    options = _routed_meta(
        block_size, tile_blocks, is_fp32=query.dtype == torch.float32, is_split=False
    )
    part = partition_size(span, tile_blocks * block_size, 1)
    key_scales, value_scales, scale_strides = scale_args(key_cache, None)  # a float cache

    def launch() -> None:
        decode._decode_kernel[(case.batch, NUM_KV_HEADS, 1)](
            query, key_cache, value_cache, tables, seq_lens, starts, out, out, out, out,
            HEAD_DIM**-0.5 * 1.4426950408889634, 0, part, case.batch, 1, query.stride(0),
            query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            tables.stride(0), out.stride(0), out.stride(1), key_scales, value_scales,
            *scale_strides, **options,
        )  # fmt: skip

    return launch


def host_functions(case: Case, device: str, gen) -> dict:
    """Each layer of one decode call (1 x 512) and one 32-token write, outermost first."""
    query, key_cache, value_cache, tables, seq_lens, starts = case.args
    md = ops.AttentionMetadata.build(
        tables.tolist(),
        [case.context] * case.batch,
        [1] * case.batch,
        list(range(case.batch)),
        device=device,
        backend="triton",
    )
    scale = HEAD_DIM**-0.5
    default = default_config(case, tops._num_sms(query.device))
    span = tables.shape[1] * key_cache.shape[1]
    tile_tokens = default.tile_blocks * key_cache.shape[1]
    pool = torch.zeros(4096, 16, NUM_KV_HEADS, HEAD_DIM, dtype=query.dtype, device=device)
    pool_v = torch.zeros_like(pool)
    key = torch.randn(32, NUM_KV_HEADS, HEAD_DIM, generator=gen, device=device).to(query.dtype)
    slots = torch.randperm(4096 * 16, generator=gen, device=device)[:32]
    flag = torch.zeros(1, device=device)
    return {
        "ops.paged_attention(backend=triton)": lambda: ops.paged_attention(
            *case.args, backend="triton"
        ),
        "ops.paged_attention_from_metadata": lambda: ops.paged_attention_from_metadata(
            query, key_cache, value_cache, md
        ),
        "triton plan + run (no validation)": lambda: tops.run(
            query, key_cache, value_cache, tops.plan(md, key_cache, NUM_HEADS, None), scale
        ),
        "decode.decode_attention (2 launches)": lambda: decode.decode_attention(
            *case.args,
            scale=scale,
            sliding_window=None,
            max_span=span,
            partition_size=partition_size(span, tile_tokens, default.num_parts),
            tile_blocks=default.tile_blocks,
        ),
        "_decode_kernel[grid] bare (1 launch)": _bare_decode(case),
        "_noop_kernel[grid] (1 arg)": lambda: _noop_kernel[(1,)](flag),
        "torch add_ (1 launch)": lambda: flag.add_(1),
        "ops.write_kv (32 tokens)": lambda: ops.write_kv(key, key, pool, pool_v, slots),
        "triton.write_kv (1 launch)": lambda: tops.write_kv(key, key, pool, pool_v, slots),
    }


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _profile(fn, device: str, calls: int) -> dict:
    """Kernels, device time and sync/copy API calls per call, from torch.profiler."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        _sync(device)
    kernels = syncs = 0
    device_us = 0.0
    names = []
    for e in prof.key_averages():
        self_dev = getattr(e, "self_device_time_total", None)
        self_dev = getattr(e, "self_cuda_time_total", 0.0) if self_dev is None else self_dev
        is_api = e.key.startswith(("cuda", "cu")) and not self_dev
        if is_api and re.search(r"Synchronize|Memcpy(?!Async)|MemcpyAsync|EventQuery", e.key):
            syncs += e.count if "Synchronize" in e.key else 0
            names.append(f"{e.key} x{e.count / calls:g}")
        elif self_dev and "Memset" not in e.key:
            kernels += e.count
            device_us += self_dev
    # The final synchronize above is one of the counted syncs; take it off.
    return dict(
        gpu_ops_per_call=kernels / calls,
        device_us_per_call=device_us / calls,
        syncs_per_call=max(0, syncs - (device == "cuda")) / calls,
        sync_or_copy_api=names,
    )


def _sync_debug(fn, device: str) -> list[str]:
    """Warnings torch raises for synchronizing ops (.item(), .cpu(), ...) in one call."""
    if device != "cuda":
        return []
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return [str(w.message).splitlines()[0][:160] for w in caught]


def _graph_us(fn, timer: Timer) -> float | None:
    """GPU time per call when replayed from a CUDA graph (no host work at all)."""
    if not timer.is_cuda:
        return None
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return timer(graph.replay, 50) * 1e6
    except Exception as exc:
        print(f"  graph capture failed: {type(exc).__name__}: {exc}"[:200])
        return None


def measure_host(case: Case, device: str, timer: Timer, gen, calls: int) -> dict:
    """Per call: host enqueue time, latency with a sync, device time, syncs; cProfile."""
    rows = []
    fns = host_functions(case, device, gen)
    for name, fn in fns.items():
        fn()
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        host_us = (time.perf_counter() - t0) / calls * 1e6  # enqueue only (no sync inside)
        _sync(device)
        latency = []
        for _ in range(min(calls, 100)):
            t0 = time.perf_counter()
            fn()
            _sync(device)
            latency.append(time.perf_counter() - t0)
        row = dict(name=name, host_us=host_us, latency_us=statistics.median(latency) * 1e6)
        row.update(_profile(fn, device, min(20, calls)))
        row["graph_us"] = _graph_us(fn, timer)
        row["sync_warnings"] = _sync_debug(fn, device)
        rows.append(row)
        print(
            f"  {name:40s} host {host_us:7.1f} us  latency {row['latency_us']:7.1f} us  "
            f"device {row['device_us_per_call']:6.1f} us  kernels {row['gpu_ops_per_call']:g}  "
            f"syncs {row['syncs_per_call']:g}  graph {row['graph_us'] or float('nan'):.1f} us  "
            f"{'; '.join(row['sync_warnings'])[:120]}",
            flush=True,
        )
    profiles = {}
    for name in ("ops.paged_attention(backend=triton)", "ops.write_kv (32 tokens)"):
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(calls):
            fns[name]()
        profiler.disable()
        _sync(device)
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(12)
        profiles[name] = text.getvalue()
        print(f"  cProfile, {calls} calls of {name} (tottime, top 12):")
        lines = [ln for ln in text.getvalue().splitlines() if re.match(r"\s*\d", ln)]
        print("\n".join("    " + ln.strip()[:150] for ln in lines[:12]))
    return dict(rows=rows, cprofile=profiles)


# ------------------------------------------------------------------------ kernel report
def kernel_report(jit_fn, out_dir: Path | None) -> list[dict]:
    """Registers, spills, shared memory and K/V buffering of every compiled variant (best effort).

    ``kv_tiles``: shared buffers as ``stages x keys x dim`` from the TTGIR (a leading 1: the
    next tile is fetched only after this one is consumed); ``async_wait``: the waits' ``num``
    (0 at the loop top: every copy in flight is waited for, no overlap with compute).
    """
    found = []
    for entry in getattr(jit_fn, "device_caches", {}).values():
        for part in entry if isinstance(entry, tuple) else (entry,):
            if isinstance(part, dict):
                found += [k for k in part.values() if hasattr(k, "asm")]
    rows = []
    for i, kernel in enumerate(found):
        ttgir = kernel.asm.get("ttgir", "")
        buffers = re.findall(
            r"local_alloc\s*:\s*\(\)\s*->\s*!\w+\.memdesc<(\d+)x(\d+)x(\d+)x", ttgir
        )
        meta = kernel.metadata
        rows.append(
            dict(
                kernel=getattr(jit_fn, "__name__", "kernel"),
                index=i,
                num_warps=meta.num_warps,
                num_stages=meta.num_stages,
                shared=meta.shared,
                registers=getattr(kernel, "n_regs", None),
                spills=getattr(kernel, "n_spills", None),
                kv_tiles=sorted({f"{b}x{r}x{c}" for b, r, c in buffers}),
                async_wait=sorted(set(re.findall(r"async_wait.*num = (\d+)", ttgir))),
            )
        )
        if out_dir is not None and ttgir and i == 0:  # the first compiled: the routed default
            (out_dir / f"{rows[-1]['kernel']}_{i}.ttgir").write_text(ttgir)
    return rows


# --------------------------------------------------------------------------------- main
# (batch, context, block_size): the target first, then the same KV in 128-token blocks (8x
# fewer random jumps per byte: tells DRAM/TLB locality from kernel inefficiency).
SHAPES = [(64, 4096, 16), (64, 4096, 128), (8, 4096, 16), (1, 32768, 16), (64, 32768, 16)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes, 4 configs: checks the script on the CPU (interpreter)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=200.0,
        help="wall-clock budget of the sweep; configs past it are skipped",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=sorted(DTYPES),
        help="default bfloat16 (float16 with --smoke: the interpreter lacks bf16)",
    )
    p.add_argument("--block-size", type=int, default=16, help="host section and --smoke")
    p.add_argument("--host-calls", type=int, default=None)
    p.add_argument("--no-host", action="store_true", help="skip the host-cost section")
    p.add_argument("--out-dir", type=Path, default=None, help="default $OUT, else results/")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("float16" if args.smoke else "bfloat16")
    args.host_calls = args.host_calls or (5 if args.smoke else 200)
    if args.out_dir is None and os.environ.get("OUT"):
        args.out_dir = Path(os.environ["OUT"])
    return args


def _fits(batch: int, context: int, dtype: torch.dtype, device: str) -> bool:
    """make_paged's peak: float32 randn + contiguous copies + the paged pools (~6x the KV)."""
    if device != "cuda":
        return True
    kv = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * torch.empty((), dtype=dtype).element_size()
    return torch.cuda.mem_get_info()[0] > 6 * kv + 2**31


def _summary(shape_rows: list[dict]) -> None:
    ok = sorted((r for r in shape_rows if "ms" in r), key=lambda r: r["ms"])
    shown = ok[:8] + [r for r in ok[8:] if r["stage"] == "default"]
    shown += [r for r in shape_rows if "ms" not in r]
    columns = (
        "shape stage variant tile warps stages parts ms gbs pct_bw x_sdpa rel_err error".split()
    )
    print_table([{c: r.get(c, "") for c in columns} for r in shown], columns)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("no CUDA device: run with --smoke (TRITON_INTERPRET=1)")
    started = time.monotonic()
    dtype = DTYPES[args.dtype]
    gen = torch.Generator(device=device).manual_seed(0)
    timer = Timer(device, max_reps=2 if args.smoke else 1000)
    bandwidth = read_bandwidth(device, gib=4.0 if device == "cuda" else 0.05)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (triton interpreter)"
    print(
        f"{name}, triton {triton.__version__}, torch {torch.__version__}, {args.dtype}, "
        f"block {args.block_size}; measured read bandwidth {bandwidth / 1e9:.0f} GB/s",
        flush=True,
    )
    results: dict = dict(device=name, read_bandwidth_bytes_per_s=bandwidth, shapes={})
    num_sms = tops._num_sms(torch.device(device))

    if not args.no_host:
        print("host cost per call (1 x 512 decode, 32-token write):", flush=True)
        context = 64 if args.smoke else 512
        case = build_case(1, context, args.block_size, dtype, device, gen)
        results["host"] = measure_host(case, device, timer, gen, args.host_calls)
        print(f"[{time.monotonic() - started:.0f} s]", flush=True)

    deadline = started + args.budget_s
    shapes = [(2, 64, args.block_size)] if args.smoke else SHAPES
    for batch, context, block_size in shapes:
        if time.monotonic() > deadline:
            print(f"skip {batch}x{context}: past the --budget-s deadline")
            continue
        if not _fits(batch, context, dtype, device):
            print(f"skip {batch}x{context}: not enough free device memory")
            continue
        case = build_case(batch, context, block_size, dtype, device, gen)
        sdpa = functools.partial(F.scaled_dot_product_attention, case.q4, case.k, case.v)
        baseline = timer(sdpa, 20)
        base_gbs = case.kv_bytes / baseline / 1e9
        print(
            f"{case.name}: SDPA on contiguous KV {baseline * 1e3:.3f} ms = {base_gbs:.0f} GB/s "
            f"({100 * base_gbs * 1e9 / bandwidth:.0f} %)",
            flush=True,
        )
        sweep = Sweep(case, timer, bandwidth, baseline, deadline, TOL[dtype], block_size)
        default = default_config(case, num_sms)
        sweep_case(sweep, default, args.smoke, full=(batch, context, block_size) == shapes[0])
        entry = dict(
            sdpa_ms=baseline * 1e3,
            default=default.label(block_size),
            rows=list(sweep.rows.values()),
        )
        best = [c for c in (sweep.best("v1"), sweep.best("v2")) if c is not None]
        if (batch, context, block_size) == shapes[0] or args.smoke:
            entry["probe"] = locality_probe(
                case, timer, bandwidth, list(dict.fromkeys([default, *best]))
            )
        for cfg in best:
            entry[f"best_{cfg.variant}"] = sweep.rows[cfg]
        results["shapes"][case.name] = entry
        _summary(entry["rows"])
        print(f"[{time.monotonic() - started:.0f} s]", flush=True)
        del case, sweep
        if device == "cuda":
            torch.cuda.empty_cache()

    asm_dir = None
    if device == "cuda" and args.out_dir is not None:
        asm_dir = args.out_dir / "tune_triton_ttgir"
        asm_dir.mkdir(parents=True, exist_ok=True)
    try:
        results["kernels"] = [
            row
            for fn in (decode._decode_kernel, _decode_v2_kernel)
            for row in kernel_report(fn, asm_dir)
        ]
    except Exception as exc:  # Triton's internals differ between versions: best effort
        print(f"kernel report unavailable: {type(exc).__name__}: {exc}"[:200])
        results["kernels"] = []
    if results["kernels"]:
        print("compiled kernels (kv_tiles: pipeline buffers x keys x dim; async_wait num):")
        print_table(results["kernels"])
    print("best per shape (ms, % of read bandwidth, x SDPA):")
    for shape, entry in results["shapes"].items():
        parts = [f"SDPA {entry['sdpa_ms']:.3f} ms"]
        default_row = next((r for r in entry["rows"] if r["stage"] == "default"), {})
        for key, row in (
            ("default", default_row),
            ("best v1", entry.get("best_v1", {})),
            ("best v2", entry.get("best_v2", {})),
        ):
            if "ms" in row:
                parts.append(
                    f"{key} [t{row['tile']} w{row['warps']} s{row['stages']} "
                    f"p{row['parts']}] {row['ms']:.3f} ms {row['pct_bw']:.0f}% "
                    f"{row['x_sdpa']:.2f}x"
                )
        print(f"  {shape}: " + "; ".join(parts))
    wrong = [r for e in results["shapes"].values() for r in e["rows"] if not r.get("ok")]
    print(
        f"{len(wrong)} config(s) wrong or failed" + (": see 'error' in the tables" if wrong else "")
    )
    path = write_results(
        "tune_triton",
        config=vars(args) | {"out_dir": str(args.out_dir)},
        results=results,
        out_dir=args.out_dir,
    )
    print(f"wrote {path} [{time.monotonic() - started:.0f} s]")


if __name__ == "__main__":
    main()
