"""KVCacheManager: sequences' block tables over a shared block pool.

Prefix sharing, copy-on-write, swap to a host pool, all-or-nothing allocation and a
consistency check. Standard library only: no tensors here.

A sequence's blocks (one KV cache group; with G groups the table interleaves them, entry
``i * G + g`` being group g's block i, see `pagedkv.memory.groups`)::

    block_table   [ b0 | b1 | b2 | b3 ]       slot(p) = block_table[p // B] * B + p % B
    tokens        |0..B-1|B..2B-1|...|  n-1|  (B = block_size; the last block may be partial)
                   '- full blocks are keyed in the prefix index as soon as their tokens are known
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import replace
from typing import Any

from pagedkv.errors import OutOfBlocks
from pagedkv.memory.appending import Appender
from pagedkv.memory.audit import EventCounts, check_state
from pagedkv.memory.block_pool import BlockPool
from pagedkv.memory.content_hash import ContentHashes
from pagedkv.memory.groups import anchor_group
from pagedkv.memory.prefix import PrefixIndex
from pagedkv.memory.prompts import PromptAllocator
from pagedkv.memory.sequence import ManagerParts, SequenceTable, positive_int, table_of
from pagedkv.memory.swap import move_to_device, move_to_host


class KVCacheManager:
    """The paged KV cache's bookkeeping: which blocks hold which sequence's tokens.

    Args:
        num_blocks: device blocks in the pool (> 0).
        block_size: tokens per block (> 0).
        enable_prefix_caching: keep full blocks findable by their token prefix, so a new
            prompt reuses them; freed ones stay cached until the space is needed.
        num_host_blocks: blocks of the host pool for `swap_out` (>= 0).
        windows: per KV cache group, its layers' sliding window in tokens (None: full
            attention). A sliding group holds only the blocks its window reaches, at most
            ``ceil(window / block_size) + 1`` per sequence between steps of one token.
        hash_contents: with prefix caching, keep each cached block's content hash and queue
            the hashed blocks the pool evicts (`content_hashes`, for a tier that saves them).

    Raises ValueError for a non-positive size (or a negative `num_host_blocks`, or a window
    that is not None or a positive int). Sequence
    ids are any hashable. Token ids are compared, never interpreted. Running out of blocks
    raises `OutOfBlocks` and leaves every piece of state unchanged.

    The caller's duties: execute copies (`pop_copies`) and swap pairs in the order the calls
    were made, before the forward pass; and compute every token handed to `allocate` /
    `append` in the next forward pass (full blocks are findable from the call on), so never
    free or swap out a sequence between that call and its forward pass.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        num_host_blocks: int = 0,
        windows: Sequence[int | None] = (None,),
        hash_contents: bool = False,
    ) -> None:
        self.num_blocks = positive_int("num_blocks", num_blocks)
        if not windows:
            raise ValueError("windows: expected one entry per KV cache group, got none")
        self.windows = tuple(w if w is None else positive_int("windows", w) for w in windows)
        self.block_size = positive_int("block_size", block_size)
        self.num_host_blocks = positive_int("num_host_blocks", num_host_blocks, minimum=0)
        self.enable_prefix_caching = enable_prefix_caching
        self._index = PrefixIndex(num_blocks) if enable_prefix_caching else None
        # Content hashes of the cached blocks, and the evicted ones queued (`hash_contents`).
        self.content_hashes: ContentHashes | None = None
        if hash_contents and self._index is not None:
            self.content_hashes = self._index.content = ContentHashes(self._index.block_entries)
        self._pool = BlockPool(num_blocks, self._index)
        self._host = BlockPool(num_host_blocks)
        self._seqs = SequenceTable()
        self._counts = EventCounts()
        # The group keyed as a chain; the others key their blocks under its uids.
        self._anchor = anchor = anchor_group(self.windows)
        parts = ManagerParts(self._pool, self._index, self.windows, block_size, anchor)
        self._appender = Appender(self._seqs, parts, self._counts)
        self._prompts = PromptAllocator(parts, self._counts)

    @property
    def num_free_blocks(self) -> int:
        """Device blocks an allocation can use now: free plus cached (evictable)."""
        return self._pool.num_free_blocks

    @property
    def num_free_host_blocks(self) -> int:
        return self._host.num_free_blocks

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def seq_ids(self) -> list[Hashable]:
        """Ids of the live sequences (resident or swapped out), oldest first."""
        return list(self._seqs)

    @property
    def num_groups(self) -> int:
        """KV cache groups: block tables interleave this many groups' blocks."""
        return len(self.windows)

    def is_swapped(self, seq_id: Hashable) -> bool:
        """Whether `seq_id` is swapped out. Raises KeyError if unknown."""
        return self._seqs.state(seq_id).is_swapped

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The sequence's block ids, logical block order (groups interleaved: entry ``i * G +
        g`` is group g's block i; NULL_BLOCK (-1) where it slid out of the group's window).
        Raises as `num_tokens`.

        The same list comes back until the blocks change, then a new one (so a list handed
        out earlier still describes the step it was handed to): never mutate it.
        """
        return table_of(self._seqs.resident(seq_id, "block_table"))

    def num_tokens(self, seq_id: Hashable) -> int:
        """Tokens the sequence holds. Raises KeyError if unknown, ValueError if swapped out."""
        return self._seqs.resident(seq_id, "num_tokens").num_tokens

    def slot_mapping(self, seq_id: Hashable, start: int, end: int, group: int = 0) -> list[int]:
        """Slots of positions ``start <= p < end`` in `group`: ``block_table[p // B * G +
        group] * B + p % B``.

        Raises:
            KeyError: unknown `seq_id`.
            ValueError: swapped out, not ``0 <= start <= end <= num_tokens``, or no such group.
        """
        return self._seqs.slot_mapping(seq_id, start, end, self.block_size, group)

    def num_cached_tokens(self, token_ids: Sequence[Any], *, salt: str | None = None) -> int:
        """Tokens `allocate(_, token_ids, salt=salt)` would find cached now. No side effects.

        Returns:
            A multiple of `block_size`, at most ``len(token_ids) - 1``.
        """
        return len(self._prompts.hits(token_ids, salt)[self._anchor]) * self.block_size

    def num_blocks_to_allocate(
        self,
        token_ids: Sequence[Any],
        *,
        use_prefix_cache: bool = True,
        num_tokens: int | None = None,
        salt: str | None = None,
    ) -> int:
        """Free blocks `allocate(_, token_ids[:num_tokens], use_prefix_cache=..., salt=...)`
        would take now (after prefix hits); `num_tokens` None: all of them.

        A hit on a cached-but-free block counts as one, so the allocation succeeds exactly
        when the result is <= `num_free_blocks`.
        """
        end = len(token_ids) if num_tokens is None else num_tokens
        if not use_prefix_cache:
            return -(-end // self.block_size) * len(self.windows)
        return self._prompts.num_blocks_to_allocate(token_ids, end, salt)

    def num_blocks_to_append(self, seq_id: Hashable, num_tokens: int) -> int:
        """Free blocks `append(seq_id, <num_tokens tokens>)` would take now: new blocks, plus
        one copy-on-write block if the partially filled last block is shared, less the
        blocks that slide out of a window and are held by no other sequence (so it may be
        negative).

        Raises:
            KeyError: unknown `seq_id`.  ValueError: swapped out, or `num_tokens` < 0.
        """
        return self._appender.num_blocks_to_append(seq_id, num_tokens)

    def allocate(
        self,
        seq_id: Hashable,
        token_ids: Sequence[Any],
        *,
        use_prefix_cache: bool = True,
        salt: str | None = None,
    ) -> int:
        """Start sequence `seq_id` holding `token_ids`, reusing cached leading blocks.

        Args:
            seq_id: a new sequence id (any hashable).
            token_ids: the prompt, or its first chunk (continue with `append`).
            use_prefix_cache: False to reuse no cached block, so every token is computed
                (e.g. for its logits); the full blocks still enter the prefix index.
            salt: None, or a str that enters the first block's key: the sequence's blocks
                are then shared only with sequences allocated with the same salt.

        Returns:
            Leading tokens whose KV is already cached: a multiple of `block_size`, at most
            ``len(token_ids) - 1`` (0 without `use_prefix_cache`). The engine computes the rest.

        Raises:
            ValueError: empty `token_ids`, or `seq_id` in use.
            OutOfBlocks: not enough free blocks; nothing changed.
        """
        if seq_id in self._seqs:
            raise ValueError(f"allocate: expected a new seq_id, got {seq_id!r} already in use")
        seq, num_cached = self._prompts.allocate(seq_id, token_ids, use_prefix_cache, salt)
        self._seqs[seq_id] = seq
        return num_cached

    def append(self, seq_id: Hashable, token_ids: Sequence[Any]) -> list[int]:
        """Extend `seq_id` by `token_ids` (generated tokens or the next prompt chunk), as
        `append_many` does; returns its block table after the append (see `block_table`).

        Raises:
            KeyError: unknown `seq_id`.  ValueError: swapped out.
            OutOfBlocks: not enough free blocks; nothing changed.
        """
        tables = self.append_many([seq_id], [token_ids])
        if not tables:
            need, free = self.num_blocks_to_append(seq_id, len(token_ids)), self.num_free_blocks
            raise OutOfBlocks(f"append {seq_id!r}: need {need} blocks, {free} free")
        return tables[0]

    def append_many(
        self, seq_ids: Sequence[Hashable], token_ids: Sequence[Sequence[Any]]
    ) -> list[list[int]]:
        """Extend ``seq_ids[i]`` by ``token_ids[i]`` for each i in order, up to the first
        whose blocks are not free (it and those after it unchanged).

        Allocates blocks on demand. If the partially filled last block is shared (after a
        fork), it is copied first: a fresh block replaces it in this sequence's table and the
        copy ``(src, dst)`` is queued for `pop_copies()`. Appending nothing is a no-op.

        Returns:
            The block tables of the sequences appended to: one per leading pair.

        Raises:
            KeyError, ValueError: as `append` (those before the bad one appended).
        """
        return self._appender.append_many(seq_ids, token_ids)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Make `child_id` share every block of `parent_id` (ref_count += 1 each), no copy.

        A shared, partially filled last block is copied on the first append to either
        sequence (copy-on-write).

        Raises:
            KeyError: unknown `parent_id`.  ValueError: `child_id` in use, or the parent is
            swapped out.
        """
        parent = self._seqs.resident(parent_id, "fork")
        if child_id in self._seqs:
            raise ValueError(f"fork: expected a new child_id, got {child_id!r} already in use")
        for group in parent.groups:
            held = group.held
            self._pool.touch(held)
            self._counts.num_forked_blocks += len(held)
        parent.in_place_end = 0  # its partial last block is shared now
        # The same table list: neither changes it, a new one replaces it.
        self._seqs[child_id] = replace(
            parent,
            groups=tuple(replace(group, block_ids=group.block_ids[:]) for group in parent.groups),
            token_ids=list(parent.token_ids),
            prefix_uids=list(parent.prefix_uids),
        )

    def free(self, seq_id: Hashable) -> None:
        """Drop the sequence's references (its host blocks if swapped out). Its indexed full
        blocks stay cached, its last blocks evicted before its first. KeyError if unknown."""
        seq = self._seqs.pop(seq_id, None) or self._seqs.state(seq_id)  # KeyError if unknown
        for group in seq.groups:
            if group.host_block_ids is not None:
                self._host.free(group.host_block_ids)
            else:
                self._pool.free(group.held if group.num_dropped else group.block_ids)

    def pop_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write copies ``(src, dst)`` queued since the last call, in order: the
        engine copies each src block's KV into dst (in this order) before writing new KV."""
        return self._appender.pop_copies()

    def cache_blocks(
        self, token_ids: Sequence[Any], *, salt: str | None, blocks: Sequence[tuple[int, int]]
    ) -> list[int | None]:
        """Index fresh blocks as cached blocks holding the full blocks ``(group, block
        index)`` of `token_ids` (KV loaded from elsewhere), as `cache_loaded` does. Returns
        per pair the block to write its KV into, or None where none was taken."""
        return self._prompts.cache_blocks(token_ids, salt, blocks)

    def swap_out(self, seq_id: Hashable) -> list[tuple[int, int]]:
        """Move a sequence to the host pool: it keeps its tokens, held in host blocks.

        Returns:
            ``(device_block, host_block)`` pairs, one per block, in table order. The engine
            copies them (after the copies queued before this call, before anything written
            later) since the device blocks are free for reuse from now on.

        Raises:
            KeyError: unknown `seq_id`.  ValueError: already swapped out.
            OutOfBlocks: not enough free host blocks; nothing changed.
        """
        pairs = move_to_host(self._seqs.resident(seq_id, "swap_out"), self._pool, self._host)
        self._counts.num_swapped_out_blocks += len(pairs)
        return pairs

    def swap_in(self, seq_id: Hashable) -> list[tuple[int, int]]:
        """Bring a swapped-out sequence back to fresh device blocks; its full blocks are
        offered to the prefix index again.

        Returns:
            ``(host_block, device_block)`` pairs in table order, to copy before its next step.

        Raises:
            KeyError: unknown `seq_id`.  ValueError: not swapped out.
            OutOfBlocks: not enough free device blocks; nothing changed.
        """
        seq = self._seqs.swapped(seq_id, "swap_in")
        pairs = move_to_device(seq, self._pool, self._host)
        seq.unkey()
        seq.key_full_blocks(self._index, self.block_size, self._anchor)
        self._counts.num_swapped_in_blocks += len(pairs)
        return pairs

    def num_blocks_to_swap_in(self, seq_id: Hashable) -> int:
        """Device blocks `swap_in(seq_id)` needs. Raises KeyError if unknown, ValueError if
        resident."""
        seq = self._seqs.swapped(seq_id, "num_blocks_to_swap_in")
        return sum(len(group.host_block_ids or ()) for group in seq.groups)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (e.g. after new weights), if no device block is held.

        Returns:
            True if the cache is now empty; False (nothing changed) while a device block is held.
        """
        pool = self._pool
        if pool.num_free_blocks != pool.num_blocks:
            return False
        pool.reset_cache()
        self._prompts.forget()
        for seq in self._seqs.values():  # all swapped out: re-keyed from the root on swap_in
            seq.unkey()
        return True

    def check(self) -> None:
        """Prove the state consistent, or raise AssertionError naming the first thing wrong
        (see `pagedkv.memory.audit.check_state`)."""
        check_state(
            self._pool,
            self._host,
            self._index,
            self._seqs,
            self._appender.copies,
            self.block_size,
            self.windows,
            self._anchor,
        )

    def stats(self) -> dict[str, int]:
        """Counts of blocks and events since construction (prefix counts in tokens).

        Keys: num_blocks, num_free_blocks, num_used_blocks, num_cached_blocks (free and
        evictable), num_indexed_blocks, num_host_blocks, num_free_host_blocks, num_seqs,
        num_swapped_seqs, prefix_cache_queries, prefix_cache_hits, num_forked_blocks
        (block references `fork` shared instead of copying), num_cow_copies, num_evictions,
        num_swapped_out_blocks, num_swapped_in_blocks, num_pending_copies; and per KV cache
        group g: group_<g>_num_held_blocks (distinct device blocks its tables hold) and
        group_<g>_max_seq_blocks (the most any one sequence holds).
        """
        copies = self._appender.copies
        return self._counts.stats(
            self._pool, self._host, self._index, self._seqs, copies, len(self.windows)
        )
