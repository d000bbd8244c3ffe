"""Block pool benchmark: allocate+free under churn, prefix hits, build time, bytes per block.

For each pool size it measures, in one run, side by side:

* churn: the pool kept ~90 % full; each step frees a random sequence and allocates new ones
  (1-64 blocks each) until 90 % is used again. Reported in microseconds per block (one
  allocation plus one free). Through `BlockPool` (the layer vLLM's BlockPool figures compare
  with), through `KVCacheManager` without prefix caching (prompts of 16-token blocks,
  sequence dicts, validation), and through a first-free-scan allocator (a Python port of a
  page-at-a-time FindFreePage + AllocatePages design), timed on fewer steps at large sizes.
  The floor: the same churn through a stand-in that only makes a block table and reads it
  back on free (the workload's own cost: its tables go cold in cache at large sizes).
  "calls" figures (`pool_calls`, `manager_calls`) time each allocate and free call on its
  own: the allocator without the workload's steps around it (picking the victim, keeping
  the list of live sequences). Every size runs its churn chunks in turn with the others, so
  that the ratio between sizes does not measure the machine's drift.
* prefix hit: `KVCacheManager.allocate` of a 64-block prompt whose blocks are all cached
  (free, in the LRU queue) in a pool whose other blocks are held or cached; microseconds per
  hit block, then `free` separately. Repeated hits on a chain go through its spans; the walk
  figure is the same hit with spans off (a first hit, or a chain shorter than a span).
* build: seconds to construct `KVCacheManager(num_blocks, 16)`, and pool bookkeeping bytes
  per block measured with tracemalloc (pool arrays, then pool plus the prefix index's key
  list); and the same bytes in the busy pool after the prefix-hit run (array lengths).

    python benchmarks/bench_block_pool.py                 # 10K, 100K, 1M, 2,097,152 blocks
    python benchmarks/bench_block_pool.py --sizes 10000 --repeats 3
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import random
import statistics
import sys
import time
import tracemalloc
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table, write_results  # noqa: E402

from pagedkv.memory import BlockPool, KVCacheManager, PrefixIndex  # noqa: E402

BLOCK_SIZE = 16
MAX_SEQ_BLOCKS = 64
DEFAULT_SIZES = (10_000, 100_000, 1_000_000, 2_097_152)


class ScanAllocator:
    """A page-at-a-time allocator ported as written: a first-free linear scan per page.

    `allocate_pages` keeps its bug (pages taken before running out stay attached to the
    table); the churn below never runs out, so the bug does not affect the timing.
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.is_used = [False] * num_pages

    def find_free_page(self) -> int:
        is_used = self.is_used
        for page in range(self.num_pages):
            if not is_used[page]:
                return page
        return -1

    def allocate_pages(self, table: list[int], num: int) -> bool:
        for _ in range(num):
            page = self.find_free_page()
            if page < 0:
                return False
            self.is_used[page] = True
            table.append(page)
        return True

    def free_pages(self, table: list[int]) -> None:
        for page in table:
            self.is_used[page] = False


def _workload(num_blocks: int, num_steps: int, seed: int) -> tuple[list[int], list[float]]:
    rng = random.Random(seed)
    # Enough sequence sizes for the fill (mean 32.5 blocks) and a few per step.
    num_sizes = num_blocks // 16 + 4 * num_steps + 100
    sizes = [rng.randint(1, MAX_SEQ_BLOCKS) for _ in range(num_sizes)]
    picks = [rng.random() for _ in range(num_steps)]
    return sizes, picks


def churn_chunks(
    alloc,
    free,
    num_blocks: int,
    num_steps: int,
    seed: int,
    fill=None,
    chunk: int = 50,
    timer: CallTimer | None = None,
) -> Iterator[tuple[float, float]]:
    """Run the 90 %-full churn, `chunk` steps at a time: yields (seconds, blocks) per chunk.

    `fill` (default `alloc`) takes the untimed first 90 %, done before the first chunk. With
    a `timer`, a chunk's time is that of the calls it timed (the allocator's own calls that
    `alloc` and `free` make): the allocator without the workload around it (picking the
    victim, keeping the list of live sequences, deallocating a dropped table after `free`
    returns). A block is one allocation plus one free.
    """
    sizes, picks = _workload(num_blocks, num_steps, seed)
    target = int(0.9 * num_blocks)
    held: list[object] = []
    used = next_size = 0

    def refill(alloc) -> None:
        nonlocal used, next_size
        while used + sizes[next_size] <= target:
            held.append(alloc(sizes[next_size]))
            used += sizes[next_size]
            next_size += 1

    refill(fill or alloc)  # untimed fill to 90 %
    for first in range(0, len(picks), chunk):
        first_size, freed = next_size, 0
        if timer is not None:
            timer.ns = 0
        start = time.perf_counter()
        for pick in picks[first : first + chunk]:
            i = int(pick * len(held))
            held[i], held[-1] = held[-1], held[i]
            n = free(held.pop())
            used -= n
            freed += n
            refill(alloc)
        elapsed = time.perf_counter() - start if timer is None else timer.ns / 1e9
        yield elapsed, (sum(sizes[first_size:next_size]) + freed) / 2


