"""The block pool: O(1) allocate and free, reference counts, LRU eviction of cached blocks.

Every block is in exactly one of three states::

    free     never cached (or forgotten): on the free stack, handed out first
    cached   free but still findable by the prefix index: in the LRU queue, evicted
             (least recently used first) only when the free stack is empty
    held     ref_count >= 1: in some sequence's block table

Bookkeeping is four ``array('i')`` (free stack, extra references, LRU prev/next links) plus
the prefix index's list of keys: 24 bytes per block and no Python object per block, so a
million-block pool builds in milliseconds. Work is batched per call: allocating n blocks is a
slice of the free stack with no per-block write.

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
        index: the prefix index whose cached blocks this pool keeps in its LRU queue and
            evicts, or None (no prefix caching: freed blocks go straight back to the stack).

    Raises:
        ValueError: `num_blocks` is negative.
    """

    __slots__ = (
        "num_blocks",
        "index",
        "_stack",
        "_extra",
        "_prev",
        "_next",
        "_num_cached",
        "num_evictions",
    )

    def __init__(self, num_blocks: int, index: PrefixIndex | None = None) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks: expected >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.index = index
        # Free stack, top at the end: block 0 is handed out first.
        self._stack = array("i", range(num_blocks))
        self._stack.reverse()
        # ref_count - 1 for a held block, 0 for a free or cached one. Storing the *extra*
        # references lets allocation skip writing a count per block; whether a block is held
        # follows from where it is (stack, LRU, or neither).
        self._extra = array("i", bytes(4 * num_blocks))
        # Intrusive doubly linked LRU of cached blocks; slot num_blocks is the sentinel
        # (next = oldest, prev = newest). next[b] == -1 means b is not in the queue.
        self._prev = array("i", [-1]) * (num_blocks + 1)
        self._next = array("i", [-1]) * (num_blocks + 1)
        self._prev[num_blocks] = self._next[num_blocks] = num_blocks
        self._num_cached = 0
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free plus cached (evictable)."""
        return len(self._stack) + self._num_cached

    @property
    def num_cached_blocks(self) -> int:
        """Cached-but-free blocks (in the LRU queue, evictable)."""
        return self._num_cached

    def allocate(self, num: int) -> list[int]:
        """Take `num` blocks (ref_count 1 each), evicting cached blocks only when needed.

        Args:
            num: blocks wanted (>= 0).

        Returns:
            The block ids: from the free stack first (most recently freed first), then
            evicted cached blocks, least recently used first.

        Raises:
            OutOfBlocks: fewer than `num` blocks are free; nothing changed.
        """
        stack = self._stack
        if num > len(stack) + self._num_cached:
            raise OutOfBlocks(
                f"need {num} blocks, {len(stack) + self._num_cached} free of {self.num_blocks}"
            )
        take = min(num, len(stack))
        popped = stack[len(stack) - take :]
        del stack[len(stack) - take :]
        popped.reverse()
        block_ids = popped.tolist()
        if take < num:
            block_ids += self._evict(num - take)
        return block_ids

    def _evict(self, num: int) -> list[int]:
        """Unlink the `num` least recently used cached blocks and forget their keys."""
        prev, nxt, sentinel = self._prev, self._next, self.num_blocks
        remove = self.index.remove  # type: ignore[union-attr]  # cached blocks imply an index
        block_ids: list[int] = []
        block_id = nxt[sentinel]
        for _ in range(num):
            block_ids.append(block_id)
            remove(block_id)
            following = nxt[block_id]
            nxt[block_id] = prev[block_id] = -1
            block_id = following
        nxt[sentinel] = block_id
        prev[block_id] = sentinel
        self._num_cached -= num
        self.num_evictions += num
        return block_ids

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block; blocks left with none become free or cached.

        A released block that the prefix index holds joins the LRU tail; others go back on
        the free stack. Both are pushed in reverse order: a sequence's last blocks are
        evicted first (its prefix stays longest), and freed blocks are handed out again in
        their original order.

        Args:
            block_ids: held blocks, each at most once.
        """
        extra = self._extra
        released = [b for b in block_ids if not extra[b]]
        if len(released) != len(block_ids):
            for b in block_ids:
                if extra[b]:
                    extra[b] -= 1
        index = self.index
        if index is None or not len(index):
            released.reverse()
            self._stack.extend(released)
            return
        keys = index.block_keys
        plain = [b for b in reversed(released) if keys[b] is None]
        self._stack.extend(plain)
        if len(plain) != len(released):
            self._push_cached([b for b in reversed(released) if keys[b] is not None])

    def _push_cached(self, block_ids: Iterable[int]) -> None:
        """Append free, indexed blocks to the LRU tail (most recently used end)."""
        prev, nxt, sentinel = self._prev, self._next, self.num_blocks
        tail = prev[sentinel]
        count = 0
        for b in block_ids:
            nxt[tail] = b
            prev[b] = tail
            tail = b
            count += 1
        nxt[tail] = sentinel
        prev[sentinel] = tail
        self._num_cached += count

    def share(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each held block (a fork)."""
        extra = self._extra
        for b in block_ids:
            extra[b] += 1

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each cached block (a prefix hit), taking free ones off the LRU.

        Args:
            block_ids: indexed blocks, held or cached, each at most once.
        """
        extra, prev, nxt = self._extra, self._prev, self._next
        unlinked = 0
        for b in block_ids:
            following = nxt[b]
            if following < 0:
                extra[b] += 1
                continue
            before = prev[b]
            nxt[before] = following
            prev[following] = before
            nxt[b] = prev[b] = -1
            unlinked += 1
        self._num_cached -= unlinked

    def num_evictable(self, block_ids: Iterable[int]) -> int:
        """How many of `block_ids` are cached-but-free (a hit on one takes a free block)."""
        nxt = self._next
        return sum(nxt[b] >= 0 for b in block_ids)

    def is_shared(self, block_id: int) -> bool:
        """Whether a held block has more than one holder."""
        return self._extra[block_id] > 0

    def is_cached_free(self, block_id: int) -> bool:
        """Whether `block_id` is in the LRU queue (free, findable by the prefix index)."""
        return self._next[block_id] >= 0

    def free_block_ids(self) -> list[int]:
        """Free-stack blocks in the order the next allocations take them."""
        return self._stack[::-1].tolist()

    def cached_block_ids(self) -> list[int]:
        """Cached-but-free blocks, least recently used (next evicted) first."""
        nxt, sentinel = self._next, self.num_blocks
        block_ids: list[int] = []
        b = nxt[sentinel]
        while b != sentinel and len(block_ids) <= self.num_blocks:
            block_ids.append(b)
            b = nxt[b]
        return block_ids

    def reset_cache(self) -> None:
        """Move every cached-but-free block back to the free stack and clear the index."""
        cached = self.cached_block_ids()
        for b in cached:
            self._next[b] = self._prev[b] = -1
        sentinel = self.num_blocks
        self._next[sentinel] = self._prev[sentinel] = sentinel
        self._num_cached = 0
        cached.reverse()
        self._stack.extend(cached)
        if self.index is not None:
            self.index.clear()

    def ref_counts(self) -> list[int]:
        """Every block's reference count (O(num_blocks): for checks and tests)."""
        counts = [e + 1 for e in self._extra]
        for b in self._stack:
            counts[b] = 0
        for b in self.cached_block_ids():
            counts[b] = 0
        return counts

    def nbytes(self) -> int:
        """Bytes of per-block bookkeeping held by the pool's arrays."""
        arrays = (self._stack, self._extra, self._prev, self._next)
        return sum(a.buffer_info()[1] * a.itemsize for a in arrays)

    def check(self, holders: Sequence[int]) -> None:
        """Assert the pool matches `holders` (the number of block tables holding each block).

        Checks: each block's count equals its holders; a block is in at most one of free
        stack, LRU queue and held; free + cached + held = num_blocks; the LRU links are
        consistent; cached blocks are indexed and free-stack blocks are not.

        Raises:
            AssertionError: naming the first block found wrong.
        """
        n = self.num_blocks
        assert len(holders) == n, f"expected {n} holder counts, got {len(holders)}"
        keys = self.index.block_keys if self.index is not None else [None] * n
        state = bytearray(n)  # 0 unseen, 1 free stack, 2 cached
        for b in self._stack:
            assert 0 <= b < n, f"free stack holds {b}, not a block id"
            assert not state[b], f"block {b} is on the free stack twice"
            state[b] = 1
            assert keys[b] is None, f"block {b} is on the free stack but still indexed"
            assert self._next[b] < 0, f"block {b} is both on the free stack and in the LRU"
        cached = self.cached_block_ids()
        assert len(cached) == self._num_cached, (
            f"LRU queue links {len(cached)} blocks, its counter says {self._num_cached}"
        )
        before = n
        for b in cached:
            assert not state[b], f"block {b} is both free and cached (or cached twice)"
            state[b] = 2
            assert self._prev[b] == before, f"LRU link prev[{b}] is broken"
            assert keys[b] is not None, f"cached block {b} is not in the prefix index"
            before = b
        assert self._prev[n] == before, "LRU tail link is broken"
        for b in range(n):
            if state[b]:
                assert holders[b] == 0, (
                    f"block {b} is {'free' if state[b] == 1 else 'cached'} but held by "
                    f"{holders[b]} sequence(s)"
                )
                assert self._extra[b] == 0, f"free block {b} carries extra references"
            else:
                assert holders[b] > 0, (
                    f"block {b} is neither free nor held: leaked (a forgotten decrement?)"
                )
                assert self._extra[b] + 1 == holders[b], (
                    f"block {b}: ref_count {self._extra[b] + 1} != {holders[b]} holders"
                )
