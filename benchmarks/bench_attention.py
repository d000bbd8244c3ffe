"""Paged attention vs scaled_dot_product_attention on the same KV held contiguously.

Decode (one new token per sequence) and prefill over GQA 32/8 heads, head_dim 128 (else
`--heads 12 4 --head-dim 64`, the engine model's geometry): time per
call (median), achieved GB/s of KV read, the ratio to the contiguous SDPA baseline measured
in the same run, and the machine's read bandwidth, measured at the start and again right
after each decode row (GB/s and its share are of the engine's path: planned once, run per
layer). Also times `write_kv` for one decode step (32 tokens).

Baselines. Decode: SDPA with the query viewed as [batch, num_kv_heads, group, head_dim]
against K/V [batch, num_kv_heads, context, head_dim] (exact for decode: every query head of
a group sees the same keys), not `enable_gqa=True`, which is much slower on the CPU.
Prefill: SDPA with `enable_gqa=True, is_causal=True` on contiguous K/V, the same call the
CPU backend makes after gathering, so the ratio is the price of paging.

    python benchmarks/bench_attention.py --quick
    python benchmarks/bench_attention.py                  # full grid (CPU)
    python benchmarks/bench_attention.py --device cuda    # Triton backend vs SDPA on a GPU

`--dtype int8` (in the CPU default) times decode over an int8 cache with bfloat16 queries;
its baseline is SDPA in bfloat16 on the same (dequantized) values, and its GB/s count the
int8 rows and their float16 scales.
"""

from __future__ import annotations

import os

from pagedkv.runtime.threads import apply_thread_policy

# Before torch (and its OpenMP runtime) loads: the engine's thread policy, so that the
# kernel is timed as the engine runs it.
apply_thread_policy()

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _common import write_results  # noqa: E402 (benchmarks/_common.py, script dir)

from pagedkv.cache import PagedKVCache  # noqa: E402
from pagedkv.ops import (  # noqa: E402
    AttentionMetadata,
    paged_attention,
    paged_attention_from_metadata,
    warmup,
    write_kv,
)
from pagedkv.ops.quantize import dequantize, quantize  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,  # an int8 cache (a float16 scale per token and head), bfloat16 queries
}
QUERY_DTYPE = {torch.int8: torch.bfloat16}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timeit(fn, device: str, min_time: float, min_repeats: int = 3) -> float:
    """Median seconds per call after one warm-up, repeating for at least `min_time` seconds."""
    return timeit_side_by_side([fn], device, min_time, min_repeats)[0]


def timeit_side_by_side(
    fns: list, device: str, min_time: float, min_repeats: int = 3
) -> list[float]:
    """Median seconds per call of each function, timed in interleaved rounds.

    One round calls every function once, so load from other processes on a shared machine
    falls on all of them alike (timing one after the other lets a burst of load land on
    one side of a ratio). Repeats for at least `min_time` seconds per function.
    """
    for fn in fns:
        fn()
    _sync(device)
    times: list[list[float]] = [[] for _ in fns]
    start = time.perf_counter()
    while len(times[0]) < min_repeats or time.perf_counter() - start < min_time * len(fns):
        for fn, samples in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            _sync(device)
            samples.append(time.perf_counter() - t0)
        if len(times[0]) >= 1000:
            break
    return [statistics.median(samples) for samples in times]


def time_after_baseline(baseline, calls: list, device: str, min_time: float) -> list[float]:
    """Median seconds of `baseline` and of each call, every call timed right after a baseline
    call: [baseline, *calls].

    A call never follows another call over the same paged cache: it would find that cache's
    KV still in the CPU caches (timed right after the plain call, the planned one read 4 MB
    at 1 x 512 in 0.12 ms against 0.13 ms after SDPA; the plain call itself always followed
    SDPA). Each baseline slot has its own median; the baseline time is their mean.
    """
    fns = []
    for call in calls:
        fns += [baseline, call]
    medians = timeit_side_by_side(fns, device, min_time)
    return [statistics.fmean(medians[0::2]), *medians[1::2]]


