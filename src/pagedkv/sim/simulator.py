"""Replay a workload against one KV allocation policy on a simulated clock.

Standard library only. Paged policies run the engine's own scheduler (`paged.replay`);
the contiguous ones run here, one step of the clock in this order:

    1. arrivals    requests with arrival <= step join the FIFO queue; one that could never
                   fit, even alone, is rejected at once
    2. admission   the queue head is admitted if its policy can place it (its whole
                   reservation); if not, it and everything behind it wait
    3. sample      concurrency, reserved and held tokens, free and largest free region
    4. finish      requests holding prompt_len + output_len tokens release their memory

Every running request produces one token per step. Nothing is tracked per token: a running
request's length is a function of the step (`Live.length`) and the sum over requests is
kept as an aggregate.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

from pagedkv.sim import paged
from pagedkv.sim.policies import ContiguousPolicy, Live, PagedPolicy, Policy
from pagedkv.sim.results import PolicyResult, Regions, Replay, Timeline
from pagedkv.sim.workload import Request

__all__ = ["PolicyResult", "Timeline", "simulate"]

_MAX_STALL_EXAMPLES = 5


class _Run(Replay):
    """The state of one contiguous replay; `simulate` drives it."""

    policy: ContiguousPolicy

    def __init__(
        self, requests: list[Request], policy: ContiguousPolicy, record: bool, snapshot_every: int
    ) -> None:
        super().__init__(requests, policy, record, snapshot_every)
        self.queue: deque[Live] = deque()
        self.running: dict[int, Live] = {}  # insertion order = admission order
        self.finishing: dict[int, list[Live]] = {}
        # Aggregate: held tokens = base + len(running) * step.
        self.base = 0
        self.stalls = 0
        self.stalled: set[int] = set()
        self.examples: list[dict[str, int]] = []

    def done(self) -> bool:
        return self.next_arrival == len(self.requests) and not self.queue and not self.running

    def arrive(self, step: int) -> int:
        """Queue the arrivals up to `step`; jump over idle steps. Returns the step to run."""
        if not self.queue and not self.running:
            step = max(step, math.ceil(self.requests[self.next_arrival][1].arrival))
        for index, request in self.arrivals(step):
            self.arrived[index] = (step, step)
            self.queue.append(Live(index, request, step))
        return step

    def admit(self, step: int) -> None:
        """Admit from the queue head in FIFO order until the head does not fit."""
        while self.queue:
            live = self.queue[0]
            live.start = step
            if not self.policy.admit(live):
                self.stall(live, step)
                return
            self.queue.popleft()
            self.first_run.setdefault(live.index, (step, step))
            self.running[live.index] = live
            self.finishing.setdefault(live.finish_step, []).append(live)
            self.base += live.request.prompt_len + 1 - step

    def stall(self, live: Live, step: int) -> None:
        need, free = self.policy.size(live.request), self.policy.free_tokens()
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
        reserved = self.policy.reserved
        held = self.base + n * step
        if self.timeline is not None:
            self.timeline.record(step, step, (reserved, held, n), lambda: self.memory_map(step))
        free = self.policy.free_tokens()
        self.sums.add(n, reserved, held, free, self.policy.largest_free_tokens())

    def memory_map(self, step: int) -> tuple[Regions, int]:
        need = self.policy.size(self.queue[0].request) if self.queue else 0
        return [(v.addr, v.reserved, v.length(step)) for v in self.running.values()], need

    def finish(self, step: int) -> None:
        for live in self.finishing.pop(step, ()):  # no preemption: each one is running
            del self.running[live.index]
            self.base -= live.request.prompt_len + 1 - live.start
            self.policy.release(live)

    def result(self, steps: int) -> PolicyResult:
        return self.policy_result(
            preemptions=0,
            steps=steps,
            fragmentation_stalls=self.stalls,
            fragmentation_stalled_requests=len(self.stalled),
            stall_examples=self.examples,
        )


def simulate(
    requests: list[Request],
    policy: Policy,
    *,
    record: bool = False,
    snapshot_every: int = 1,
    progress: Callable[[int], None] | None = None,
) -> PolicyResult:
    """Replay `requests` against `policy` until every request has finished or been rejected.

    Args:
        requests: the workload, in any order (replayed by arrival, ties in list order).
        policy: a fresh policy from `create_policy` (it is used up by the run).
        record: keep a `Timeline` for plots (per-step memory use and sampled memory maps).
        snapshot_every: steps between memory-map snapshots (doubled past 400 snapshots).
        progress: called with the number of requests done (finished or rejected) as the
            replay goes.

    Returns:
        The policy's figures; `admitted + rejected == len(requests)`.

    Raises:
        ValueError: an empty workload.
    """
    if not requests:
        raise ValueError("requests: expected at least one request, got none")
    if isinstance(policy, PagedPolicy):
        return paged.replay(
            requests, policy, record=record, snapshot_every=snapshot_every, progress=progress
        )
    run = _Run(requests, policy, record, snapshot_every)
    step = 0
    while not run.done():
        step = run.arrive(step)
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
        if progress is not None:
            progress(run.next_arrival - len(run.queue) - len(run.running))
    return run.result(step)