class CallTimer:
    """Adds the time of each call to the functions it wrapped to `ns` (the clock's own cost
    subtracted)."""

    def __init__(self) -> None:
        self.ns, self._clock, self._clock_ns = 0, time.perf_counter_ns, _clock_cost_ns()

    def timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock, clock_ns = self._clock, self._clock_ns

        def call(*args: Any) -> Any:
            start = clock()
            result = fn(*args)
            self.ns += clock() - start - clock_ns
            return result

        return call


def churn(
    alloc,
    free,
    num_blocks: int,
    num_steps: int,
    seed: int,
    time_budget_s: float = float("inf"),
    fill=None,
    chunk: int = 50,
) -> tuple[float, int]:
    """`churn_chunks` run alone, for at most `time_budget_s`.

    Returns:
        (overall microseconds per block, steps timed).
    """
    total_s = total_blocks = 0.0
    steps, began = 0, time.perf_counter()
    for seconds, blocks in churn_chunks(alloc, free, num_blocks, num_steps, seed, fill, chunk):
        total_s, total_blocks, steps = total_s + seconds, total_blocks + blocks, steps + chunk
        if time.perf_counter() - began >= time_budget_s:
            break
    return total_s / total_blocks * 1e6, min(steps, num_steps)


def interleaved(runs: dict[int, Iterator[tuple[float, float]]], turn: int) -> dict[int, float]:
    """Median microseconds per block of each run's chunks, `turn` chunks of each run in turn.

    On a shared machine whose speed drifts within seconds, sizes timed one after the other
    would each get a different machine; taking turns gives every size the same mix of slow
    and fast moments. The first chunk of a turn may find the caches holding another size's
    data: one chunk of `turn`, which the median leaves out.
    """
    rates: dict[int, list[float]] = {key: [] for key in runs}
    live = dict(runs)
    while live:
        for key in list(live):
            got = [seconds / blocks * 1e6 for seconds, blocks in itertools.islice(live[key], turn)]
            rates[key] += got
            if len(got) < turn:
                del live[key]
    return {key: statistics.median(r) for key, r in rates.items()}


def _clock_cost_ns() -> int:
    """Median cost of reading `time.perf_counter_ns` twice back to back."""
    clock, samples = time.perf_counter_ns, []
    for _ in range(2001):
        start = clock()
        samples.append(clock() - start)
    return int(statistics.median(samples))


class BareTables:
    """The floor: what any allocator does per call (make a block table, read it back on free)
    with no bookkeeping at all: every table holds the same ids."""

    def __init__(self) -> None:
        self.template = array("i", range(MAX_SEQ_BLOCKS))

    def allocate(self, num: int) -> array:
        return self.template[:num]

    def free(self, block_ids: array) -> int:
        block_ids[::-1]  # noqa: B018  # read the (cold) table back, as a free must
        return len(block_ids)


def churn_floor(num_blocks: int, num_steps: int, seed: int) -> Iterator[tuple[float, float]]:
    bare = BareTables()
    return churn_chunks(bare.allocate, bare.free, num_blocks, num_steps, seed)


def churn_pool(num_blocks: int, num_steps: int, seed: int, calls_only: bool = False
               ) -> Iterator[tuple[float, float]]:  # fmt: skip
    pool = BlockPool(num_blocks, PrefixIndex(num_blocks))
    timer = CallTimer() if calls_only else None
    allocate = timer.timed(pool.allocate) if timer else pool.allocate
    release = timer.timed(pool.free) if timer else pool.free

    def free(block_ids: array) -> int:
        release(block_ids)
        return len(block_ids)

    return churn_chunks(allocate, free, num_blocks, num_steps, seed, timer=timer)


