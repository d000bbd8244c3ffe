"""Replay a workload against one KV allocation policy on a simulated clock.

Standard library only. One step of the clock, in order:

    1. arrivals    requests with arrival <= step join the FIFO queue; one that could never
                   fit, even alone, is rejected at once
    2. growth      every running request produces one token; a paged one that crosses a
                   block boundary takes a block, and if none is left the youngest running
                   request is preempted (its blocks freed, re-queued at the front, and its
                   tokens recomputed on readmission, as vLLM's recompute preemption does)
    3. admission   the queue head is admitted if its policy can place it (prompt + the one
                   token its prefill produces); if not, it and everything behind it wait
    4. sample      concurrency, reserved and held tokens, free and largest free region
    5. finish      requests holding prompt_len + output_len tokens release their memory

Nothing is tracked per token: a running request's length is a function of the step
(`Live.length`), the sums over requests are kept as aggregates, and a paged request is only
visited on the steps where it crosses a block boundary (every `block_size` steps).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from pagedkv.errors import OutOfBlocks
from pagedkv.sim.policies import ContiguousPolicy, Live, PagedPolicy
from pagedkv.sim.workload import Request

Policy = ContiguousPolicy | PagedPolicy
_MAX_STALL_EXAMPLES = 5
_MAX_SNAPSHOTS = 400


@dataclass
class Timeline:
    """What `--plot` draws: per-step memory use and sampled memory maps, in tokens."""

    capacity: int
    contiguous: bool  # free memory can be unusable only when allocations must be contiguous
    steps: list[int] = field(default_factory=list)
    reserved: list[int] = field(default_factory=list)
    held: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    # Every `snapshot_every` steps: (step, [(address, reserved tokens, tokens holding KV)],
    # tokens the queue head needs or 0): a free region smaller than that is a useless hole.
    snapshots: list[tuple[int, list[tuple[int, int, int]], int]] = field(default_factory=list)
    snapshot_every: int = 1


@dataclass
class PolicyResult:
    """Per-policy figures; fractions are of the policy's KV capacity unless said otherwise."""

    policy: str
    requests: int
    admitted: int  # ran, at once or after waiting
    queued: int  # waited at least one step before its first admission
    rejected: int  # could never fit, even alone
    preemptions: int
    steps: int  # simulated steps until the trace drained
    capacity_tokens: int
    peak_concurrency: int
    mean_concurrency: float  # over steps while anything is held
    mean_kv_utilization: float  # tokens held / tokens reserved, over steps while anything held
    mean_reserved: float  # reserved / capacity
    internal_fragmentation: float  # (reserved - held) / capacity
    external_fragmentation: float  # (free - largest free region) / capacity
    fragmentation_stalls: int  # steps the head waited although free in total >= its need
    fragmentation_stalled_requests: int
    stall_examples: list[dict[str, int]]
    mean_wait_steps: float  # first admission - arrival, over admitted requests
    manager_stats: dict[str, Any] = field(default_factory=dict)
    timeline: Timeline | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("timeline")
        return data