def read_bandwidth(device: str, gib: float = 1.0) -> float:
    """Bytes per second of a large float32 reduction (read-only, all threads)."""
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32, device=device)
    seconds = timeit(lambda: x.sum(), device, min_time=1.0, min_repeats=5)
    return x.numel() * 4 / seconds


def make_paged(
    batch: int, context: int, block_size: int, dtype: torch.dtype, device: str, gen: torch.Generator
):
    """Contiguous K/V [B, Hkv, L, D] and the same values in a shuffled paged cache (one layer
    of the engine's `PagedKVCache`, so on the CPU on the huge pages the engine asks for), and
    the cache's scales (`key_scales`, `value_scales`; none for a float cache). An int8
    cache's contiguous K/V are its values dequantized, in bfloat16."""
    shape = (batch, NUM_KV_HEADS, context, HEAD_DIM)
    wide = QUERY_DTYPE.get(dtype, dtype)
    k = torch.randn(shape, generator=gen, device=device).to(wide)
    v = torch.randn(shape, generator=gen, device=device).to(wide)
    if dtype == torch.int8:
        k, v = (dequantize(*quantize(x), wide) for x in (k, v))
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    tables = torch.randperm(num_blocks, generator=gen, device=device).view(batch, -1)
    cache = PagedKVCache(1, num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, dtype=dtype,
                         device=device)  # fmt: skip
    key_cache, value_cache = cache.key_caches[0], cache.value_caches[0]
    scales = {}
    if cache.is_quantized:
        scales = {"key_scales": cache.key_scales[0], "value_scales": cache.value_scales[0]}
    pad = blocks_per_seq * block_size - context
    for src, dst, dst_scales in ((k, key_cache, scales.get("key_scales")),
                                 (v, value_cache, scales.get("value_scales"))):  # fmt: skip
        # A sequence at a time (a whole-batch temporary would not fit beside two 8 GiB copies
        # at 32 x 32768 float32): (Hkv, L, D) -> (L_padded, Hkv, D) -> (blocks, bs, Hkv, D).
        for b in range(batch):
            rows = F.pad(src[b].transpose(0, 1), (0, 0, 0, 0, 0, pad))
            rows = rows.reshape(blocks_per_seq, block_size, NUM_KV_HEADS, HEAD_DIM)
            if dst_scales is None:
                dst[tables[b]] = rows
            else:
                dst[tables[b]], dst_scales[tables[b]] = quantize(rows)
    return k, v, key_cache, value_cache, tables.to(torch.int32), scales


def _kv_bytes(key_cache: torch.Tensor, batch: int, context: int) -> int:
    """K and V bytes `batch` sequences of `context` tokens read (an int8 cache's scales too)."""
    per_head = HEAD_DIM * key_cache.element_size() + (2 if key_cache.dtype == torch.int8 else 0)
    return 2 * batch * context * NUM_KV_HEADS * per_head


def bench_decode(batch, context, block_size, dtype, device, backend, min_time, gen) -> dict:
    k, v, key_cache, value_cache, tables, scales = make_paged(
        batch, context, block_size, dtype, device, gen
    )
    warmup(key_cache, value_cache, NUM_HEADS, backend=backend)  # as an engine does at start-up
    group = NUM_HEADS // NUM_KV_HEADS
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen, device=device)
    query = query.to(QUERY_DTYPE.get(dtype, dtype))
    md = AttentionMetadata.build(
        tables.tolist(),
        [context] * batch,
        [1] * batch,
        list(range(batch)),
        device=device,
        backend=backend,
    )
    q4 = query.view(batch, NUM_KV_HEADS, group, HEAD_DIM)  # (B, Hkv, group, D)
    args = (query, key_cache, value_cache, md.block_tables, md.seq_lens, md.query_start_loc)
    base, paged, planned = time_after_baseline(
        lambda: F.scaled_dot_product_attention(q4, k, v),
        [
            lambda: paged_attention(*args, backend=backend, **scales),
            lambda: paged_attention_from_metadata(query, key_cache, value_cache, md, **scales),
        ],
        device,
        min_time,
    )
    out = paged_attention(*args, backend=backend, **scales).float()
    ref = F.scaled_dot_product_attention(q4, k, v).reshape(batch, NUM_HEADS, HEAD_DIM).float()
    kv_bytes = _kv_bytes(key_cache, batch, context)
    return dict(
        kind="decode",
        batch=batch,
        context=context,
        block_size=block_size,
        dtype=str(dtype)[6:],
        baseline_s=base,
        paged_s=paged,
        planned_s=planned,
        kv_bytes=kv_bytes,
        max_abs_err=float((out - ref).abs().max()),
    )


