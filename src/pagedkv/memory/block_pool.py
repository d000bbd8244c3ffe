"""The block pool: O(1) allocate and free, reference counts, LRU eviction of cached blocks.

Every block is in exactly one of three states::

    free     never cached (or forgotten): on the free stack (or never used yet), handed
             out first, most recently freed first
    cached   free but still findable by the prefix index: queued for eviction,
             least recently freed first, only when no free block is left
    held     ref_count >= 1: in some sequence's block table

No Python object per block: flat containers only, work batched per call, and block ids
handed out as ``array('i')`` slices (4 bytes per block in a block table, no int objects, so
a pool of millions stays cache friendly). The cached queue is lazy: a hit does not unlink
the block (the costliest per-block step of an intrusive linked list), it only bumps the
block's count; the stale entry is skipped when it reaches the head, and the queue is
compacted when stale entries outnumber live ones (amortized O(1)).

Bookkeeping per block: extra references 8 B + queue stamp 4 B + free stack and queue
together at most 8 B (free + live + stale entries <= 2 x num_blocks + slack), plus the
prefix index's entry list 8 B: at most 28 B. Building touches no per-block Python object:
a list of one repeated int, a zeroed array, an implicit range of never-used blocks, a list
of None.

Standard library only.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

from pagedkv.errors import OutOfBlocks
from pagedkv.memory.prefix import PrefixIndex


class BlockPool:
    """A fixed set of block ids ``0 .. num_blocks - 1`` with reference counts.

    Args:
        num_blocks: blocks in the pool (>= 0).
        index: the prefix index whose freed blocks this pool keeps cached (evicting them
            least recently freed first), or None: freed blocks go straight back to the stack.

    Raises:
        ValueError: `num_blocks` is negative.
    """

    __slots__ = ("num_blocks", "index", "_stack", "_next_fresh", "_extra", "_queue", "_head",
                 "_stamp", "_num_cached", "_num_shared", "num_evictions",
                 "num_moves")  # fmt: skip

    # Compact the cached queue once it holds this many more entries than twice the live ones
    # (a class attribute so that tests can compact on every call).
    compact_slack = 1024

    def __init__(self, num_blocks: int, index: PrefixIndex | None = None) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks: expected >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.index = index
        # The free stack, top at the end, holds freed blocks; blocks never handed out,
        # ``_next_fresh .. num_blocks - 1``, lie implicitly below it (so a million-block pool
        # builds without iterating a million ints). Block 0 is handed out first.
        self._stack = array("i")
        self._next_fresh = 0
        # ref_count - 1 for a held block, 0 on the free stack, -1 when cached. Counting the
        # *extra* references lets allocation skip a per-block write, and a prefix hit is one
        # increment whether the block was held (k -> k + 1) or cached (-1 -> 0). A list of
        # small ints, not an array: one pointer per block to CPython's shared small-int
        # objects, and faster on the per-block steps of a hit or a free.
        self._extra = [0] * num_blocks
        # Cached queue (oldest at _head) and, per block, the position of its newest entry:
        # an entry is live iff its block is cached and ``stamp[block] == position``.
        self._queue = array("i")
        self._head = 0
        self._stamp = array("i", bytes(4 * num_blocks))
        self._num_cached = 0
        # Held blocks with more than one holder (extra > 0). While there are none, `free`
        # releases every block without reading its count (no random access into `_extra`:
        # what keeps a 2M-block pool's churn close to a 10K-block pool's).
        self._num_shared = 0
        self.num_evictions = 0
        # Calls that may move held blocks to cached or back (`free`, `touch`): while it
        # stands still, which of a set of indexed blocks are evictable does not change.
        self.num_moves = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free plus cached (evictable)."""
        return len(self._stack) + self.num_blocks - self._next_fresh + self._num_cached

    @property
    def num_cached_blocks(self) -> int:
        """Cached-but-free blocks (evictable)."""
        return self._num_cached

    def allocate(self, num: int) -> array[int]:
        """Take `num` blocks (ref_count 1 each), evicting cached blocks only when needed.

        Args:
            num: blocks wanted (>= 0).

        Returns:
            The block ids, ``array('i')`` (4 bytes per block, no int objects): from the free
            stack first (most recently freed first), then never-used blocks, then evicted
            cached blocks, least recently freed first.

        Raises:
            OutOfBlocks: fewer than `num` blocks are free; nothing changed.
        """
        if num > self.num_free_blocks:
            raise OutOfBlocks(
                f"need {num} blocks, {self.num_free_blocks} free of {self.num_blocks}"
            )
        stack = self._stack
        take = min(num, len(stack))
        block_ids = stack[len(stack) - take :]
        del stack[len(stack) - take :]
        block_ids.reverse()
        if take < num:
            fresh = min(num - take, self.num_blocks - self._next_fresh)
            block_ids.extend(range(self._next_fresh, self._next_fresh + fresh))
            self._next_fresh += fresh
            if take + fresh < num:
                block_ids.extend(self._evict(num - take - fresh))
        return block_ids

    def allocate_one(self) -> int:
        """`allocate(1)`'s block, as an int (a decode step's new block: no array).

        Raises:
            OutOfBlocks: no block is free; nothing changed.
        """
        if self._stack:
            return self._stack.pop()
        if self._next_fresh < self.num_blocks:
            self._next_fresh += 1
            return self._next_fresh - 1
        return self.allocate(1)[0]  # a cached block, evicted (or OutOfBlocks)

    def _evict(self, num: int) -> list[int]:
        """Take the `num` least recently freed cached blocks and forget their keys."""
        queue, extra, stamp = self._queue, self._extra, self._stamp
        remove = self.index.remove  # type: ignore[union-attr]  # cached blocks imply an index
        block_ids: list[int] = []
        pos = self._head
        while len(block_ids) < num:
            b = queue[pos]
            if extra[b] < 0 and stamp[b] == pos:  # else a stale entry: skip it
                extra[b] = 0
                remove(b)
                block_ids.append(b)
            pos += 1
        self._head = pos
        self._num_cached -= num
        self.num_evictions += num
        self._maybe_compact()
        return block_ids

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block; blocks left with none become free or cached.

        A released block that the prefix index holds is queued as cached; others go back on
        the free stack. Both are pushed in reverse order: a sequence's last blocks are
        evicted first (its prefix stays longest), and freed blocks are handed out again in
        their original order.

        Args:
            block_ids: held blocks, each at most once.
        """
        self.num_moves += 1
        released: Sequence[int]
        if self._num_shared:
            released = self._release(block_ids)
        elif type(block_ids) is array:  # none shared, all released: reversed in C
            released = block_ids[::-1]
        else:
            released = list(block_ids)[::-1]
        index = self.index
        if index is not None and len(index):
            entries = index.block_entries
            cached = [b for b in released if entries[b] is not None]
            if cached:
                self._stack.extend([b for b in released if entries[b] is None])
                self._push_cached(cached)
                return
        self._stack.extend(released)

    def _release(self, block_ids: Sequence[int]) -> list[int]:
        """Drop one reference to each block; the ones left with none, in reverse order."""
        extra = self._extra
        released = [b for b in block_ids if not extra[b]]
        if len(released) != len(block_ids):
            num_unshared = 0
            for b in block_ids:
                count = extra[b]
                if count:
                    extra[b] = count - 1
                    num_unshared += count == 1
            self._num_shared -= num_unshared
        released.reverse()
        return released

    def _push_cached(self, block_ids: list[int]) -> None:
        """Queue free, indexed blocks as the most recently freed."""
        queue, extra, stamp = self._queue, self._extra, self._stamp
        pos = len(queue)
        for b in block_ids:
            extra[b] = -1
            stamp[b] = pos
            pos += 1
        queue.extend(block_ids)
        self._num_cached += len(block_ids)
        self._maybe_compact()

    def _maybe_compact(self) -> None:
        """Keep the queue at most 2 x live entries (+ slack): O(len) each time, amortized O(1).

        Drops consumed and stale entries and renumbers the stamps of the live ones.
        """
        if len(self._queue) <= 2 * self._num_cached + self.compact_slack:
            return
        live = self.cached_block_ids()
        stamp = self._stamp
        for pos, b in enumerate(live):
            stamp[b] = pos
        self._queue = array("i", live)
        self._head = 0

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block (a prefix hit or a fork); cached ones become held.

        Args:
            block_ids: held or cached (then indexed) blocks, each at most once.
        """
        self.num_moves += 1
        extra = self._extra
        num_cached = num_shared = 0
        for b in block_ids:
            count = extra[b]
            extra[b] = count + 1
            if count < 0:
                num_cached += 1
            elif not count:
                num_shared += 1
        self._num_shared += num_shared
        if num_cached:
            self._num_cached -= num_cached
            self._maybe_compact()

    def num_evictable(self, block_ids: Iterable[int]) -> int:
        """How many of `block_ids` are cached-but-free (a hit on one takes a free block)."""
        # -1 >= count, i.e. count < 0, over the blocks' counts, in C.
        return sum(map((-1).__ge__, map(self._extra.__getitem__, block_ids)))

    def is_shared(self, block_id: int) -> bool:
        """Whether a held block has more than one holder."""
        return self._extra[block_id] > 0

    @property
    def extra_refs(self) -> list[int]:
        """Per block ref_count - 1 (> 0: shared), read only: `is_shared` without a call."""
        return self._extra

    def free_block_ids(self) -> list[int]:
        """Free (never cached) blocks in the order the next allocations take them."""
        return self._stack[::-1].tolist() + list(range(self._next_fresh, self.num_blocks))

    def cached_block_ids(self) -> list[int]:
        """Cached-but-free blocks, least recently freed (next evicted) first."""
        queue, extra, stamp = self._queue, self._extra, self._stamp
        return [b for pos, b in enumerate(queue[self._head :], self._head)
                if extra[b] < 0 and stamp[b] == pos]  # fmt: skip

    def reset_cache(self) -> None:
        """Move every cached-but-free block back to the free stack and clear the index."""
        cached = self.cached_block_ids()
        for b in cached:
            self._extra[b] = 0
        self._queue, self._head, self._num_cached = array("i"), 0, 0
        cached.reverse()
        self._stack.extend(cached)
        if self.index is not None:
            self.index.clear()

    def ref_counts(self) -> list[int]:
        """Every block's reference count (O(num_blocks): for checks and tests)."""
        counts = [max(e + 1, 0) for e in self._extra]
        for b in self.free_block_ids():
            counts[b] = 0
        return counts

    def nbytes(self) -> int:
        """Bytes of per-block bookkeeping in the pool's arrays (allocated capacity aside)."""
        arrays = (self._stack, self._queue, self._stamp)
        return sum(len(a) * a.itemsize for a in arrays) + 8 * len(self._extra)

    def check(self, holders: Sequence[int]) -> None:
        """Assert the pool matches `holders` (the number of block tables holding each block).

        Checks: each block's count equals its holders; a block is in exactly one of free
        stack, cached queue and held; free + cached + held = num_blocks; cached blocks are
        indexed and free-stack blocks are not.

        Raises:
            AssertionError: naming the first block found wrong.
        """
        n = self.num_blocks
        assert len(holders) == n, f"expected {n} holder counts, got {len(holders)}"
        keys = self.index.block_entries if self.index is not None else [None] * n
        state = bytearray(n)  # 0 not free, 1 free stack, 2 cached
        assert 0 <= self._next_fresh <= n, f"never-used blocks start at {self._next_fresh}"
        for b in self.free_block_ids():
            assert 0 <= b < n, f"free stack holds {b}, not a block id"
            assert not state[b], f"block {b} is on the free stack twice"
            state[b] = 1
            assert keys[b] is None, f"block {b} is on the free stack but still indexed"
        num_shared = sum(e > 0 for e in self._extra)
        assert num_shared == self._num_shared, (
            f"{num_shared} blocks have more than one holder, the counter says {self._num_shared}"
        )
        cached = self.cached_block_ids()
        assert len(cached) == self._num_cached, (
            f"cached queue holds {len(cached)} live blocks, its counter says {self._num_cached}"
        )
        for b in cached:
            assert not state[b], f"block {b} is both free and cached (or cached twice)"
            state[b] = 2
            assert keys[b] is not None, f"cached block {b} is not in the prefix index"
        for b in range(n):
            extra = self._extra[b]
            if state[b]:
                what = "free" if state[b] == 1 else "cached"
                assert holders[b] == 0, f"block {b} is {what} but held by {holders[b]} sequence(s)"
                assert extra == (0 if state[b] == 1 else -1), (
                    f"{what} block {b} has ref_count {extra + 1}"
                )
            else:
                assert holders[b] > 0, (
                    f"block {b} is neither free nor held: leaked (a forgotten decrement?)"
                )
                assert extra + 1 == holders[b], (
                    f"block {b}: ref_count {extra + 1} != {holders[b]} holders"
                )
