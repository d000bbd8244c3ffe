"""KV allocation policies the simulator compares, all measured in tokens.

Standard library only. The two contiguous policies place each request in one address range
of a token-addressed arena; the two paged ones hand the request to pagedkv's own
`KVCacheManager` (imported when a paged policy is built), which never needs contiguity.

Contiguous arena (first fit, free list sorted by address, neighbours coalesced on release):

    address 0                                                        capacity
    |[ req 3 ......... ]|  hole  |[ req 7 .. ]|      hole      |[ req 9 ]|
                         ^ a request larger than every hole waits here, even if
                           the holes together could hold it (external fragmentation)
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from pagedkv.errors import OutOfBlocks
from pagedkv.sim.workload import Request

POLICIES = ("contiguous-max", "contiguous-first-fit", "paged", "paged-prefix")

# Token ids live in disjoint ranges: request i's own tokens at (2i + 1) << 32 | position,
# prefix group g's shared tokens at (2g + 2) << 32 | position. Same id <=> same prefix.
_ID_SHIFT = 32


@dataclass(slots=True)
class Live:
    """One admission of a request. After a preemption the request is admitted again as a new
    `Live` whose prompt holds the tokens produced so far (recompute)."""

    index: int
    request: Request
    prompt_len: int  # tokens prefilled at admission
    start: int  # admission step; the admission step already produces one token
    addr: int = -1  # contiguous: first token's address
    reserved: int = 0  # contiguous: tokens reserved
    synced: int = 0  # paged: tokens the manager has been given
    bucket: int = field(default=-1)  # paged: step % block_size at which it needs a new block

    def length(self, step: int) -> int:
        """Tokens held at the end of `step` (one more per step since admission)."""
        return self.prompt_len + 1 + step - self.start

    @property
    def finish_step(self) -> int:
        return self.start + self.request.total_len - self.prompt_len - 1


class ContiguousPolicy:
    """Each request reserves one address range: its exact final size, or `max_len` tokens."""

    grows_in_blocks = False

    def __init__(self, name: str, capacity: int, max_len: int | None = None) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity: expected > 0 tokens, got {capacity}")
        self.name = name
        self.capacity = capacity
        self.max_len = max_len
        self.block_size = 1
        self._starts = [0]  # free holes, sorted by address
        self._sizes = [capacity]
        self._reserved = 0

    def size(self, request: Request) -> int:
        return request.total_len if self.max_len is None else self.max_len

    def never_fits(self, request: Request) -> bool:
        size = self.size(request)
        return size > self.capacity or request.total_len > size

    def need_tokens(self, live: Live) -> int:
        return self.size(live.request)

    def free_tokens(self) -> int:
        return self.capacity - self._reserved

    def reserved_tokens(self) -> int:
        return self._reserved

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
        self._reserved += need
        return True

    def release(self, live: Live, produced: int) -> None:
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
        self._reserved -= live.reserved

    def grow(self, live: Live, length: int) -> None:
        raise AssertionError("contiguous reservations never grow")

    def regions(self, lives: list[Live], step: int) -> list[tuple[int, int, int]]:
        """(address, reserved tokens, tokens holding KV) per live request."""
        return [(v.addr, v.reserved, v.length(step)) for v in lives]

    def manager_stats(self) -> dict[str, Any]:
        return {}


class PagedPolicy:
    """Blocks from pagedkv's `KVCacheManager`, one more whenever a sequence crosses a block
    boundary. With `prefix_caching`, prompts of one prefix group share their full blocks."""

    grows_in_blocks = True

    def __init__(self, name: str, num_blocks: int, block_size: int, prefix_caching: bool) -> None:
        from pagedkv.memory import KVCacheManager

        self.name = name
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.capacity = num_blocks * block_size
        self.prefix_caching = prefix_caching
        self.manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def never_fits(self, request: Request) -> bool:
        return self._blocks(request.total_len) > self.num_blocks

    def need_tokens(self, live: Live) -> int:
        # The prompt and the token the admission step produces; shared blocks may lower it.
        return self._blocks(live.prompt_len + 1) * self.block_size

    def free_tokens(self) -> int:
        return self.manager.num_free_blocks * self.block_size

    def largest_free_tokens(self) -> int:
        return self.free_tokens()  # any free block serves any sequence

    def reserved_tokens(self) -> int:
        return (self.num_blocks - self.manager.num_free_blocks) * self.block_size

    def token_ids(self, live: Live, lo: int, hi: int) -> list[int]:
        """The request's token ids at positions [lo, hi)."""
        request = live.request
        own = ((2 * live.index + 1) << _ID_SHIFT) + lo
        shared = min(hi, request.prefix_len) - lo
        if shared <= 0:
            return list(range(own, own + hi - lo))
        group = ((2 * request.prefix_group + 2) << _ID_SHIFT) + lo
        return list(range(group, group + shared)) + list(range(own + shared, own + hi - lo))

    def admit(self, live: Live) -> bool:
        n = live.prompt_len
        # At most the group prefix can be cached, or after a preemption (prompt_len grew)
        # the request's own tokens: with fewer free blocks than the rest, allocate would
        # raise OutOfBlocks, so skip building a token list for a head that waits long.
        shareable = 0
        if self.prefix_caching:
            own = n > live.request.prompt_len
            shareable = (n if own else live.request.prefix_len) // self.block_size
        if self.manager.num_free_blocks + shareable < self._blocks(n + 1):
            return False
        try:
            self.manager.allocate(live.index, self.token_ids(live, 0, n))
        except OutOfBlocks:
            return False
        live.synced = n
        if n % self.block_size == 0:  # the token produced now opens a new block
            try:
                self.grow(live, n + 1)
            except OutOfBlocks:
                self.manager.free(live.index)
                return False
        return True

    def grow(self, live: Live, length: int) -> None:
        """Give the manager the tokens up to `length` (called when `length` opens a block).

        Appending the tokens of a block in one call at the boundary instead of one by one
        changes nothing: tokens that stay inside the last block never allocate, so the
        manager's blocks, and any OutOfBlocks, are exactly those of per-token appends.

        Raises:
            OutOfBlocks: no block is free; nothing changed.
        """
        self.manager.append(live.index, self.token_ids(live, live.synced, length))
        live.synced = length

    def release(self, live: Live, produced: int) -> None:
        if produced > live.synced:  # tokens inside the last block: no allocation
            self.manager.append(live.index, self.token_ids(live, live.synced, produced))
        self.manager.free(live.index)

    def regions(self, lives: list[Live], step: int) -> list[tuple[int, int, int]]:
        bs, out = self.block_size, []
        for v in lives:
            table = self.manager.block_table(v.index)
            last = v.length(step) - (len(table) - 1) * bs
            out.extend((b * bs, bs, bs) for b in table[:-1])
            out.append((table[-1] * bs, bs, min(bs, last)))
        return out

    def manager_stats(self) -> dict[str, Any]:
        stats = self.manager.stats()
        return dict(stats) if isinstance(stats, dict) else dict(vars(stats))


def create_policy(
    name: str, *, capacity_tokens: int, num_blocks: int, block_size: int, max_len: int
) -> ContiguousPolicy | PagedPolicy:
    """Build a policy by name.

    Args:
        capacity_tokens: tokens the KV memory holds (contiguous policies).
        num_blocks: blocks the KV memory holds (paged policies).
        max_len: tokens `contiguous-max` reserves per request.

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
        return PagedPolicy(name, num_blocks, block_size, prefix_caching=name == "paged-prefix")
    raise ValueError(f"policy: expected one of {', '.join(POLICIES)}, got {name!r}")
