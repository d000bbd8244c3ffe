"""The scheduler and the KV manager's time per step, with many sequences and a large pool.

1,024 sequences run at once (prompts of 256-320 tokens whose first 240 each group of 32
requests shares through the prefix cache), on pools of 10K to 1M blocks: the same work
in every pool, sized so that the smallest holds it. A stand-in runner
(`pagedkv.sim.paged.StandInRunner`) samples each sequence's own next token id, so no model
runs and the time is that of `Scheduler.schedule()` + `Scheduler.update()` alone: the
engine's own code, with the `KVCacheManager` under it. Standard library only. Token ids
are int32, as a tokenizer's are (`int32_id_shift`): the prefix index keys a block of
int32 ids as packed bytes and other ids on a slower path the engine never takes.

Figures: milliseconds per steady decode step (every sequence admitted, one token each; a
new block every `block_size` steps), median and 90th percentile over the measured steps
(with the medians of `schedule()` and `update()` alone; the stand-in runner between them
is not timed), and the ratio of the largest pool's median to the smallest's. The
bookkeeping a pool of n blocks carries is O(n); the work of a step must not be.

Every pool is built first, then timed `--turn` steps at a time in turn: on a shared VM
whose speed drifts by 2-3x within seconds, pools timed one after the other would each get
a different machine, and the ratio between them would measure the drift. Taking turns
gives every pool the same mix of slow and fast moments.

    python benchmarks/bench_scheduler.py                    # 10K, 100K, 1M blocks
    python benchmarks/bench_scheduler.py --pools 1000000 --steps 100
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from pathlib import Path
from typing import Any

from _common import print_table, write_results  # (benchmarks/ is on sys.path)

from pagedkv.config import SchedulerConfig
from pagedkv.engine.request import Request as EngineRequest
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.scheduler import Scheduler
from pagedkv.memory import KVCacheManager
from pagedkv.sim.paged import StandInRunner, int32_id_shift, token_ids
from pagedkv.sim.policies import StepCost
from pagedkv.sim.workload import Request

BLOCK_SIZE = 16


def make_requests(num: int, seed: int, *, group_size: int = 32) -> list[Request]:
    """`num` requests of 256-320 prompt tokens; each group of `group_size` shares its first
    240 (the prefix cache hits on them); outputs long enough to outlast the run."""
    rng = random.Random(seed)
    return [
        Request(
            arrival=0.0,
            prompt_len=rng.randint(256, 320),
            output_len=4096,
            prefix_group=i // group_size,
            prefix_len=240,
        )
        for i in range(num)
    ]


class Pool:
    """One pool's scheduler with every request admitted, timed a few steps at a time."""

    def __init__(self, num_blocks: int, num_seqs: int, seed: int) -> None:
        """Admit `num_seqs` requests into a pool of `num_blocks` (every prompt computed)."""
        self.num_blocks, self.num_seqs = num_blocks, num_seqs
        self.manager = KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=True)
        requests = make_requests(num_seqs, seed)
        self.id_shift = int32_id_shift(requests)
        config = SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=32768)
        self.scheduler = scheduler = Scheduler(
            config, self.manager, max_model_len=max(r.total_len for r in requests)
        )
        self.runner = StandInRunner(StepCost(), id_shift=self.id_shift)
        for index, request in enumerate(requests):
            params = SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=True)
            prompt = token_ids(index, request, 0, request.prompt_len, id_shift=self.id_shift)
            scheduler.add_request(
                EngineRequest(str(index), prompt, params, arrival_time=0.0, arrival_index=index)
            )
        self.admission_steps = 0
        while scheduler.num_waiting or any(
            r.seqs[0].num_computed < len(r.prompt_token_ids) for r in scheduler.running
        ):
            step = scheduler.schedule()
            scheduler.update(step, self.runner.execute(step))
            self.admission_steps += 1
        self.times: list[tuple[float, float]] = []  # (schedule, update) per timed step

    def time_steps(self, steps: int) -> None:
        """Time `steps` decode steps (the caller turns the garbage collector off)."""
        scheduler, runner, num_seqs = self.scheduler, self.runner, self.num_seqs
        for _ in range(steps):
            t0 = time.perf_counter()
            step = scheduler.schedule()
            t1 = time.perf_counter()
            sampled = runner.execute(step)  # the stand-in for the model: not timed
            t2 = time.perf_counter()
            scheduler.update(step, sampled)
            t3 = time.perf_counter()
            self.times.append((t1 - t0, t3 - t2))
            assert step.num_rows == num_seqs, f"expected {num_seqs} running, got {step.num_rows}"

    def result(self) -> dict[str, Any]:
        times, stats = self.times, self.manager.stats()
        ms = sorted((a + b) * 1e3 for a, b in times)
        return {
            "num_blocks": self.num_blocks,
            "num_seqs": self.num_seqs,
            "admission_steps": self.admission_steps,
            "steps": len(times),
            "median_ms": statistics.median(ms),
            "p90_ms": ms[int(0.9 * (len(ms) - 1))],
            "schedule_ms": statistics.median(a * 1e3 for a, _ in times),
            "update_ms": statistics.median(b * 1e3 for _, b in times),
            "used_blocks": self.num_blocks - self.manager.num_free_blocks,
            "prefix_cache_hits": stats.get("prefix_cache_hits"),
            "id_shift": self.id_shift,
        }


def run_pools(
    pool_sizes: list[int], num_seqs: int, steps: int, seed: int, turn: int
) -> list[dict[str, Any]]:
    """Build every pool, then time `steps` decode steps of each, `turn` steps at a time
    in turn (forward, then backward), so that a machine slower for a while slows every
    pool alike."""
    pools = [Pool(n, num_seqs, seed) for n in pool_sizes]
    gc.collect()
    gc.disable()  # a collection inside a timed step would be noise, not the step's work
    try:
        for round_index in range(-(-steps // turn)):
            for pool in pools if round_index % 2 == 0 else pools[::-1]:
                pool.time_steps(min(turn, steps - len(pool.times)))
    finally:
        gc.enable()
    return [pool.result() for pool in pools]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--pools", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--num-seqs", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps per pool")
    parser.add_argument("--turn", type=int, default=8, help="steps per pool per turn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="JSON path (default: results/)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = run_pools(args.pools, args.num_seqs, args.steps, args.seed, args.turn)
    print_table(rows, ["num_blocks", "num_seqs", "steps", "median_ms", "p90_ms", "schedule_ms",
                       "update_ms", "used_blocks", "prefix_cache_hits"])  # fmt: skip
    ratio = rows[-1]["median_ms"] / rows[0]["median_ms"]
    print(f"largest / smallest pool: {ratio:.2f}x (median ms per step)")
    out = Path(args.output) if args.output else None
    path = write_results(
        out.stem if out else "bench_scheduler",
        config=vars(args) | {"block_size": BLOCK_SIZE},
        results={"pools": rows, "largest_over_smallest": ratio},
        out_dir=out.parent if out else None,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
