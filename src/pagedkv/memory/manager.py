"""KVCacheManager: sequences' block tables over a shared block pool.

Prefix sharing, copy-on-write, swap to a host pool, all-or-nothing allocation and a
consistency check. Standard library only: no tensors here.

A sequence's blocks::

    block_table   [ b0 | b1 | b2 | b3 ]       slot(p) = block_table[p // B] * B + p % B
    tokens        |0..B-1|B..2B-1|...|  n-1|  (B = block_size; the last block may be partial)
                   '- full blocks are keyed in the prefix index as soon as their tokens are known
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

from pagedkv.errors import OutOfBlocks
from pagedkv.memory.prefix import ChainRoot, chain_root
from pagedkv.memory.sequence import SeqId, SeqState, positive_int, token_tuple
from pagedkv.memory.state import ManagerState


class KVCacheManager(ManagerState):
    """The paged KV cache's bookkeeping: which blocks hold which sequence's tokens.

    Args:
        num_blocks: device blocks in the pool (> 0).
        block_size: tokens per block (> 0).
        enable_prefix_caching: keep full blocks findable by their token prefix, so a new
            prompt reuses them; freed ones stay cached until the space is needed.
        num_host_blocks: blocks of the host pool for `swap_out` (>= 0).

    Raises:
        ValueError: a non-positive size (or a negative `num_host_blocks`).

    Sequence ids are any hashable. Token ids are compared, never interpreted. Running out of
    blocks raises `OutOfBlocks` and leaves every piece of state unchanged.

    The caller's duties: execute copies (`pop_copies`) and swap pairs in the order the calls
    were made, before the forward pass; and compute every token handed to `allocate` /
    `append` in the next forward pass (full blocks are findable from the call on), so never
    free or swap out a sequence between that call and its forward pass.
    """

    # ----- prefix lookups -------------------------------------------------------------------
    def _lookup(
        self,
        token_ids: Sequence[Any],
        with_rest: bool = False,
        use_prefix_cache: bool = True,
        salt: str | None = None,
    ) -> tuple[list[int], ChainRoot, Sequence[Any]]:
        """`PrefixIndex.lookup` of a prompt from its salt's root: ``([], root, ())`` without
        an index, no hit without `use_prefix_cache`."""
        root = chain_root(salt)
        if self._index is None:
            return [], root, ()
        # The last token is always computed (its logits are needed): at most n - 1 cached.
        max_blocks = (len(token_ids) - 1) // self._block_size if use_prefix_cache else 0
        return self._index.lookup(token_ids, self._block_size, max_blocks, with_rest, root)

    def num_cached_tokens(self, token_ids: Sequence[Any], *, salt: str | None = None) -> int:
        """Tokens `allocate(_, token_ids, salt=salt)` would find cached now. No side effects.

        Returns:
            A multiple of `block_size`, at most ``len(token_ids) - 1``.
        """
        return len(self._lookup(token_ids, salt=salt)[0]) * self._block_size

    def num_blocks_to_allocate(
        self, token_ids: Sequence[Any], *, use_prefix_cache: bool = True, salt: str | None = None
    ) -> int:
        """Free blocks `allocate(_, token_ids, use_prefix_cache=..., salt=...)` would take now
        (after prefix hits).

        A hit on a cached-but-free block counts as one, so the allocation succeeds exactly
        when the result is <= `num_free_blocks`.
        """
        hits = self._lookup(token_ids, use_prefix_cache=use_prefix_cache, salt=salt)[0]
        num_needed = -(-len(token_ids) // self._block_size)
        return num_needed - len(hits) + self._pool.num_evictable(hits)

    def num_blocks_to_append(self, seq_id: SeqId, num_tokens: int) -> int:
        """Free blocks `append(seq_id, <num_tokens tokens>)` would take now.

        New blocks, plus one copy-on-write block if the partially filled last block is shared.

        Raises:
            KeyError: unknown `seq_id`.  ValueError: swapped out, or `num_tokens` < 0.
        """
        seq = self._resident(seq_id, "num_blocks_to_append")
        positive_int("num_tokens", num_tokens, minimum=0)
        return self._append_cost(seq, num_tokens)[0]

    def _append_cost(self, seq: SeqState, num_tokens: int) -> tuple[int, bool]:
        block_size, num_cur = self._block_size, len(seq.token_ids)
        num_new = -(-(num_cur + num_tokens) // block_size) - len(seq.block_ids)
        is_cow = (
            num_tokens > 0 and num_cur % block_size != 0 and self._pool.is_shared(seq.block_ids[-1])
        )
        return num_new + is_cow, is_cow

    # ----- sequence lifecycle ---------------------------------------------------------------
    def allocate(
        self,
        seq_id: SeqId,
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
        tokens = token_tuple(token_ids)
        if not tokens:
            raise ValueError("allocate: expected at least one token, got an empty prompt")
        # One pass over the prompt: the cached blocks and the keys of the full blocks after.
        hits, chain_uid, keys = self._lookup(
            tokens, with_rest=True, use_prefix_cache=use_prefix_cache, salt=salt
        )
        index, block_size, pool = self._index, self._block_size, self._pool
        num_hits = len(hits)
        num_fresh = -(-len(tokens) // block_size) - num_hits
        # Hits on cached-but-free blocks take free blocks too; count them only when it matters.
        if num_fresh + num_hits > pool.num_free_blocks - pool.num_cached_blocks and (
            num_fresh + pool.num_evictable(hits) > pool.num_free_blocks
        ):
            raise OutOfBlocks(
                f"allocate {seq_id!r}: need {num_fresh} new blocks after {num_hits} cached, "
                f"{pool.num_free_blocks} free"
            )
        # Take the hits first (cached ones become held) so the fresh blocks cannot evict them.
        pool.touch(hits)
        block_ids = array("i", hits)
        block_ids += pool.allocate(num_fresh)
        num_keyed = 0
        if index is not None:  # `keys` holds the full blocks after the hits
            chain_uid = index.insert_keys(
                chain_uid, keys, block_ids[num_hits : num_hits + len(keys)]
            )
            num_keyed = len(tokens) // block_size
            if use_prefix_cache:  # the counts of prefix lookups
                self._num_queries += len(tokens)
                self._num_hits += num_hits * block_size
        self._seqs[seq_id] = SeqState(
            block_ids, tokens, num_keyed, chain_uid, chain_root=chain_root(salt)
        )
        return num_hits * block_size

    def append(self, seq_id: SeqId, token_ids: Sequence[Any]) -> None:
        """Extend `seq_id` by `token_ids` (generated tokens or the next prompt chunk).

        Allocates blocks on demand. If the partially filled last block is shared (after a
        fork), it is copied first: a fresh block replaces it in this sequence's table and the
        copy ``(src, dst)`` is queued for `pop_copies()`. Appending nothing is a no-op.

        Raises:
            KeyError: unknown `seq_id`.  ValueError: swapped out.
            OutOfBlocks: not enough free blocks; nothing changed.
        """
        seq = self._resident(seq_id, "append")
        # A decode step appends one token to every sequence: keep the common path short.
        tokens = token_ids if type(token_ids) is list else list(token_tuple(token_ids))
        num_blocks, is_cow = self._append_cost(seq, len(tokens))
        if num_blocks:
            pool = self._pool
            if num_blocks > pool.num_free_blocks:
                raise OutOfBlocks(
                    f"append {seq_id!r}: need {num_blocks} blocks, {pool.num_free_blocks} free"
                )
            new_block_ids = pool.allocate(num_blocks)
            if is_cow:
                src, dst = seq.block_ids[-1], new_block_ids.pop(0)
                pool.free([src])  # shared, so it stays held by the others
                seq.block_ids[-1] = dst
                self._copies.append((src, dst))
                self._num_cow += 1
            seq.block_ids += new_block_ids
            seq.table = None
        if isinstance(seq.token_ids, tuple):  # the prompt, kept as allocate got it
            seq.token_ids = list(seq.token_ids)
        seq.token_ids += tokens
        if tokens:
            seq.is_tail_own = True
        if len(seq.token_ids) // self._block_size > seq.num_keyed:
            self._key_full_blocks(seq)

    def append_token(self, seq_id: SeqId, token_id: Any) -> list[int] | None:
        """A decode step's append: `append(seq_id, [token_id])` if the blocks it takes are
        free, returning the block table; else None and nothing changed.

        The common case (room in an unshared last block) allocates nothing and copies no
        table: the same list comes back until the blocks change, then a new one (so a list
        handed out earlier still describes the step it was handed to). Never mutate it.

        Returns:
            The sequence's block ids (the new token's slot is ``table[p // B] * B + p % B``
            at its position p), or None when `num_blocks_to_append(seq_id, 1)` blocks are
            not free.

        Raises:
            KeyError: unknown `seq_id`.  ValueError: swapped out.
        """
        seq = self._seqs.get(seq_id)
        if seq is not None and seq.is_tail_own:  # the common case: see `SeqState`
            tokens = seq.token_ids
            if not len(tokens) % self._block_size:
                if not self._pool.num_free_blocks:
                    return None
                seq.block_ids.append(self._pool.allocate_one())
                seq.table = None
            tokens.append(token_id)  # type: ignore[union-attr]
            if len(tokens) // self._block_size > seq.num_keyed:
                self._key_full_blocks(seq)
        else:  # a copy-on-write, or the prompt's tuple: the general path
            seq = self._resident(seq_id, "append_token")
            if self._append_cost(seq, 1)[0] > self._pool.num_free_blocks:
                return None
            self.append(seq_id, [token_id])
        table = seq.table
        if table is None:
            table = seq.table = seq.block_ids.tolist()
        return table

    def _key_full_blocks(self, seq: SeqState) -> None:
        """Offer the sequence's newly full blocks to the prefix index (chained keys)."""
        if self._index is None:
            return
        start = seq.num_keyed
        keys = self._index.keys_of(seq.token_ids, self._block_size, start)
        seq.chain_uid = self._index.insert_keys(
            seq.chain_uid, keys, seq.block_ids[start : start + len(keys)]
        )
        seq.num_keyed = start + len(keys)

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """Make `child_id` share every block of `parent_id` (ref_count += 1 each), no copy.

        A shared, partially filled last block is copied on the first append to either
        sequence (copy-on-write).

        Raises:
            KeyError: unknown `parent_id`.  ValueError: `child_id` in use, or the parent is
            swapped out.
        """
        parent = self._resident(parent_id, "fork")
        if child_id in self._seqs:
            raise ValueError(f"fork: expected a new child_id, got {child_id!r} already in use")
        self._pool.touch(parent.block_ids)
        parent.is_tail_own = False
        self._num_forked += len(parent.block_ids)
        self._seqs[child_id] = SeqState(
            parent.block_ids[:],
            list(parent.token_ids),
            parent.num_keyed,
            parent.chain_uid,
            chain_root=parent.chain_root,
        )

    def free(self, seq_id: SeqId) -> None:
        """Drop the sequence's references (its host blocks if swapped out).

        With prefix caching its indexed full blocks stay cached, evictable least recently
        used first; the sequence's last blocks are evicted before its first ones.

        Raises:
            KeyError: unknown `seq_id`.
        """
        seq = self._get(seq_id)
        del self._seqs[seq_id]
        if seq.host_block_ids is not None:
            self._host.free(seq.host_block_ids)
        else:
            self._pool.free(seq.block_ids)

    def pop_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write copies ``(src, dst)`` queued since the last call, in order.

        The engine copies each src block's KV into dst (in this order) before writing new KV.
        """
        copies, self._copies = self._copies, []
        return copies

    # ----- swap to the host pool ------------------------------------------------------------
    def swap_out(self, seq_id: SeqId) -> list[tuple[int, int]]:
        """Move a sequence to the host pool: it keeps its tokens, held in host blocks.

        Returns:
            ``(device_block, host_block)`` pairs, one per block, in table order. The engine
            copies them (after the copies queued before this call, before anything written
            later) since the device blocks are free for reuse from now on.

        Raises:
            KeyError: unknown `seq_id`.  ValueError: already swapped out.
            OutOfBlocks: not enough free host blocks; nothing changed.
        """
        seq = self._resident(seq_id, "swap_out")
        host_block_ids = self._host.allocate(len(seq.block_ids))
        pairs = list(zip(seq.block_ids, host_block_ids, strict=True))
        self._pool.free(seq.block_ids)
        seq.block_ids, seq.host_block_ids, seq.table = array("i"), host_block_ids, None
        seq.is_tail_own = False
        self._num_swapped_out += len(pairs)
        return pairs

    def swap_in(self, seq_id: SeqId) -> list[tuple[int, int]]:
        """Bring a swapped-out sequence back to fresh device blocks; its full blocks are
        offered to the prefix index again.

        Returns:
            ``(host_block, device_block)`` pairs in table order, to copy before the sequence's
            next step.

        Raises:
            KeyError: unknown `seq_id`.  ValueError: not swapped out.
            OutOfBlocks: not enough free device blocks; nothing changed.
        """
        seq = self._get(seq_id)
        if seq.host_block_ids is None:
            raise ValueError(f"swap_in: expected a swapped-out sequence, got {seq_id!r} resident")
        block_ids = self._pool.allocate(len(seq.host_block_ids))
        pairs = list(zip(seq.host_block_ids, block_ids, strict=True))
        self._host.free(seq.host_block_ids)
        seq.block_ids, seq.host_block_ids, seq.table = block_ids, None, None
        seq.num_keyed, seq.chain_uid = 0, seq.chain_root
        self._key_full_blocks(seq)
        self._num_swapped_in += len(pairs)
        return pairs

    def num_blocks_to_swap_in(self, seq_id: SeqId) -> int:
        """Device blocks `swap_in(seq_id)` needs. Raises KeyError if unknown, ValueError if
        resident."""
        seq = self._get(seq_id)
        if seq.host_block_ids is None:
            raise ValueError(f"expected a swapped-out sequence, got {seq_id!r} resident")
        return len(seq.host_block_ids)

    # ----- cache control --------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (e.g. after new weights), if no device block is held.

        Returns:
            True if the cache is now empty; False (nothing changed) while any device block
            is in use.
        """
        pool = self._pool
        if pool.num_free_blocks != pool.num_blocks:
            return False
        pool.reset_cache()
        for seq in self._seqs.values():  # all swapped out: re-keyed from the root on swap_in
            seq.num_keyed, seq.chain_uid = 0, seq.chain_root
        return True
