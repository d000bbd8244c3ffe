"""A `KVCacheManager`'s whole state: its consistency check and its counts (standard library
only). `check_state` rebuilds the counts from the block tables, never from the pool, so a
forgotten decrement or a leak cannot hide; O(num_blocks + tokens held)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace

from pagedkv.memory.block_pool import BlockPool
from pagedkv.memory.content_hash import chain_start, content_names
from pagedkv.memory.groups import NULL_BLOCK, GroupBlocks, first_needed_block
from pagedkv.memory.prefix import PrefixIndex
from pagedkv.memory.sequence import SeqState, table_of


def _count(holders: list[int], block_ids: Sequence[int], seq_id: object) -> None:
    seen = set()
    for b in block_ids:
        assert 0 <= b < len(holders), f"{seq_id!r} holds {b}, not a block id"
        assert b not in seen, f"{seq_id!r} holds block {b} twice"
        seen.add(b)
        holders[b] += 1


def _check_keys(
    index: PrefixIndex, block_size: int, seq_id: object, seq: SeqState, g: int, anchor: int
) -> None:
    """Each indexed block of the sequence's group `g` holds exactly its key's tokens and
    parent: in the `anchor` group the name of the prefix before it (the group's chain start
    for the first block), in another group ``(g, anchor's name of the prefix through it)``;
    the anchor's names are its entries' uids, or (`hashed`) the content hashes."""
    tokens, group, names = seq.token_ids, seq.groups[g], seq.prefix_uids
    assert len(names) == group.num_keyed, (
        f"{seq_id!r}: {len(names)} prefix names for {group.num_keyed} keyed blocks"
    )
    start = chain_start(seq.chain_root, g, group.hashed)
    for i, b in enumerate(group.block_ids):
        entry = index.block_entries[b] if b != NULL_BLOCK else None
        if entry is None:
            continue
        _, uid, (key_parent, key_tokens) = entry
        assert i < len(tokens) // block_size, (
            f"{seq_id!r}: partial block {b} (position {i}) is in the prefix index"
        )
        expected = index.block_tokens(tokens[i * block_size : (i + 1) * block_size])
        assert key_tokens == expected, (
            f"{seq_id!r}: block {b} (position {i}) is indexed under other tokens"
        )
        parent = (g, names[i]) if g != anchor else names[i - 1] if i else start
        assert key_parent == parent, (
            f"{seq_id!r}: block {b} (position {i}) of group {g} chains from "
            f"{key_parent!r}, expected {parent!r}"
        )
        name = content_names(parent, [key_tokens]) if group.hashed else [uid]
        assert g != anchor or name in ([], [names[i]]), (
            f"{seq_id!r}: block {b} (position {i}) is named {name}, the prefix {names[i]!r}"
        )


def _check_swapped(seq_id: object, seq: SeqState, block_size: int, holders: list[int]) -> None:
    assert seq.table is None, f"swapped-out {seq_id!r} still hands out a block table"
    for group in seq.groups:
        host = group.host_block_ids
        assert host is not None, f"swapped-out {seq_id!r} has no host blocks"
        assert not group.block_ids, f"swapped-out {seq_id!r} still holds device blocks"
        num_blocks = -(-seq.num_tokens // block_size) - group.num_dropped
        assert len(host) == num_blocks, (
            f"swapped-out {seq_id!r}: {len(host)} host blocks for {seq.num_tokens} tokens"
        )
        _count(holders, host, seq_id)


def _check_group(
    seq_id: object, seq: SeqState, group: GroupBlocks, window: int | None, block_size: int
) -> None:
    """The group's table covers the tokens, with NULL_BLOCK exactly at the blocks that slid
    out, all before the window of the last token."""
    num_tokens = seq.num_tokens
    assert group.host_block_ids is None, f"resident {seq_id!r} still holds host blocks"
    assert len(group.block_ids) == -(-num_tokens // block_size), (
        f"{seq_id!r}: {len(group.block_ids)} blocks for {num_tokens} tokens "
        f"(block_size {block_size})"
    )
    dropped = group.num_dropped
    assert all(b == NULL_BLOCK for b in group.block_ids[:dropped]), (
        f"{seq_id!r}: a block before the window is still in its table"
    )
    assert NULL_BLOCK not in group.held, f"{seq_id!r}: a block inside the window is missing"
    limit = 0 if window is None else max(0, num_tokens - window) // block_size
    assert dropped <= limit, (
        f"{seq_id!r}: {dropped} blocks slid out, the window of {window} reaches block {limit}"
    )


def _check_in_place(seq_id: object, seq: SeqState, group: GroupBlocks, window: int | None,
                    block_size: int, pool: BlockPool) -> None:  # fmt: skip
    """Appends up to `SeqState.in_place_end` tokens, each starting before it, change none
    of the group's blocks."""
    end, num_tokens = seq.in_place_end, seq.num_tokens
    if end <= num_tokens:
        return
    assert end <= len(group.block_ids) * block_size, (
        f"{seq_id!r}: appends up to {end} tokens pass as taking no block, it has "
        f"{len(group.block_ids)}"
    )
    assert not (num_tokens % block_size and pool.is_shared(group.block_ids[-1])), (
        f"{seq_id!r}: appends pass as changing no block, its partial last block is shared"
    )
    assert first_needed_block(window, end - 1, block_size) <= group.num_dropped, (
        f"{seq_id!r}: appends up to {end} tokens pass as changing no block, the window "
        f"of {window} slides past block {group.num_dropped}"
    )


def _check_resident(
    seq_id: object,
    seq: SeqState,
    block_size: int,
    index: PrefixIndex | None,
    holders: list[int],
    windows: Sequence[int | None],
    anchor: int,
    pool: BlockPool,
) -> None:
    for g, (group, window) in enumerate(zip(seq.groups, windows, strict=True)):
        _check_group(seq_id, seq, group, window, block_size)
        _check_in_place(seq_id, seq, group, window, block_size, pool)
        _count(holders, group.held, seq_id)
        if index is not None:
            assert group.num_keyed == seq.num_tokens // block_size, (
                f"{seq_id!r}: {group.num_keyed} blocks keyed, {seq.num_tokens // block_size} full"
            )
            _check_keys(index, block_size, seq_id, seq, g, anchor)
    assert seq.table is None or seq.table == table_of(replace(seq, table=None)), (
        f"{seq_id!r}: the block table handed out is {seq.table}, not its blocks"
    )
    if index is not None:
        assert len(seq.token_ids) == seq.num_tokens, (
            f"{seq_id!r}: {len(seq.token_ids)} tokens kept, {seq.num_tokens} counted"
        )