def churn_manager(num_blocks: int, num_steps: int, seed: int, calls_only: bool = False
                  ) -> Iterator[tuple[float, float]]:  # fmt: skip
    manager = KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=False)
    prompts = {n: list(range(n * BLOCK_SIZE)) for n in range(1, MAX_SEQ_BLOCKS + 1)}
    counter = iter(range(10**12))
    timer = CallTimer() if calls_only else None
    allocate = timer.timed(manager.allocate) if timer else manager.allocate
    release = timer.timed(manager.free) if timer else manager.free

    def alloc(num: int) -> tuple[int, int]:
        seq_id = next(counter)
        allocate(seq_id, prompts[num])
        return seq_id, num

    def free(seq: tuple[int, int]) -> int:
        release(seq[0])
        return seq[1]

    return churn_chunks(alloc, free, num_blocks, num_steps, seed, timer=timer)


def churn_scan(num_blocks: int, num_steps: int, seed: int, budget_s: float) -> tuple[float, int]:
    scan = ScanAllocator(num_blocks)

    def alloc(num: int) -> list[int]:
        table: list[int] = []
        assert scan.allocate_pages(table, num), "scan allocator ran out"
        return table

    def free(table: list[int]) -> int:
        scan.free_pages(table)
        return len(table)

    # Filling an empty pool by first-free scans is O(n^2) but lands on 0, 1, 2, ...: place
    # the same pages directly.
    next_page = 0

    def fill(num: int) -> list[int]:
        nonlocal next_page
        table = list(range(next_page, next_page + num))
        scan.is_used[next_page : next_page + num] = [True] * num
        next_page += num
        return table

    # Few, slow steps: the overall rate (a step that allocates nothing would skew a median).
    return churn(alloc, free, num_blocks, num_steps, seed, budget_s, fill, chunk=1)


def prefix_hit(num_blocks: int, repeats: int, seed: int) -> tuple[float, float, float, float]:
    """(us per hit block in allocate, the same with spans off, us per block in the following
    free, pool bytes/block).

    The bytes are the pool's arrays plus the index's entry list after the run, with the pool
    ~45 % held and ~45 % cached (the free stack and the cached queue at their working size).
    """
    rng = random.Random(seed)
    manager = KVCacheManager(num_blocks, BLOCK_SIZE)
    # Occupy ~90 % of the pool with other prompts' blocks: half held, half cached-free,
    # so the index and the LRU queue are pool-sized.
    # Distinct prompts built from shared int objects, to keep the index's memory down.
    vocab, num_tokens = list(range(50_000)), MAX_SEQ_BLOCKS * BLOCK_SIZE
    filler, seq_no = int(0.9 * num_blocks) - MAX_SEQ_BLOCKS - 1, 0
    while filler >= MAX_SEQ_BLOCKS:
        base = seq_no % (len(vocab) - num_tokens)
        manager.allocate(("fill", seq_no), vocab[base : base + num_tokens])
        if seq_no % 2:
            manager.free(("fill", seq_no))
        filler, seq_no = filler - MAX_SEQ_BLOCKS, seq_no + 1
    prompt = [rng.randrange(50_000) for _ in range(MAX_SEQ_BLOCKS * BLOCK_SIZE + 1)]
    manager.allocate("warm", prompt)
    manager.free("warm")
    # Alternate hits with spans (the default) and without (no chain is 2**30 blocks long), so
    # both see the same machine load.
    index, span_blocks = manager._index, manager._index.span_blocks
    hit, walk, release = [], [], []
    for i in range(repeats):
        index.span_blocks = span_blocks if i % 2 else 1 << 30
        hit_us, free_us = _time_hit(manager, prompt)
        (hit if i % 2 else walk).append(hit_us)
        release.append(free_us)
    pool_bytes = manager._pool.nbytes() + 8 * num_blocks  # + the entry list: 8 B per block
    median = statistics.median
    return median(hit), median(walk), median(release), pool_bytes / num_blocks


def _time_hit(manager: KVCacheManager, prompt: list[int]) -> tuple[float, float]:
    """Us per block of `allocate` (every full block a hit) and of the `free` after it."""
    t0 = time.perf_counter()
    num_cached = manager.allocate("hit", prompt)
    t1 = time.perf_counter()
    manager.free("hit")
    t2 = time.perf_counter()
    assert num_cached == MAX_SEQ_BLOCKS * BLOCK_SIZE, "expected every full block to hit"
    return (t1 - t0) / MAX_SEQ_BLOCKS * 1e6, (t2 - t1) / (MAX_SEQ_BLOCKS + 1) * 1e6


