"""New sequences from prompts: the blocks each KV cache group reuses from the prefix index,
the free blocks allocating a prompt takes, and the new sequence's state (standard library
only). `KVCacheManager.allocate` and the queries before it ask a `PromptAllocator`.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence
from typing import Any

from pagedkv.errors import OutOfBlocks
from pagedkv.memory.audit import EventCounts
from pagedkv.memory.block_pool import BlockPool
from pagedkv.memory.content_hash import chain_start
from pagedkv.memory.groups import NULL_BLOCK, GroupBlocks, first_needed_block
from pagedkv.memory.loaded_blocks import cache_loaded
from pagedkv.memory.lookups import PrefixLookups, window_hits
from pagedkv.memory.prefix import ChainRoot, PrefixName, chain_root
from pagedkv.memory.sequence import ManagerParts, SeqState, token_tuple


class PromptAllocator:
    """Prompts' prefix hits in every KV cache group of ``parts.pool``, and their allocation
    (prefix queries and hits are added to `counts`)."""

    def __init__(self, parts: ManagerParts, counts: EventCounts) -> None:
        self.pool, self.index, self.windows = parts.pool, parts.index, parts.windows
        self.block_size, self.anchor, self.counts = parts.block_size, parts.anchor, counts
        # A sliding anchor (no full-attention group) names prefixes by content.
        self.lookups = [
            PrefixLookups(
                parts.index, parts.pool, parts.block_size, g, w if g == parts.anchor else None
            )  # fmt: skip
            for g, w in enumerate(parts.windows)
        ]
        # The last `window_hits` answer: (token list, anchor hits, state, per-group hits).
        self._window_memo: tuple[Any, ...] | None = None

    def hits(self, token_ids: Sequence[Any], salt: str | None) -> list[list[int]]:
        """Per group, the cached blocks `allocate` would reuse now."""
        anchor_hits = self.lookups[self.anchor].hits(token_ids, salt)
        return self._group_hits(token_ids, anchor_hits, chain_root(salt))

    def _group_hits(
        self, token_ids: Sequence[Any], anchor_hits: list[int], root: ChainRoot
    ) -> list[list[int]]:
        """Per group, the hits after the anchor group's `anchor_hits` (see `window_hits`)."""
        index = self.index
        if len(self.windows) == 1 or not anchor_hits or index is None:
            return [anchor_hits] * len(self.windows)
        # A waiting prompt is asked about every step: the answer holds until a block is
        # indexed or evicted (the anchor's memo hands back the same hits list till then).
        state = (len(token_ids), self.pool.num_evictions, index.next_uid)
        memo = self._window_memo
        if memo is not None and memo[0] is token_ids and memo[1] is anchor_hits:
            if memo[2] == state:
                return memo[3]
        lookups = self.lookups[self.anchor]
        start = lookups.chain_start(root)
        names = lookups.names(token_ids, anchor_hits, start)
        hits = window_hits(
            index, token_ids, anchor_hits, names, start, self.windows, self.anchor, self.block_size
        )
        self._window_memo = (token_ids, anchor_hits, state, hits)
        return hits

    def num_blocks_to_allocate(self, token_ids: Sequence[Any], end: int, salt: str | None) -> int:
        """Free blocks allocating ``token_ids[:end]`` with its prefix hits takes now (a hit on
        a cached-but-free block counts as one)."""
        block_size = self.block_size
        # Hits are matched block by block from the start: those of a prefix are a prefix.
        hits = self.hits(token_ids, salt)
        num = min(len(hits[0]), (end - 1) // block_size)
        num_blocks, total = -(-end // block_size), 0
        for window, lookups, group_hits in zip(self.windows, self.lookups, hits, strict=True):
            first = first_needed_block(window, num * block_size, block_size)
            total += num_blocks - num + lookups.num_evictable(group_hits, first, num)
        return total

    def allocate(
        self, seq_id: Hashable, token_ids: Sequence[Any], use_prefix_cache: bool, salt: str | None
    ) -> tuple[SeqState, int]:
        """The state of a new sequence holding `token_ids` (see `KVCacheManager.allocate`),
        its hit blocks taken and its fresh ones allocated, with the leading tokens cached.

        Raises:
            ValueError: empty `token_ids`.  OutOfBlocks: not enough free blocks; nothing changed.
        """
        index, anchor, block_size = self.index, self.anchor, self.block_size
        # Kept only with an index (as a tuple: the caller's list may change under it).
        tokens = token_ids if index is None and type(token_ids) is list else token_tuple(token_ids)
        if not tokens:
            raise ValueError("allocate: expected at least one token, got an empty prompt")
        # One pass over the prompt in the anchor group: its cached blocks and the keys after.
        root = chain_root(salt)
        lookups = self.lookups[anchor]
        anchor_root = lookups.chain_start(root)
        anchor_hits, _, keys = lookups.lookup(tokens, anchor_root, use_prefix_cache)
        hits = self._group_hits(tokens, anchor_hits, root)
        num_hits = len(hits[anchor])
        num_fresh = -(-len(tokens) // block_size) - num_hits
        used = used_hits(self.windows, hits, num_hits, block_size) if num_hits else hits
        check_free(self.pool, seq_id, num_fresh * len(used), used, num_hits)
        # Take every hit first (cached ones become held) so fresh blocks cannot evict them.
        for group_hits in used:
            if group_hits:
                self.pool.touch(group_hits)
        uids = lookups.names(tokens, hits[anchor], anchor_root) if index is not None else []
        groups = new_groups(self.pool, used, num_hits, num_fresh, root, anchor, uids,
                            lookups.hashed)  # fmt: skip
        if index is not None and use_prefix_cache:  # the counts of prefix lookups
            self.counts.prefix_cache_queries += len(tokens)
            self.counts.prefix_cache_hits += num_hits * block_size
        kept = tokens if index is not None else ()
        seq = SeqState(groups, kept, len(tokens), chain_root=root, prefix_uids=uids)
        seq.set_in_place_end(len(tokens), self.windows, block_size, self.pool)
        # The lookup's keys start after the anchor's hits: of use if every group hit as many.
        seq.key_full_blocks(
            index, block_size, anchor, keys if num_hits == len(anchor_hits) else None
        )
        return seq, num_hits * block_size

    def cache_blocks(
        self, token_ids: Sequence[Any], salt: str | None, blocks: Sequence[tuple[int, int]]
    ) -> list[int | None]:
        """`cache_loaded` through the anchor group's lookups."""
        return cache_loaded(self.lookups[self.anchor], token_ids, chain_root(salt), blocks)

    def forget(self) -> None:
        """The index was cleared: no remembered answer holds."""
        for lookups in self.lookups:
            lookups.forget()
        self._window_memo = None


def used_hits(
    windows: Sequence[int | None], hits: list[list[int]], num_hits: int, block_size: int
) -> list[list[int]]:
    """Per group, the hit blocks a prompt continued after `num_hits` cached blocks reads:
    all of them, or those its window reaches."""
    position = num_hits * block_size
    return [
        group_hits[first_needed_block(window, position, block_size) :]
        for window, group_hits in zip(windows, hits, strict=True)
    ]


def check_free(
    pool: BlockPool, seq_id: Hashable, num_fresh: int, used: list[list[int]], num_hits: int
) -> None:
    """Raise OutOfBlocks unless `num_fresh` blocks and the `used` hits' cached ones are free
    (cached hits are counted only when it matters)."""
    num_used = sum(map(len, used))
    if num_fresh + num_used > pool.num_free_blocks - pool.num_cached_blocks and (
        num_fresh + sum(map(pool.num_evictable, used)) > pool.num_free_blocks
    ):
        raise OutOfBlocks(
            f"allocate {seq_id!r}: need {num_fresh} new blocks after {num_hits} cached, "
            f"{pool.num_free_blocks} free"
        )


def new_groups(
    pool: BlockPool,
    used: list[list[int]],
    num_hits: int,
    num_fresh: int,
    root: ChainRoot,
    anchor: int,
    uids: list[PrefixName],
    hashed: bool = False,
) -> tuple[GroupBlocks, ...]:
    """A new sequence's blocks, per group: NULL_BLOCK before its `used` hits, then
    `num_fresh` fresh blocks; the first `num_hits` blocks count as keyed, the `anchor`
    group's chain going on from the last hit's name (``uids[-1]``, else its `chain_start`,
    by content hash if `hashed`); `SeqState.key_full_blocks` keys the rest."""
    groups = []
    for g, group_used in enumerate(used):
        num_null = num_hits - len(group_used)
        block_ids = pool.allocate(num_fresh)
        if num_hits:
            block_ids[:0] = array("i", [NULL_BLOCK] * num_null + group_used)
        is_hashed = hashed and g == anchor
        chain_uid = uids[-1] if g == anchor and uids else chain_start(root, g, is_hashed)
        groups.append(GroupBlocks(block_ids, num_hits, chain_uid, num_null, hashed=is_hashed))
    return tuple(groups)
