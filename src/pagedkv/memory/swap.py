"""Moving a sequence's blocks, every KV cache group's, between the device pool and the host
pool (standard library only): `KVCacheManager.swap_out` and `swap_in`."""

from __future__ import annotations

from array import array

from pagedkv.memory.block_pool import BlockPool
from pagedkv.memory.groups import NULL_BLOCK
from pagedkv.memory.sequence import SeqState


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
