"""`KVCacheManager`'s state and every read-only view of it: sizes and membership,
`block_table`, `num_tokens`, `slot_mapping` of one sequence, and `check()` and `stats()` of
the whole state. The operations that change the state live in `pagedkv.memory.manager`.

`check` rebuilds the counts from the sequences' block tables, never reading them from the
pool, so a forgotten decrement (a block whose count exceeds its holders) or a leak (a block
neither free nor held) cannot hide. O(num_blocks + tokens held): for tests and debug runs.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.memory.block_pool import BlockPool
from pagedkv.memory.prefix import ChainRoot, PrefixIndex
from pagedkv.memory.sequence import SeqId, SeqState, positive_int


def _count(holders: list[int], block_ids: Sequence[int], seq_id: object) -> None:
    seen = set()
    for b in block_ids:
        assert 0 <= b < len(holders), f"{seq_id!r} holds {b}, not a block id"
        assert b not in seen, f"{seq_id!r} holds block {b} twice"
        seen.add(b)
        holders[b] += 1


def _check_keys(index: PrefixIndex, block_size: int, seq_id: object, seq: SeqState) -> None:
    """Each indexed block of the sequence holds exactly its key's tokens and parent."""
    tokens = seq.token_ids
    parent_uid: ChainRoot | None = seq.chain_root
    for i, b in enumerate(seq.block_ids):
        entry = index.block_entries[b]
        if entry is None:
            parent_uid = None
            continue
        _, uid, (key_parent, key_tokens) = entry
        assert i < len(tokens) // block_size, (
            f"{seq_id!r}: partial block {b} (position {i}) is in the prefix index"
        )
        expected = index.block_tokens(tokens[i * block_size : (i + 1) * block_size])
        assert key_tokens == expected, (
            f"{seq_id!r}: block {b} (position {i}) is indexed under other tokens"
        )
        assert parent_uid is None or key_parent == parent_uid, (
            f"{seq_id!r}: block {b} (position {i}) chains from uid {key_parent}, "
            f"its predecessor is {parent_uid}"
        )
        parent_uid = uid


