"""How a sequence's KV cache groups take blocks on `allocate` and move them on swap
(standard library only): the manager's steps that loop over groups."""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence

from pagedkv.errors import OutOfBlocks
from pagedkv.memory.block_pool import BlockPool
from pagedkv.memory.groups import NULL_BLOCK, GroupBlocks, first_needed_block
from pagedkv.memory.prefix import ChainRoot, group_root
from pagedkv.memory.sequence import SeqState


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
    uids: list[int],
) -> list[GroupBlocks]:
    """A new sequence's blocks, per group: NULL_BLOCK before its `used` hits, then
    `num_fresh` fresh blocks; the first `num_hits` blocks count as keyed, the `anchor`
    group's chain going on from the last hit's uid (``uids[-1]``, else the chain's `root`);
    `SeqState.key_full_blocks` keys the rest."""
    groups = []
    for g, group_used in enumerate(used):
        num_null = num_hits - len(group_used)
        block_ids = array("i", [NULL_BLOCK]) * num_null + array("i", group_used)
        block_ids += pool.allocate(num_fresh)
        chain_uid = uids[-1] if g == anchor and uids else group_root(root, g)
        groups.append(GroupBlocks(block_ids, num_hits, chain_uid, num_null))
    return groups


def append_costs(
    seq: SeqState, windows: Sequence[int | None], num_new: int, block_size: int, pool: BlockPool
) -> list[int]:
    """Per group, the free blocks `num_new` more tokens take, less the blocks sliding out of
    its window that no other sequence holds."""
    num_cur = seq.num_tokens
    costs = [group.append_cost(num_cur, num_new, block_size, pool)[0] for group in seq.groups]
    if not num_new:
        return costs
    return [
        cost - num
        for cost, num in zip(costs, num_released(seq, windows, block_size, pool), strict=True)
    ]


def num_released(
    seq: SeqState, windows: Sequence[int | None], block_size: int, pool: BlockPool
) -> list[int]:
    """Per group, the blocks the next token's window no longer reaches that no other
    sequence holds (they return to the free pool on the next append)."""
    num_cur = seq.num_tokens
    return [
        0
        if window is None
        else group.num_released(first_needed_block(window, num_cur, block_size), pool)
        for group, window in zip(seq.groups, windows, strict=True)
    ]


def grow(
    seq: SeqState, windows: Sequence[int | None], num_new: int, block_size: int, pool: BlockPool
) -> list[tuple[int, int]] | None:
    """Give each group of `seq` the blocks `num_new` more tokens need, after returning the
    blocks that slid out of its window: None, with nothing changed, if they are not free;
    else the copies ``(src, dst)`` to queue, one per fresh block that replaced a shared,
    partially filled last block. Sets `seq.in_place_end` for the blocks after."""
    num_cur, groups = seq.num_tokens, seq.groups
    costs = [group.append_cost(num_cur, num_new, block_size, pool) for group in groups]
    need = sum([num for num, _ in costs])
    if need > pool.num_free_blocks:  # the blocks sliding out may make up the difference
        need -= sum(num_released(seq, windows, block_size, pool))
        if need > pool.num_free_blocks:
            return None
    # Every group returns its slid-out blocks before any takes one: they may be needed.
    for group, window in zip(groups, windows, strict=True):
        if window is not None:
            group.drop(first_needed_block(window, num_cur, block_size), pool)
    copies = []
    num = num_cur + num_new
    end = num + block_size  # above any group's
    for group, window, (num_blocks, is_cow) in zip(groups, windows, costs, strict=True):
        if num_blocks:
            copy = group.take(num_blocks, is_cow, pool)
            if copy:
                copies.append(copy)
        end = min(end, group.in_place_end(num, window, block_size, pool))
    seq.in_place_end, seq.table = end, None
    return copies


def move_to_host(seq: SeqState, pool: BlockPool, host: BlockPool) -> list[tuple[int, int]]:
    """`KVCacheManager.swap_out` of `seq`: its held blocks, every group's in table order,
    to fresh host blocks (raises OutOfBlocks, nothing changed, if too few are free)."""
    held = [group.held for group in seq.groups]
    host_block_ids = host.allocate(sum(map(len, held)))
    pairs = list(zip((b for blocks in held for b in blocks), host_block_ids, strict=True))
    start = 0
    for group, blocks in zip(seq.groups, held, strict=True):
        pool.free(blocks)
        group.host_block_ids = host_block_ids[start : start + len(blocks)]
        group.block_ids = array("i")
        start += len(blocks)
    seq.is_swapped, seq.table, seq.in_place_end = True, None, 0
    return pairs


def move_to_device(seq: SeqState, pool: BlockPool, host: BlockPool) -> list[tuple[int, int]]:
    """`KVCacheManager.swap_in` of `seq` without re-keying: its host blocks to fresh device
    blocks, the slid-out ones NULL_BLOCK again (raises OutOfBlocks, nothing changed)."""
    hosts = [group.host_block_ids or array("i") for group in seq.groups]
    block_ids = pool.allocate(sum(map(len, hosts)))
    pairs: list[tuple[int, int]] = []
    start = 0
    for group, host_ids in zip(seq.groups, hosts, strict=True):
        device = block_ids[start : start + len(host_ids)]
        pairs += zip(host_ids, device, strict=True)
        host.free(host_ids)
        group.block_ids = array("i", [NULL_BLOCK]) * group.num_dropped + device
        group.host_block_ids = None
        start += len(host_ids)
    seq.is_swapped, seq.table, seq.in_place_end = False, None, 0
    return pairs
