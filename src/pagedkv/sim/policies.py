"""KV allocation policies the simulator compares, all measured in tokens.

Standard library only. The two contiguous policies place each request in one address range
of a token-addressed arena; the two paged ones run the engine's own `Scheduler` over
pagedkv's `KVCacheManager` (imported when a paged policy is built), which never needs
contiguity.

Contiguous arena (first fit, free list sorted by address, neighbours coalesced on release):

    address 0                                                        capacity
    |[ req 3 ......... ]|  hole  |[ req 7 .. ]|      hole      |[ req 9 ]|
                         ^ a request larger than every hole waits here, even if
                           the holes together could hold it (external fragmentation)
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from pagedkv.config import SchedulerConfig
from pagedkv.sim.workload import Request

POLICIES = ("contiguous-max", "contiguous-first-fit", "paged", "paged-prefix")


@dataclass(slots=True)
class Live:
    """One admission of a request into a contiguous arena."""

    index: int
    request: Request
    start: int  # admission step; the admission step already produces one token
    addr: int = -1  # first token's address
    reserved: int = 0  # tokens reserved

    def length(self, step: int) -> int:
        """Tokens held at the end of `step` (one more per step since admission)."""
        return self.request.prompt_len + 1 + step - self.start

    @property
    def finish_step(self) -> int:
        return self.start + self.request.output_len - 1


class ContiguousPolicy:
    """Each request reserves one address range: its exact final size, or `max_len` tokens."""

    def __init__(self, name: str, capacity: int, max_len: int | None = None) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity: expected > 0 tokens, got {capacity}")
        self.name = name
        self.capacity = capacity
        self.max_len = max_len
        self._starts = [0]  # free holes, sorted by address
        self._sizes = [capacity]
        self.reserved = 0  # tokens

    def size(self, request: Request) -> int:
        return request.total_len if self.max_len is None else self.max_len

    def never_fits(self, request: Request) -> bool:
        size = self.size(request)
        return size > self.capacity or request.total_len > size

    def free_tokens(self) -> int:
        return self.capacity - self.reserved

    def largest_free_tokens(self) -> int:
        return max(self._sizes, default=0)

    def admit(self, live: Live) -> bool:
        need = self.size(live.request)
        sizes = self._sizes
        i = next((i for i, s in enumerate(sizes) if s >= need), -1)
        if i < 0:
            return False
        live.addr, live.reserved = self._starts[i], need
        if sizes[i] == need:
            del self._starts[i], sizes[i]
        else:
            self._starts[i] += need
            sizes[i] -= need
        self.reserved += need
        return True

    def release(self, live: Live) -> None:
        start, size = live.addr, live.reserved
        starts, sizes = self._starts, self._sizes
        i = bisect.bisect_left(starts, start)
        # Coalesce with the hole ending at `start` and the one beginning at its end.
        if i < len(starts) and starts[i] == start + size:
            size += sizes[i]
            del starts[i], sizes[i]
        if i > 0 and starts[i - 1] + sizes[i - 1] == start:
            sizes[i - 1] += size
        else:
            starts.insert(i, start)
            sizes.insert(i, size)
        self.reserved -= live.reserved


@dataclass(frozen=True)
class StepCost:
    """The stand-in runner's cost model: one paged step takes `fixed + per_token x batched
    tokens` clock units (one unit = one step of the contiguous policies).

    Raises:
        ValueError: a negative or non-finite term, or a step that would take no time.
    """

    fixed: float = 1.0
    per_token: float = 0.0

    def __post_init__(self) -> None:
        for name in ("fixed", "per_token"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}: expected a finite number >= 0, got {value!r}")
        if self.fixed + self.per_token <= 0:
            raise ValueError(
                f"step cost: expected fixed + per_token > 0, got {self.fixed} + {self.per_token}"
            )

    def time(self, num_batched_tokens: int) -> float:
        """Clock units one step of `num_batched_tokens` tokens takes."""
        return self.fixed + self.per_token * num_batched_tokens


class PagedPolicy:
    """The engine's own `Scheduler` over pagedkv's `KVCacheManager` (see `sim/paged.py`).

    With `prefix_caching`, prompts of one prefix group share their full blocks. `windows`:
    the model's KV cache groups (`pagedkv.memory.groups`), one block table each; a block
    covers the layers of one group.
    """

    def __init__(
        self,
        name: str,
        num_blocks: int,
        block_size: int,
        prefix_caching: bool,
        scheduler: SchedulerConfig | None = None,
        step_cost: StepCost | None = None,
        windows: tuple[int | None, ...] = (None,),
    ) -> None:
        from pagedkv.memory import KVCacheManager

        self.name = name
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.capacity = num_blocks * block_size
        self.scheduler_config = scheduler if scheduler is not None else SchedulerConfig()
        self.step_cost = step_cost if step_cost is not None else StepCost()
        self.manager = KVCacheManager(
            num_blocks, block_size, enable_prefix_caching=prefix_caching, windows=windows
        )
        self.windows = windows

    def never_fits(self, request: Request) -> bool:
        """Whether the request cannot complete even alone in the pool (every group's blocks:
        all of them, at most the window's and one chunk's in a sliding group)."""
        return -(-request.total_len // self.block_size) * len(self.windows) > self.num_blocks


Policy = ContiguousPolicy | PagedPolicy


def create_policy(
    name: str,
    *,
    capacity_tokens: int,
    num_blocks: int,
    block_size: int,
    max_len: int,
    scheduler: SchedulerConfig | None = None,
    step_cost: StepCost | None = None,
    windows: tuple[int | None, ...] = (None,),
) -> Policy:
    """Build a policy by name.

    Args:
        capacity_tokens: tokens the KV memory holds (contiguous policies).
        num_blocks: blocks the KV memory holds (paged policies).
        max_len: tokens `contiguous-max` reserves per request.
        scheduler: the paged policies' batch limits (default `SchedulerConfig()`).
        step_cost: the paged policies' time per step (default one clock unit).
        windows: the paged policies' KV cache groups (their windows).

    Raises:
        ValueError: an unknown policy name.
    """
    if name == "contiguous-max":
        return ContiguousPolicy(name, capacity_tokens, max_len)
    if name == "contiguous-first-fit":
        return ContiguousPolicy(name, capacity_tokens)
    if name in ("paged", "paged-prefix"):
        if num_blocks <= 0:
            raise ValueError(f"KV memory: expected room for at least one block, got {num_blocks}")
        return PagedPolicy(
            name, num_blocks, block_size, name == "paged-prefix", scheduler, step_cost, windows
        )
    raise ValueError(f"policy: expected one of {', '.join(POLICIES)}, got {name!r}")