class ManagerState:
    """The state `KVCacheManager` changes, and every read-only view of it. The arguments
    are those of `KVCacheManager`."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        num_host_blocks: int = 0,
    ) -> None:
        positive_int("num_blocks", num_blocks)
        self._block_size = positive_int("block_size", block_size)
        positive_int("num_host_blocks", num_host_blocks, minimum=0)
        self._index = PrefixIndex(num_blocks) if enable_prefix_caching else None
        self._pool = BlockPool(num_blocks, self._index)
        self._host = BlockPool(num_host_blocks)
        self._seqs: dict[SeqId, SeqState] = {}
        self._copies: list[tuple[int, int]] = []
        self._num_queries = self._num_hits = self._num_cow = 0
        self._num_forked = 0  # block references shared by fork (each a block not copied)
        self._num_swapped_out = self._num_swapped_in = 0

    # ----- sizes and membership -------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_host_blocks(self) -> int:
        return self._host.num_blocks

    @property
    def enable_prefix_caching(self) -> bool:
        return self._index is not None

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

    def seq_ids(self) -> list[SeqId]:
        """Ids of the live sequences (resident or swapped out), oldest first."""
        return list(self._seqs)

    def is_swapped(self, seq_id: SeqId) -> bool:
        """Whether `seq_id` is swapped out. Raises KeyError if unknown."""
        return self._get(seq_id).host_block_ids is not None

    def _get(self, seq_id: SeqId) -> SeqState:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"unknown sequence {seq_id!r}")
        return seq

    def _resident(self, seq_id: SeqId, op: str) -> SeqState:
        seq = self._get(seq_id)
        if seq.host_block_ids is not None:
            raise ValueError(
                f"{op}: expected a resident sequence, got {seq_id!r} swapped out "
                "(only swap_in and free apply)"
            )
        return seq

    # ----- one sequence ---------------------------------------------------------------------
    def block_table(self, seq_id: SeqId) -> list[int]:
        """A copy of the sequence's block ids, logical block order. Raises as `num_tokens`."""
        return self._resident(seq_id, "block_table").block_ids.tolist()

    def num_tokens(self, seq_id: SeqId) -> int:
        """Tokens the sequence holds.

        Raises:
            KeyError: unknown `seq_id`.  ValueError: swapped out.
        """
        return len(self._resident(seq_id, "num_tokens").token_ids)

    def slot_mapping(self, seq_id: SeqId, start: int, end: int) -> list[int]:
        """Slots of positions ``start <= p < end``: ``block_table[p // B] * B + p % B``.

        Raises:
            KeyError: unknown `seq_id`.
            ValueError: swapped out, or not ``0 <= start <= end <= num_tokens``.
        """
        seq = self._resident(seq_id, "slot_mapping")
        if not (
            isinstance(start, int)
            and isinstance(end, int)
            and 0 <= start <= end <= len(seq.token_ids)
        ):
            raise ValueError(
                f"slot_mapping: expected 0 <= start <= end <= "
                f"{len(seq.token_ids)}, got start={start!r}, end={end!r}"
            )
        block_size, slots = self._block_size, list[int]()
        # One range per block touched, not one Python step per token.
        for i in range(start // block_size, -(-end // block_size)):
            base = seq.block_ids[i] * block_size
            first = max(start - i * block_size, 0)
            last = min(end - i * block_size, block_size)
            slots += range(base + first, base + last)
        return slots

    # ----- the whole state ------------------------------------------------------------------
    def check(self) -> None:
        """Prove the state consistent, or raise AssertionError naming the first thing wrong.

        Every block's count equals its number of holders; no block is both free and held;
        free + cached + held = num_blocks (device and host); every indexed block held by a
        sequence holds exactly its key's tokens after its key's parent.
        """
        pool, host, index, block_size = self._pool, self._host, self._index, self._block_size
        holders = [0] * pool.num_blocks
        host_holders = [0] * host.num_blocks
        for seq_id, seq in self._seqs.items():
            num_tokens = len(seq.token_ids)
            assert num_tokens > 0, f"sequence {seq_id!r} holds no token"
            num_blocks = -(-num_tokens // block_size)
            if seq.host_block_ids is not None:
                assert not seq.block_ids, f"swapped-out {seq_id!r} still holds device blocks"
                assert seq.table is None, f"swapped-out {seq_id!r} still hands out a block table"
                assert not seq.is_tail_own, f"swapped-out {seq_id!r} is marked as owning its tail"
                assert len(seq.host_block_ids) == num_blocks, (
                    f"swapped-out {seq_id!r}: {len(seq.host_block_ids)} host blocks for "
                    f"{num_tokens} tokens"
                )
                _count(host_holders, seq.host_block_ids, seq_id)
                continue
            assert len(seq.block_ids) == num_blocks, (
                f"{seq_id!r}: {len(seq.block_ids)} blocks for {num_tokens} tokens "
                f"(block_size {block_size})"
            )
            _count(holders, seq.block_ids, seq_id)
            assert seq.table is None or seq.table == seq.block_ids.tolist(), (
                f"{seq_id!r}: the block table handed out is {seq.table}, not its blocks"
            )
            if seq.is_tail_own:
                assert isinstance(seq.token_ids, list), f"{seq_id!r}: tail own but tokens a tuple"
                assert not num_tokens % block_size or not pool.is_shared(seq.block_ids[-1]), (
                    f"{seq_id!r}: its partial last block is shared but marked its own"
                )
            if index is not None:
                assert seq.num_keyed == num_tokens // block_size, (
                    f"{seq_id!r}: {seq.num_keyed} blocks keyed, {num_tokens // block_size} full"
                )
                _check_keys(index, block_size, seq_id, seq)
        pool.check(holders)
        host.check(host_holders)
        if index is not None:
            index.check()
        for src, dst in self._copies:
            assert 0 <= src < pool.num_blocks and 0 <= dst < pool.num_blocks, (
                f"queued copy ({src}, {dst}) names a block outside the pool"
            )

    def stats(self) -> dict[str, int]:
        """Counts of blocks and events since construction (prefix counts in tokens).

        Keys: num_blocks, num_free_blocks, num_used_blocks, num_cached_blocks (free and
        evictable), num_indexed_blocks, num_host_blocks, num_free_host_blocks, num_seqs,
        num_swapped_seqs, prefix_cache_queries, prefix_cache_hits, num_forked_blocks
        (block references `fork` shared instead of copying), num_cow_copies, num_evictions,
        num_swapped_out_blocks, num_swapped_in_blocks, num_pending_copies.
        """
        pool, host, index = self._pool, self._host, self._index
        num_swapped = sum(s.host_block_ids is not None for s in self._seqs.values())
        return {
            "num_blocks": pool.num_blocks,
            "num_free_blocks": pool.num_free_blocks,
            "num_used_blocks": pool.num_blocks - pool.num_free_blocks,
            "num_cached_blocks": pool.num_cached_blocks,
            "num_indexed_blocks": len(index) if index is not None else 0,
            "num_host_blocks": host.num_blocks,
            "num_free_host_blocks": host.num_free_blocks,
            "num_seqs": len(self._seqs),
            "num_swapped_seqs": num_swapped,
            "prefix_cache_queries": self._num_queries,
            "prefix_cache_hits": self._num_hits,
            "num_forked_blocks": self._num_forked,
            "num_cow_copies": self._num_cow,
            "num_evictions": pool.num_evictions,
            "num_swapped_out_blocks": self._num_swapped_out,
            "num_swapped_in_blocks": self._num_swapped_in,
            "num_pending_copies": len(self._copies),
        }