class _Run:
    """The state of one replay; `simulate` drives it."""

    def __init__(self, requests: list[Request], policy: Policy, record: bool) -> None:
        self.requests = sorted(enumerate(requests), key=lambda item: item[1].arrival)
        self.policy = policy
        self.bs = policy.block_size
        self.queue: deque[Live] = deque()
        self.running: dict[int, Live] = {}  # insertion order = admission order
        self.finishing: dict[int, list[Live]] = {}
        self.buckets: list[dict[int, Live]] = [{} for _ in range(self.bs)]
        self.first_admit: dict[int, int] = {}
        self.arrived: dict[int, int] = {}
        # Aggregates: held tokens = base + len(running) * step; tail = empty slots in the
        # last blocks of running paged sequences.
        self.base = self.tail = 0
        self.rejected = self.preemptions = self.next_arrival = 0
        self.stalls, self.stalled, self.examples = 0, set(), []
        self.active_steps = self.peak = 0
        self.sums = {"conc": 0.0, "util": 0.0, "reserved": 0.0, "internal": 0.0, "external": 0.0}
        self.timeline = Timeline(policy.capacity, not policy.grows_in_blocks) if record else None

    def done(self) -> bool:
        return self.next_arrival == len(self.requests) and not self.queue and not self.running

    def arrive(self, step: int) -> int:
        """Queue the arrivals up to `step`; jump over idle steps. Returns the step to run."""
        if not self.queue and not self.running:
            step = max(step, math.ceil(self.requests[self.next_arrival][1].arrival))
        while (
            self.next_arrival < len(self.requests)
            and self.requests[self.next_arrival][1].arrival <= step
        ):
            index, request = self.requests[self.next_arrival]
            self.next_arrival += 1
            if self.policy.never_fits(request):
                self.rejected += 1
            else:
                self.arrived[index] = step
                self.queue.append(Live(index, request, request.prompt_len, step))
        return step

    def grow(self, step: int) -> None:
        """Every running request produces a token; paged ones crossing a block boundary
        take a block, preempting the youngest request while none is free."""
        if not self.running or not self.policy.grows_in_blocks:
            return
        crossing = list(self.buckets[step % self.bs].values())
        # All grow at once in the aggregates; a preempted one is then removed at that length.
        self.tail += self.bs * len(crossing) - len(self.running)
        for live in crossing:
            while self.running.get(live.index) is live:
                try:
                    self.policy.grow(live, live.length(step))
                    break
                except OutOfBlocks:
                    self.preempt(self.running[next(reversed(self.running))], step)

    def preempt(self, live: Live, step: int) -> None:
        produced = live.length(step - 1)  # its token of this step is not produced
        self.remove(live, step)
        self.policy.release(live, produced)
        self.preemptions += 1
        self.queue.appendleft(Live(live.index, live.request, produced, step))

    def remove(self, live: Live, step: int) -> None:
        del self.running[live.index]
        self.base -= live.prompt_len + 1 - live.start
        if self.policy.grows_in_blocks:
            del self.buckets[live.bucket][live.index]
            self.tail -= -live.length(step) % self.bs

    def admit(self, step: int) -> None:
        """Admit from the queue head in FIFO order until the head does not fit."""
        while self.queue:
            live = self.queue[0]
            live.start = step
            if not self.policy.admit(live):
                self.stall(live, step)
                return
            self.queue.popleft()
            self.first_admit.setdefault(live.index, step)
            self.running[live.index] = live
            self.finishing.setdefault(live.finish_step, []).append(live)
            self.base += live.prompt_len + 1 - step
            if self.policy.grows_in_blocks:
                # It needs a block at the steps where its length before the step is a
                # multiple of block_size: step = start - prompt_len (mod block_size).
                live.bucket = (step - live.prompt_len) % self.bs
                self.buckets[live.bucket][live.index] = live
                self.tail += -live.length(step) % self.bs

    def stall(self, live: Live, step: int) -> None:
        need, free = self.policy.need_tokens(live), self.policy.free_tokens()
        if free < need:
            return
        self.stalls += 1
        if live.index in self.stalled:
            return
        self.stalled.add(live.index)
        if len(self.examples) < _MAX_STALL_EXAMPLES:  # the first step of each stalled request
            self.examples.append(
                {
                    "step": step,
                    "request": live.index,
                    "need_tokens": need,
                    "free_tokens": free,
                    "largest_free_tokens": self.policy.largest_free_tokens(),
                }
            )

    def sample(self, step: int) -> None:
        n = len(self.running)
        reserved = self.policy.reserved_tokens()
        held = self.base + n * step
        if self.policy.grows_in_blocks:
            held = reserved - self.tail  # physical: a shared block counts once
        if self.timeline is not None:
            self.record(step, reserved, held, n)
        if reserved == 0:
            return
        capacity = self.policy.capacity
        free = self.policy.free_tokens()
        self.active_steps += 1
        self.peak = max(self.peak, n)
        sums = self.sums
        sums["conc"] += n
        sums["util"] += held / reserved
        sums["reserved"] += reserved / capacity
        sums["internal"] += (reserved - held) / capacity
        sums["external"] += (free - self.policy.largest_free_tokens()) / capacity

    def record(self, step: int, reserved: int, held: int, running: int) -> None:
        timeline = self.timeline
        timeline.steps.append(step)
        timeline.running.append(running)
        timeline.reserved.append(reserved)
        timeline.held.append(held)
        if step % timeline.snapshot_every == 0:
            lives = list(self.running.values())
            need = self.policy.need_tokens(self.queue[0]) if self.queue else 0
            timeline.snapshots.append((step, self.policy.regions(lives, step), need))
            if len(timeline.snapshots) > _MAX_SNAPSHOTS:
                # Keep every other snapshot and sample half as often from now on.
                timeline.snapshot_every *= 2
                timeline.snapshots = [
                    s for s in timeline.snapshots if s[0] % timeline.snapshot_every == 0
                ]

    def finish(self, step: int) -> None:
        for live in self.finishing.pop(step, ()):
            if self.running.get(live.index) is live:
                self.remove(live, step)
                self.policy.release(live, live.request.total_len)

    def result(self, steps: int) -> PolicyResult:
        active = max(1, self.active_steps)
        mean = {k: v / active for k, v in self.sums.items()}
        waits = [self.first_admit[i] - self.arrived[i] for i in self.first_admit]
        return PolicyResult(
            policy=self.policy.name,
            requests=len(self.requests),
            admitted=len(self.first_admit),
            queued=sum(w > 0 for w in waits),
            rejected=self.rejected,
            preemptions=self.preemptions,
            steps=steps,
            capacity_tokens=self.policy.capacity,
            peak_concurrency=self.peak,
            mean_concurrency=mean["conc"],
            mean_kv_utilization=mean["util"],
            mean_reserved=mean["reserved"],
            internal_fragmentation=mean["internal"],
            external_fragmentation=mean["external"],
            fragmentation_stalls=self.stalls,
            fragmentation_stalled_requests=len(self.stalled),
            stall_examples=self.examples,
            mean_wait_steps=sum(waits) / max(1, len(waits)),
            manager_stats=self.policy.manager_stats(),
            timeline=self.timeline,
        )


def simulate(
    requests: list[Request], policy: Policy, *, record: bool = False, snapshot_every: int = 1
) -> PolicyResult:
    """Replay `requests` against `policy` until every request has finished or been rejected.

    Args:
        requests: the workload, in any order (replayed by arrival, ties in list order).
        policy: a fresh policy from `create_policy` (it is used up by the run).
        record: keep a `Timeline` for plots (per-step memory use and sampled memory maps).
        snapshot_every: steps between memory-map snapshots (doubled past 400 snapshots).

    Returns:
        The policy's figures; `admitted + rejected == len(requests)`.

    Raises:
        ValueError: an empty workload.
    """
    if not requests:
        raise ValueError("requests: expected at least one request, got none")
    run = _Run(requests, policy, record)
    if run.timeline is not None:
        run.timeline.snapshot_every = max(1, snapshot_every)
    step = 0
    while not run.done():
        step = run.arrive(step)
        run.grow(step)
        run.admit(step)
        if not run.running and run.queue:
            # With nothing running every block is free, so the head must fit.
            raise AssertionError(
                f"{policy.name}: request {run.queue[0].index} cannot be "
                f"admitted into an empty cache"
            )
        run.sample(step)
        run.finish(step)
        step += 1
    return run.result(step)