def build(num_blocks: int) -> tuple[float, float, float]:
    """(seconds to build KVCacheManager, pool bytes/block, pool+key-list bytes/block)."""
    gc.collect()
    start = time.perf_counter()
    manager = KVCacheManager(num_blocks, BLOCK_SIZE)
    seconds = time.perf_counter() - start
    del manager
    gc.collect()
    tracemalloc.start()
    pool = BlockPool(num_blocks)
    pool_bytes = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex(num_blocks)
    total_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del pool, index
    return seconds, pool_bytes / num_blocks, total_bytes / num_blocks


CHURNS = {
    "pool": churn_pool,
    "pool_calls": functools.partial(churn_pool, calls_only=True),
    "floor": churn_floor,
    "manager": churn_manager,
    "manager_calls": functools.partial(churn_manager, calls_only=True),
}


def churn_figures(sizes: list[int], args: argparse.Namespace) -> dict[int, dict[str, float]]:
    """Per size, each churn's microseconds per block: the median over `args.repeats` runs,
    each run taking every size in turn (`interleaved`)."""
    runs: dict[int, dict[str, list[float]]] = {n: {k: [] for k in CHURNS} for n in sizes}
    for r in range(args.repeats):
        for kind, make in CHURNS.items():
            chunks = {n: make(n, args.steps, args.seed + r) for n in sizes}
            for n, us in interleaved(chunks, args.turn).items():
                runs[n][kind].append(us)
    return {n: {f"{k}_us_per_block": statistics.median(v) for k, v in figures.items()}
            for n, figures in runs.items()}  # fmt: skip


def run_size(num_blocks: int, churns: dict[str, float], args: argparse.Namespace
             ) -> dict[str, float | int | None]:  # fmt: skip
    builds = [build(num_blocks) for _ in range(args.repeats)]
    hit_us, walk_us, free_us, busy_bytes = prefix_hit(num_blocks, args.hit_repeats, args.seed)
    scan_us, scan_steps = None, 0  # a budget of 0 leaves the scan baseline out
    if args.scan_budget > 0:
        scan_us, scan_steps = churn_scan(num_blocks, args.steps, args.seed, args.scan_budget)
    pool_us = churns["pool_us_per_block"]
    return {
        "num_blocks": num_blocks,
        **churns,
        "scan_us_per_block": scan_us,
        "scan_steps": scan_steps,
        "speedup_vs_scan": None if scan_us is None else scan_us / pool_us,
        "hit_us_per_block": hit_us,
        "hit_walk_us_per_block": walk_us,
        "hit_free_us_per_block": free_us,
        "build_s": statistics.median(b[0] for b in builds),
        "pool_bytes_per_block": builds[0][1],
        "pool_index_bytes_per_block": builds[0][2],
        "busy_pool_index_bytes_per_block": busy_bytes,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES))
    parser.add_argument("--steps", type=int, default=3000, help="churn steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure (median)")
    parser.add_argument("--hit-repeats", type=int, default=400, help="hits, half with spans")
    parser.add_argument("--scan-budget", type=float, default=3.0,
                        help="seconds of scan-baseline churn per size (0: none)")  # fmt: skip
    parser.add_argument("--turn", type=int, default=4, help="churn chunks per size per turn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench_block_pool", help="results file name")
    args = parser.parse_args(argv)
    churns, rows = churn_figures(args.sizes, args), []
    for num_blocks in args.sizes:
        rows.append(run_size(num_blocks, churns[num_blocks], args))
        print_table(rows[-1:])
    print()
    print_table(rows)
    flat = {
        key: max(r[key] for r in rows) / min(r[key] for r in rows)
        for key in (
            "pool_us_per_block",
            "pool_calls_us_per_block",
            "floor_us_per_block",
            "manager_us_per_block",
            "manager_calls_us_per_block",
            "hit_us_per_block",
        )
    }
    print("largest/smallest: " + ", ".join(f"{k} {v:.2f}x" for k, v in flat.items()))
    key, first = "manager_calls_us_per_block", rows[0]
    manager = {r["num_blocks"]: r[key] / first[key] for r in rows[1:]}
    print(f"manager calls over {first['num_blocks']:,} blocks: "
          + ", ".join(f"{n:,} {v:.2f}x" for n, v in manager.items()))  # fmt: skip
    results = {"rows": rows, "flatness": flat, "manager_calls_over_smallest": manager}
    path = write_results(args.out, config=vars(args), results=results)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
