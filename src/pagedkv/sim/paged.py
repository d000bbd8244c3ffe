"""Paged policies: the engine's own `Scheduler` and `KVCacheManager` on a simulated clock.

Standard library only (the scheduler and the manager import no torch). In place of the
`ModelRunner`, a stand-in executes each `SchedulerOutput`: a cost model gives the step's
time, and every sampled token is the request's own token id at its position, never EOS
(requests run with `ignore_eos` and `max_tokens = output_len`, so their lengths are those
of the workload). Everything else is the engine's code, so admissions, chunked prefill,
the decode-first token budget, the watermark, preemptions and prefix hits are the engine's.

One iteration:

    1. arrivals   requests with arrival <= clock go to `Scheduler.add_request` in arrival
                  order; one whose prompt + output can never fit the pool is rejected
    2. schedule   `Scheduler.schedule()`
    3. run        the stand-in runner samples; the figures are taken (the manager now
                  holds the KV this step computes)
    4. update     `Scheduler.update()` appends the tokens and ends finished requests
    5. clock      += `StepCost.time(batched tokens)`

When nothing is running or waiting, the clock jumps to the next arrival. Token ids live
in disjoint ranges: request i's own tokens at (2i + 1) << 32 | position, prefix group g's
shared ones at (2g + 2) << 32 | position, so blocks are shared only through the prefix
cache, and only within a prefix group (or a request's own recomputed tokens). A replay uses
a smaller `id_shift` when the ids then fit in int32, as a tokenizer's do
(`int32_id_shift`): the prefix index keys a block of int32 ids as packed bytes and other
ids on a slower path the engine never takes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from pagedkv.engine.request import Request as EngineRequest
from pagedkv.engine.request import SeqId, Sequence
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.scheduler import Scheduler, SchedulerOutput
from pagedkv.engine.scheduler_output import sample_ids
from pagedkv.sim.policies import PagedPolicy, StepCost
from pagedkv.sim.results import PolicyResult, Regions, Replay
from pagedkv.sim.workload import Request

_ID_SHIFT = 32


def token_ids(
    index: int, request: Request, lo: int, hi: int, *, id_shift: int = _ID_SHIFT
) -> list[int]:
    """Request `index`'s token ids at positions [lo, hi) (prompt and generated alike).

    `id_shift`: the bits that hold the position; ids stay distinct while every position is
    below ``2 ** id_shift``.
    """
    own = ((2 * index + 1) << id_shift) + lo
    shared = max(0, min(hi, request.prefix_len) - lo)  # a prefix_len has a prefix_group
    group = ((2 * (request.prefix_group or 0) + 2) << id_shift) + lo
    return list(range(group, group + shared)) + list(range(own + shared, own + hi - lo))


def int32_id_shift(requests: list[Request]) -> int:
    """The position bits of `token_ids` for `requests`: as few as hold every position, if
    the ids then fit in int32; else 32."""
    max_len = max(r.total_len for r in requests)
    shift = max_len.bit_length()
    top = max(2 * len(requests) - 1, 2 * max(r.prefix_group or 0 for r in requests) + 2)
    return shift if (top << shift) + max_len < 2**31 else _ID_SHIFT


class StandInRunner:
    """Executes a `SchedulerOutput` without a model (the request id is the workload index)."""

    def __init__(self, cost: StepCost, *, id_shift: int = _ID_SHIFT) -> None:
        self.cost = cost
        self.id_shift = id_shift  # as given to `token_ids` for the prompts

    def execute(self, step: SchedulerOutput) -> dict[SeqId, int]:
        """Per sampled id, the request's own token id at the new token's position."""
        shift = self.id_shift

        def own_token(seq_id: SeqId, position: int) -> int:  # as `token_ids` numbers them
            return ((2 * int(seq_id[0]) + 1) << shift) + position

        sampled: dict[SeqId, int] = {}
        rows = zip(step.seq_ids, step.start_pos, step.query_lens, step.num_samples, strict=True)
        for seq_id, start, num, num_samples in rows:
            if num_samples == 1:
                sampled[seq_id] = own_token(seq_id, start + num)
            elif num_samples:
                for sample_id in sample_ids(seq_id, num_samples):
                    sampled[sample_id] = own_token(sample_id, start + num)
        return sampled


class _Replay(Replay):
    """The state of one paged replay; `replay` drives it."""

    policy: PagedPolicy

    def __init__(
        self, requests: list[Request], policy: PagedPolicy, record: bool, snapshot_every: int
    ) -> None:
        super().__init__(requests, policy, record, snapshot_every)
        self.manager = policy.manager
        self.scheduler = Scheduler(
            policy.scheduler_config,
            policy.manager,
            max_model_len=max(r.total_len for r in requests),
        )
        self.id_shift = int32_id_shift(requests)
        self.runner = StandInRunner(policy.step_cost, id_shift=self.id_shift)
        self.clock = 0.0
        self.num_steps = 0

    def has_work(self) -> bool:
        return self.next_arrival < len(self.requests) or self.scheduler.has_unfinished_requests()

    def arrive(self) -> None:
        """Hand the arrivals up to the clock to the scheduler; jump over idle time."""
        if not self.scheduler.has_unfinished_requests():
            self.clock = max(self.clock, self.requests[self.next_arrival][1].arrival)
        for index, request in self.arrivals(self.clock):
            params = SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=True)
            prompt = token_ids(index, request, 0, request.prompt_len, id_shift=self.id_shift)
            engine_request = EngineRequest(
                str(index), prompt, params, arrival_time=self.clock, arrival_index=self.next_arrival
            )
            self.scheduler.add_request(engine_request)
            self.arrived[str(index)] = (self.num_steps, self.clock)

    def step(self, on_step: Callable[[SchedulerOutput], None] | None) -> None:
        """One engine step: schedule, run, sample the figures, update, advance the clock."""
        step = self.scheduler.schedule()
        if step.is_empty and not step.finished_request_ids:
            raise AssertionError(f"{self.policy.name}: the scheduler made no progress")
        for seq_id in step.seq_ids:
            self.first_run.setdefault(seq_id[0], (self.num_steps, self.clock))
        sampled = self.runner.execute(step)
        if on_step is not None:
            on_step(step)
        self.sample()
        self.scheduler.update(step, sampled)
        self.clock += self.runner.cost.time(step.num_batched_tokens)
        self.num_steps += 1

    def sample(self) -> None:
        bs = self.policy.block_size
        free = self.manager.num_free_blocks * bs
        reserved = self.policy.capacity - free
        # Only a sequence's last block can be partly filled: shared prefix blocks are full.
        empty = self.manager.num_groups * sum(-s.num_computed % bs for s in self._resident_seqs())
        running = self.scheduler.num_running
        if self.timeline is not None:
            totals = (reserved, reserved - empty, running)
            self.timeline.record(self.num_steps, self.clock, totals, self.memory_map)
        self.sums.add(running, reserved, reserved - empty, free, free)

    def _resident_seqs(self) -> list[Sequence]:
        return [s for r in self.scheduler.running for s in r.seqs if s.is_allocated]

    def memory_map(self) -> tuple[Regions, int]:
        """Per resident sequence its blocks as (address, block_size, tokens held); a shared
        block appears once per holder. No need: any free block serves any sequence."""
        bs, regions, num_groups = self.policy.block_size, [], self.manager.num_groups
        for seq in self._resident_seqs():
            for i, block in enumerate(self.manager.block_table(seq.seq_id)):
                if block < 0:  # slid out of its group's window: back in the pool
                    continue
                held = seq.num_computed - i // num_groups * bs
                regions.append((block * bs, bs, max(0, min(bs, held))))
        return regions, 0

    def result(self) -> PolicyResult:
        return self.policy_result(
            preemptions=self.scheduler.num_preemptions,
            steps=math.ceil(self.clock),
            fragmentation_stalls=0,  # any free block serves any sequence
            fragmentation_stalled_requests=0,
            stall_examples=[],
            engine_steps=self.num_steps,
            manager_stats=dict(self.manager.stats()),
        )


def replay(
    requests: list[Request],
    policy: PagedPolicy,
    *,
    record: bool = False,
    snapshot_every: int = 1,
    on_step: Callable[[SchedulerOutput], None] | None = None,
    progress: Callable[[int], None] | None = None,
) -> PolicyResult:
    """`simulate` for a paged policy: replay `requests` (at least one) through the engine's
    scheduler until every one finished or was rejected.

    The timeline's `steps` are the clock at each engine step, `snapshot_every` counts engine
    steps, `on_step` is called with each step's `SchedulerOutput` before its update, and
    `progress` with the number of requests done (finished or rejected) after each step.
    """
    run = _Replay(requests, policy, record, snapshot_every)
    while run.has_work():
        run.arrive()
        if run.scheduler.has_unfinished_requests():
            run.step(on_step)
        if progress is not None:
            progress(run.next_arrival - len(run.scheduler.requests))
    return run.result()