def bench_prefill(batch, context, block_size, dtype, device, backend, min_time, gen) -> dict:
    k, v, key_cache, value_cache, tables, _ = make_paged(
        batch, context, block_size, dtype, device, gen
    )
    shape = (batch * context, NUM_HEADS, HEAD_DIM)
    query = torch.randn(shape, generator=gen, device=device).to(dtype)
    md = AttentionMetadata.build(
        tables.tolist(),
        [context] * batch,
        [context] * batch,
        list(range(batch * context)),
        device=device,
        backend=backend,
    )
    q4 = query.view(batch, context, NUM_HEADS, HEAD_DIM).transpose(1, 2)  # (B, H, L, D)
    args = (query, key_cache, value_cache, md.block_tables, md.seq_lens, md.query_start_loc)
    base, paged = timeit_side_by_side(
        [
            lambda: F.scaled_dot_product_attention(q4, k, v, is_causal=True, enable_gqa=True),
            lambda: paged_attention(*args, backend=backend),
        ],
        device,
        min_time,
    )
    kv_bytes = 2 * k.numel() * k.element_size()
    return dict(
        kind="prefill",
        batch=batch,
        context=context,
        block_size=block_size,
        dtype=str(dtype)[6:],
        baseline_s=base,
        paged_s=paged,
        planned_s=None,
        kv_bytes=kv_bytes,
        max_abs_err=None,
    )


def bench_mixed(batch, context, chunk, block_size, dtype, device, backend, min_time, gen) -> dict:
    """`batch` decode rows plus one prefill chunk of `chunk` tokens over a cached prefix, one call.

    All batch + 1 sequences hold `context` tokens; the baseline is the two SDPA calls the
    batch would need on contiguous KV (grouped decode, and the chunk with a bottom-right mask).
    """
    k, v, key_cache, value_cache, tables, _ = make_paged(
        batch + 1, context, block_size, dtype, device, gen
    )
    warmup(key_cache, value_cache, NUM_HEADS, backend=backend)
    group = NUM_HEADS // NUM_KV_HEADS
    query = torch.randn(batch + chunk, NUM_HEADS, HEAD_DIM, generator=gen, device=device)
    query = query.to(dtype)
    q_lens = [1] * batch + [chunk]
    md = AttentionMetadata.build(
        tables.tolist(),
        [context] * (batch + 1),
        q_lens,
        list(range(batch + chunk)),
        device=device,
        backend=backend,
    )
    q_decode = query[:batch].view(batch, NUM_KV_HEADS, group, HEAD_DIM)
    q_chunk = query[batch:].transpose(0, 1)[None]  # (1, H, chunk, D)
    mask = torch.ones(chunk, context, dtype=torch.bool, device=device).tril(context - chunk)

    def baseline() -> None:
        F.scaled_dot_product_attention(q_decode, k[:batch], v[:batch])
        F.scaled_dot_product_attention(
            q_chunk, k[batch:], v[batch:], attn_mask=mask, enable_gqa=True
        )

    args = (query, key_cache, value_cache, md.block_tables, md.seq_lens, md.query_start_loc)
    base, paged, planned = time_after_baseline(
        baseline,
        [
            lambda: paged_attention(*args, backend=backend),
            lambda: paged_attention_from_metadata(query, key_cache, value_cache, md),
        ],
        device,
        min_time,
    )
    return dict(
        kind="mixed",
        batch=batch,
        context=context,
        block_size=block_size,
        dtype=str(dtype)[6:],
        baseline_s=base,
        paged_s=paged,
        planned_s=planned,
        kv_bytes=2 * k.numel() * k.element_size(),
        max_abs_err=None,
        chunk=chunk,
    )