def check_state(
    pool: BlockPool,
    host: BlockPool,
    index: PrefixIndex | None,
    seqs: Mapping[Hashable, SeqState],
    copies: Sequence[tuple[int, int]],
    block_size: int,
    windows: Sequence[int | None] = (None,),
    anchor: int = 0,
) -> None:
    """Prove a manager's state consistent, or raise AssertionError naming the first thing
    wrong.

    Every block's count equals its number of holders over every KV cache group; no block is
    both free and held; free + cached + held = num_blocks (device and host); each group's
    table covers the tokens, without the blocks that slid out of its `windows` entry; every
    indexed block held by a sequence holds exactly its key's tokens after its key's parent:
    in the `anchor` group the block before it (the first: the group's chain root,
    ``ROOT_UID`` or its salt), in the others the anchor's uid for the same prefix; queued
    copies name device blocks.
    """
    holders = [0] * pool.num_blocks
    host_holders = [0] * host.num_blocks
    for seq_id, seq in seqs.items():
        assert seq.num_tokens > 0, f"sequence {seq_id!r} holds no token"
        assert len(seq.groups) == len(windows), (
            f"{seq_id!r}: {len(seq.groups)} groups, the manager has {len(windows)}"
        )
        if seq.is_swapped:
            _check_swapped(seq_id, seq, block_size, host_holders)
        else:
            _check_resident(seq_id, seq, block_size, index, holders, windows, anchor, pool)
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
        num_groups: int = 1,
    ) -> dict[str, int]:
        """These counts with the pools' sizes (see `KVCacheManager.stats`)."""
        return {
            **_group_stats(seqs, num_groups),
            "num_blocks": pool.num_blocks,
            "num_free_blocks": pool.num_free_blocks,
            "num_used_blocks": pool.num_blocks - pool.num_free_blocks,
            "num_cached_blocks": pool.num_cached_blocks,
            "num_indexed_blocks": len(index) if index is not None else 0,
            "num_host_blocks": host.num_blocks,
            "num_free_host_blocks": host.num_free_blocks,
            "num_seqs": len(seqs),
            "num_swapped_seqs": sum(s.is_swapped for s in seqs.values()),
            **asdict(self),
            "num_evictions": pool.num_evictions,
            "num_pending_copies": len(copies),
        }


def _group_stats(seqs: Mapping[Hashable, SeqState], num_groups: int) -> dict[str, int]:
    """Per KV cache group g: group_<g>_num_held_blocks, group_<g>_max_seq_blocks."""
    held: list[set[int]] = [set() for _ in range(num_groups)]
    most = [0] * num_groups
    for seq in seqs.values():
        for g, group in enumerate(seq.groups):
            group_held = group.held
            held[g].update(group_held)
            most[g] = max(most[g], len(group_held))
    out: dict[str, int] = {}
    for g, (blocks, num) in enumerate(zip(held, most, strict=True)):
        out[f"group_{g}_num_held_blocks"], out[f"group_{g}_max_seq_blocks"] = len(blocks), num
    return out
