"""A `KVCacheManager`'s whole state: its consistency check and its counts (standard library
only). `check_state` rebuilds the counts from the block tables, never from the pool, so a
forgotten decrement or a leak cannot hide; O(num_blocks + tokens held)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass

from pagedkv.memory.block_pool import BlockPool
from pagedkv.memory.prefix import ChainRoot, PrefixIndex
from pagedkv.memory.sequence import SeqState


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


def _check_swapped(seq_id: object, seq: SeqState, num_blocks: int, holders: list[int]) -> None:
    assert seq.host_block_ids is not None, f"{seq_id!r} is resident"
    assert not seq.block_ids, f"swapped-out {seq_id!r} still holds device blocks"
    assert seq.table is None, f"swapped-out {seq_id!r} still hands out a block table"
    assert len(seq.host_block_ids) == num_blocks, (
        f"swapped-out {seq_id!r}: {len(seq.host_block_ids)} host blocks for {seq.num_tokens} tokens"
    )
    _count(holders, seq.host_block_ids, seq_id)


def _check_resident(
    seq_id: object, seq: SeqState, block_size: int, index: PrefixIndex | None, holders: list[int]
) -> None:
    num_tokens = seq.num_tokens
    assert len(seq.block_ids) == -(-num_tokens // block_size), (
        f"{seq_id!r}: {len(seq.block_ids)} blocks for {num_tokens} tokens (block_size {block_size})"
    )
    _count(holders, seq.block_ids, seq_id)
    assert seq.table is None or seq.table == seq.block_ids.tolist(), (
        f"{seq_id!r}: the block table handed out is {seq.table}, not its blocks"
    )
    if index is not None:
        assert len(seq.token_ids) == num_tokens, (
            f"{seq_id!r}: {len(seq.token_ids)} tokens kept, {num_tokens} counted"
        )
        assert seq.num_keyed == num_tokens // block_size, (
            f"{seq_id!r}: {seq.num_keyed} blocks keyed, {num_tokens // block_size} full"
        )
        _check_keys(index, block_size, seq_id, seq)


def check_state(
    pool: BlockPool,
    host: BlockPool,
    index: PrefixIndex | None,
    seqs: Mapping[Hashable, SeqState],
    copies: Sequence[tuple[int, int]],
    block_size: int,
) -> None:
    """Prove a manager's state consistent, or raise AssertionError naming the first thing
    wrong.

    Every block's count equals its number of holders; no block is both free and held;
    free + cached + held = num_blocks (device and host); every indexed block held by a
    sequence holds exactly its key's tokens after its key's parent (the first after the
    sequence's chain root: ``ROOT_UID`` or its salt); queued copies name device blocks.
    """
    holders = [0] * pool.num_blocks
    host_holders = [0] * host.num_blocks
    for seq_id, seq in seqs.items():
        assert seq.num_tokens > 0, f"sequence {seq_id!r} holds no token"
        if seq.host_block_ids is not None:
            num_blocks = -(-seq.num_tokens // block_size)
            _check_swapped(seq_id, seq, num_blocks, host_holders)
        else:
            _check_resident(seq_id, seq, block_size, index, holders)
    pool.check(holders)
    host.check(host_holders)
    if index is not None:
        index.check()
    for src, dst in copies:
        assert 0 <= src < pool.num_blocks and 0 <= dst < pool.num_blocks, (
            f"queued copy ({src}, {dst}) names a block outside the pool"
        )


@dataclass(slots=True)
class EventCounts:
    """Events since a manager's construction (prefix counts in tokens)."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_forked_blocks: int = 0  # block references `fork` shared (each a block not copied)
    num_cow_copies: int = 0
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0

    def stats(
        self,
        pool: BlockPool,
        host: BlockPool,
        index: PrefixIndex | None,
        seqs: Mapping[Hashable, SeqState],
        copies: Sequence[tuple[int, int]],
    ) -> dict[str, int]:
        """These counts with the pools' sizes (see `KVCacheManager.stats`)."""
        return {
            "num_blocks": pool.num_blocks,
            "num_free_blocks": pool.num_free_blocks,
            "num_used_blocks": pool.num_blocks - pool.num_free_blocks,
            "num_cached_blocks": pool.num_cached_blocks,
            "num_indexed_blocks": len(index) if index is not None else 0,
            "num_host_blocks": host.num_blocks,
            "num_free_host_blocks": host.num_free_blocks,
            "num_seqs": len(seqs),
            "num_swapped_seqs": sum(s.host_block_ids is not None for s in seqs.values()),
            **asdict(self),
            "num_evictions": pool.num_evictions,
            "num_pending_copies": len(copies),
        }