def bench_write(dtype: torch.dtype, device: str, min_time: float, gen: torch.Generator) -> float:
    """Seconds to write one decode step's K/V (32 tokens, 8 KV heads, dim 128)."""
    key_cache = torch.zeros(4096, 16, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    value_cache = torch.zeros_like(key_cache)
    scales = {}
    if dtype == torch.int8:
        scales = {name: torch.zeros(key_cache.shape[:3], dtype=torch.float16, device=device)
                  for name in ("key_scales", "value_scales")}  # fmt: skip
    key = torch.randn(32, NUM_KV_HEADS, HEAD_DIM, generator=gen, device=device)
    key = key.to(QUERY_DTYPE.get(dtype, dtype))
    value = key.clone()
    slots = torch.randperm(4096 * 16, generator=gen, device=device)[:32]
    return timeit(
        lambda: write_kv(key, value, key_cache, value_cache, slots, **scales), device, min_time
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--quick", action="store_true", help="a short run: fewer shapes and repeats")
    p.add_argument("--threads", type=int, default=2, help="torch and numba threads (both sides)")
    p.add_argument("--batch", type=int, nargs="+")
    p.add_argument("--context", type=int, nargs="+")
    p.add_argument("--block-size", type=int, nargs="+")
    p.add_argument("--dtype", nargs="+", choices=sorted(DTYPES))
    p.add_argument("--max-kv-gib", type=float, help="skip shapes whose KV (one copy) exceeds this")
    p.add_argument("--heads", type=int, nargs=2, default=[32, 8], help="query and KV heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--max-prefill-context", type=int, default=None)
    p.add_argument("--min-time", type=float, default=None, help="seconds of repeats per timing")
    p.add_argument("--no-prefill", action="store_true")
    p.add_argument("--out-dir", type=Path, default=None, help="default benchmarks/results")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    defaults = dict(
        batch=[1, 8] if args.quick else ([1, 8, 32, 64] if cuda else [1, 8, 32]),
        context=[512, 4096] if args.quick else [512, 4096, 32768],
        block_size=[16] if cuda else ([16, 32] if args.quick else [16, 32, 128]),
        dtype=["float32", "bfloat16", "int8"] if not cuda else ["bfloat16", "float16"],
        max_kv_gib=24.0 if cuda else (0.6 if args.quick else 2.1),
        max_prefill_context=(32768 if cuda else 4096),
        min_time=0.15 if args.quick else 0.5,
    )
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def _row(r: dict, bandwidth: float) -> str:
    """A result as a table row; GB/s and %bw of the engine's path (planned once, when the
    kind has one) against the read bandwidth measured right after the row, else `bandwidth`."""
    gbs = r["kv_bytes"] / (r["planned_s"] or r["paged_s"]) / 1e9
    bandwidth = r.get("read_bandwidth_bytes_per_s", bandwidth)
    planned = f"{r['baseline_s'] / r['planned_s']:6.2f}x" if r["planned_s"] else "      -"
    return (
        f"{r['kind']:7s} {r['dtype']:8s} {r['batch']:5d} {r['context']:7d} "
        f"{r['block_size']:5d} {r['baseline_s'] * 1e3:10.3f} {r['paged_s'] * 1e3:10.3f} "
        f"{r['baseline_s'] / r['paged_s']:6.2f}x {planned} {gbs:8.1f} "
        f"{100 * gbs * 1e9 / bandwidth:5.0f}%"
    )


def main(argv: list[str] | None = None) -> None:
    global NUM_HEADS, NUM_KV_HEADS, HEAD_DIM  # the geometry every bench function reads
    args = parse_args(argv)
    (NUM_HEADS, NUM_KV_HEADS), HEAD_DIM = args.heads, args.head_dim
    torch.set_num_threads(args.threads)
    os.environ["NUMBA_NUM_THREADS"] = str(args.threads)
    if args.device == "cpu":
        import numba

        numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    backend = "triton" if args.device == "cuda" else "cpu"
    gen = torch.Generator(device=args.device).manual_seed(0)
    bandwidth = read_bandwidth(args.device, gib=4.0 if args.device == "cuda" else 1.0)
    print(
        f"threads={args.threads} (torch and numba), backend={backend}, "
        f"measured read bandwidth {bandwidth / 1e9:.1f} GB/s"
    )
    print(
        f"{'kind':7s} {'dtype':8s} {'batch':>5s} {'context':>7s} {'block':>5s} "
        f"{'sdpa ms':>10s} {'paged ms':>10s} {'ratio':>7s} {'planned':>7s} {'GB/s':>8s} "
        f"{'%bw':>6s}"
    )
    results = []
    for dtype_name in args.dtype:
        dtype = DTYPES[dtype_name]
        element = torch.empty((), dtype=QUERY_DTYPE.get(dtype, dtype)).element_size()
        for batch in args.batch:
            for context in args.context:
                kv_gib = batch * context * NUM_KV_HEADS * HEAD_DIM * element * 2 / 2**30
                if kv_gib > args.max_kv_gib:
                    print(
                        f"skip decode {dtype_name} batch {batch} context {context}: "
                        f"{kv_gib:.1f} GiB KV > --max-kv-gib {args.max_kv_gib}"
                    )
                    continue
                for bs in args.block_size:
                    r = bench_decode(
                        batch, context, bs, dtype, args.device, backend, args.min_time, gen
                    )
                    # The machine's figure may move between rows (a shared virtual
                    # machine's does, within minutes): measured again right after each.
                    r["read_bandwidth_bytes_per_s"] = read_bandwidth(
                        args.device, gib=4.0 if args.device == "cuda" else 1.0
                    )
                    results.append(r)
                    print(_row(r, bandwidth), flush=True)
        if dtype == torch.int8:
            continue  # decode rows only: a prefill dequantizes and runs the float path
        for context in [] if args.no_prefill else args.context:
            if context > args.max_prefill_context:
                continue
            r = bench_prefill(
                1, context, args.block_size[0], dtype, args.device, backend, args.min_time, gen
            )
            results.append(r)
            print(_row(r, bandwidth), flush=True)
        if not args.no_prefill:
            batch = 16 if args.quick else 32
            r = bench_mixed(batch, 2048, 512, args.block_size[0], dtype, args.device, backend,
                            args.min_time, gen)  # fmt: skip
            results.append(r)
            print(_row(r, bandwidth), flush=True)
    writes = {
        name: bench_write(DTYPES[name], args.device, args.min_time, gen) for name in args.dtype
    }
    for name, seconds in writes.items():
        shape = f"32 tokens x {NUM_KV_HEADS} heads x {HEAD_DIM}"
        print(f"write_kv {name}, {shape}: {seconds * 1e6:.1f} us")
    name = f"attention_{args.device}" + ("_quick" if args.quick else "")
    extra = dict(threads=args.threads, backend=backend, read_bandwidth_bytes_per_s=bandwidth)
    if args.device == "cuda":
        extra["gpu"] = torch.cuda.get_device_name()
    path = write_results(
        name,
        config={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        results=dict(extra, rows=results, write_kv_32_tokens_s=writes),
        out_dir=args.out_dir,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
