"""What a simulated replay reports: per-policy figures and, for plots, a timeline; and
`Replay`, the part of a replay the contiguous (`simulator`) and paged (`paged`) ones share.

Standard library only. The clock counts steps of the contiguous policies (one token per
running request per step); a paged step takes `StepCost.time(batched tokens)` of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from pagedkv.sim.policies import Policy
from pagedkv.sim.workload import Request

_MAX_SNAPSHOTS = 400
Regions = list[tuple[int, int, int]]  # (address, reserved tokens, tokens holding KV)


@dataclass
class Timeline:
    """What `--plot` draws: per-step memory use and sampled memory maps, in tokens."""

    capacity: int
    steps: list[float] = field(default_factory=list)  # the clock at each step
    reserved: list[int] = field(default_factory=list)
    held: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    # Every `snapshot_every` steps: (clock, regions, tokens the queue head needs, 0 when any
    # free memory serves it as in the paged policies): a smaller free region is a useless hole.
    snapshots: list[tuple[float, Regions, int]] = field(default_factory=list)
    snapshot_every: int = 1
    _snapshot_steps: list[int] = field(default_factory=list, repr=False)

    def record(
        self,
        step: int,
        clock: float,
        totals: tuple[int, int, int],
        memory_map: Callable[[], tuple[Regions, int]],
    ) -> None:
        """Append step number `step`'s totals (reserved, held, running) at `clock`.

        Every `snapshot_every` steps `memory_map()` gives a snapshot (regions, tokens the
        queue head needs); past 400 snapshots every other one is dropped and the interval
        doubles.
        """
        reserved, held, running = totals
        self.steps.append(clock)
        self.reserved.append(reserved)
        self.held.append(held)
        self.running.append(running)
        if step % self.snapshot_every:
            return
        regions, need = memory_map()
        self.snapshots.append((clock, regions, need))
        self._snapshot_steps.append(step)
        if len(self.snapshots) > _MAX_SNAPSHOTS:
            self.snapshot_every *= 2
            keep = [i for i, s in enumerate(self._snapshot_steps) if s % self.snapshot_every == 0]
            self.snapshots = [self.snapshots[i] for i in keep]
            self._snapshot_steps = [self._snapshot_steps[i] for i in keep]


@dataclass
class StepSums:
    """Per-step figures summed over the steps with anything reserved, for the means."""

    capacity: int
    active_steps: int = 0
    peak: int = 0
    concurrency: float = 0.0
    utilization: float = 0.0
    reserved: float = 0.0
    internal: float = 0.0
    external: float = 0.0

    def add(self, running: int, reserved: int, held: int, free: int, largest_free: int) -> None:
        """One step: running requests and tokens reserved, held, free, in the largest free
        region. Steps with nothing reserved do not count."""
        if reserved == 0:
            return
        capacity = self.capacity
        self.active_steps += 1
        self.peak = max(self.peak, running)
        self.concurrency += running
        self.utilization += held / reserved
        self.reserved += reserved / capacity
        self.internal += (reserved - held) / capacity
        self.external += (free - largest_free) / capacity

    def means(self) -> dict[str, Any]:
        """PolicyResult's keyword arguments for the mean figures and the peak."""
        n = max(1, self.active_steps)
        return {
            "peak_concurrency": self.peak,
            "mean_concurrency": self.concurrency / n,
            "mean_kv_utilization": self.utilization / n,
            "mean_reserved": self.reserved / n,
            "internal_fragmentation": self.internal / n,
            "external_fragmentation": self.external / n,
        }


@dataclass
class PolicyResult:
    """Per-policy figures; fractions are of the policy's KV capacity unless said otherwise."""

    policy: str
    requests: int
    admitted: int  # ran, at once or after waiting
    queued: int  # waited at least one step before its first admission
    rejected: int  # could never fit, even alone
    preemptions: int
    steps: int  # the clock (rounded up) when the trace drained
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
    mean_wait_steps: float  # first admission - arrival on the clock, over admitted requests
    engine_steps: int = 0  # paged: scheduler steps run (contiguous: 0, one step per clock unit)
    manager_stats: dict[str, Any] = field(default_factory=dict)
    timeline: Timeline | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("timeline")
        return data


class Replay:
    """One replay's requests in arrival order, its rejections and its figures."""

    def __init__(
        self, requests: list[Request], policy: Policy, record: bool, snapshot_every: int
    ) -> None:
        self.requests = sorted(enumerate(requests), key=lambda item: item[1].arrival)
        self.policy = policy
        self.next_arrival = self.rejected = 0
        # Request id -> (step, clock) of its arrival, and of its first step running.
        self.arrived: dict[object, tuple[int, float]] = {}
        self.first_run: dict[object, tuple[int, float]] = {}
        self.sums = StepSums(policy.capacity)
        self.timeline = (
            Timeline(policy.capacity, snapshot_every=max(1, snapshot_every)) if record else None
        )

    def arrivals(self, clock: float) -> Iterator[tuple[int, Request]]:
        """(workload index, request) of each request arrived by `clock`, in arrival order;
        one that could never fit, even alone, is rejected instead."""
        requests = self.requests
        while self.next_arrival < len(requests) and requests[self.next_arrival][1].arrival <= clock:
            index, request = requests[self.next_arrival]
            self.next_arrival += 1
            if self.policy.never_fits(request):
                self.rejected += 1
            else:
                yield index, request

    def policy_result(self, **figures: Any) -> PolicyResult:
        """The run's `PolicyResult`; `figures` are the fields only the caller knows."""
        first, arrived = self.first_run, self.arrived
        waits = [first[i][1] - arrived[i][1] for i in first]
        return PolicyResult(
            policy=self.policy.name,
            requests=len(self.requests),
            admitted=len(first),
            queued=sum(first[i][0] > arrived[i][0] for i in first),
            rejected=self.rejected,
            capacity_tokens=self.policy.capacity,
            mean_wait_steps=sum(waits) / max(1, len(waits)),
            timeline=self.timeline,
            **self.sums.means(),
            **figures,
        )
