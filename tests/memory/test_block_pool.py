"""BlockPool: exact block ids, free-stack and LRU order, eviction, counts."""

from __future__ import annotations

import random
from array import array

import pytest

from pagedkv.memory import BlockPool, OutOfBlocks, PrefixIndex


def _pool(num_blocks: int, cached: bool = True) -> BlockPool:
    return BlockPool(num_blocks, PrefixIndex(num_blocks) if cached else None)


def _alloc(pool: BlockPool, num: int) -> list[int]:
    block_ids = pool.allocate(num)
    assert isinstance(block_ids, array) and block_ids.typecode == "i"
    return block_ids.tolist()


def _holders(pool: BlockPool, *tables: list[int]) -> list[int]:
    counts = [0] * pool.num_blocks
    for table in tables:
        for b in table:
            counts[b] += 1
    return counts


def test_allocate_takes_lowest_ids_first_and_free_restores_order() -> None:
    pool = _pool(8, cached=False)
    a = _alloc(pool, 3)
    b = _alloc(pool, 2)
    assert (a, b) == ([0, 1, 2], [3, 4])
    assert pool.free_block_ids() == [5, 6, 7]
    pool.check(_holders(pool, a, b))
    pool.free(a)
    # Freed blocks are handed out again first, in their original order.
    assert pool.free_block_ids() == [0, 1, 2, 5, 6, 7]
    assert _alloc(pool, 4) == [0, 1, 2, 5]
    assert pool.num_free_blocks == 2


def test_allocate_all_or_nothing() -> None:
    pool = _pool(4, cached=False)
    held = _alloc(pool, 3)
    with pytest.raises(OutOfBlocks, match="need 2 blocks, 1 free"):
        _alloc(pool, 2)
    assert pool.free_block_ids() == [3]
    pool.check(_holders(pool, held))
    assert _alloc(pool, 0) == []


def test_share_and_free_count_references() -> None:
    pool = _pool(4, cached=False)
    a = _alloc(pool, 2)
    pool.touch(a)
    assert pool.is_shared(0) and pool.ref_counts() == [2, 2, 0, 0]
    pool.free(a)
    assert not pool.is_shared(0) and pool.ref_counts() == [1, 1, 0, 0]
    assert pool.num_free_blocks == 2
    pool.check(_holders(pool, a))
    pool.free(a)
    assert pool.ref_counts() == [0, 0, 0, 0] and pool.num_free_blocks == 4
    pool.check(_holders(pool))


def test_cached_blocks_wait_in_lru_and_are_evicted_last_block_first() -> None:
    pool = _pool(6)
    index = pool.index
    assert index is not None
    a = _alloc(pool, 3)  # [0, 1, 2]
    uid = 0
    for i, b in enumerate(a):
        uid = index.insert(uid, (i,), b)
    pool.free(a)
    # Indexed blocks are cached, not free-stacked; the last block is the first to go.
    assert pool.cached_block_ids() == [2, 1, 0]
    assert pool.free_block_ids() == [3, 4, 5]
    assert pool.num_free_blocks == 6 and pool.num_cached_blocks == 3
    pool.check(_holders(pool))
    # The free stack is used up before anything cached is evicted.
    b = _alloc(pool, 4)
    assert b == [3, 4, 5, 2]
    assert pool.num_evictions == 1 and index.block_entries[2] is None
    assert pool.cached_block_ids() == [1, 0]
    pool.check(_holders(pool, b))


def test_touch_takes_cached_blocks_off_the_lru() -> None:
    pool = _pool(4)
    index = pool.index
    assert index is not None
    a = _alloc(pool, 2)
    index.insert(0, (7,), a[0])
    pool.free(a)
    assert pool.cached_block_ids() == [0] and pool.free_block_ids() == [1, 2, 3]
    assert pool.num_evictable([0, 1]) == 1
    pool.touch([0])
    assert pool.cached_block_ids() == [] and pool.ref_counts()[0] == 1
    pool.touch([0])  # a second hit on a held block adds a reference
    assert pool.ref_counts()[0] == 2
    pool.check(_holders(pool, [0], [0]))


def test_a_hit_block_freed_again_is_the_most_recently_used() -> None:
    pool = _pool(2)
    index = pool.index
    assert index is not None
    assert _alloc(pool, 2) == [0, 1]
    index.insert(0, (0,), 0)
    index.insert(0, (1,), 1)
    pool.free([0])
    pool.free([1])
    assert pool.cached_block_ids() == [0, 1]
    pool.touch([0])  # block 0's queue entry goes stale
    pool.free([0])
    assert pool.cached_block_ids() == [1, 0]
    assert _alloc(pool, 1) == [1]  # the stale entry of block 0 is skipped
    assert pool.cached_block_ids() == [0] and index.block_entries[1] is None
    pool.check(_holders(pool, [1]))


def test_reset_cache_returns_cached_blocks_to_the_stack() -> None:
    pool = _pool(3)
    index = pool.index
    assert index is not None
    a = _alloc(pool, 2)
    index.insert(0, (1,), a[0])
    index.insert(1, (2,), a[1])
    pool.free(a)
    pool.reset_cache()
    assert pool.cached_block_ids() == [] and len(index) == 0
    assert sorted(pool.free_block_ids()) == [0, 1, 2]
    pool.check(_holders(pool))


def test_pool_rejects_negative_size() -> None:
    with pytest.raises(ValueError, match="expected >= 0, got -1"):
        BlockPool(-1)
    assert BlockPool(0).num_free_blocks == 0


def test_bookkeeping_stays_within_20_bytes_per_block_under_churn() -> None:
    # Stale queue entries (hits on cached blocks) must be compacted away, not accumulate.
    n = 3000
    pool = _pool(n)
    index = pool.index
    assert index is not None and pool.nbytes() == 12 * n  # extra (list) + stamp; no stack yet
    rng = random.Random(0)
    held: list[list[int]] = []
    for step in range(3000):
        if held and (rng.random() < 0.5 or pool.num_free_blocks < 64):
            pool.free(held.pop(rng.randrange(len(held))))
        elif rng.random() < 0.5 and pool.num_cached_blocks:
            hit = pool.cached_block_ids()[-rng.randint(1, pool.num_cached_blocks) :]
            pool.touch(hit)
            held.append(hit)
        else:
            blocks = _alloc(pool, rng.randint(1, 64))
            for b in blocks:
                index.insert(0, (step, b), b)
            held.append(blocks)
        assert pool.nbytes() <= 20 * n + 4 * 2048, f"step {step}: {pool.nbytes()} bytes"
    pool.check(_holders(pool, *held))


def test_allocate_one_takes_the_block_allocate_would() -> None:
    """From the free stack, then never-used blocks, then the cached ones (evicted)."""
    rng = random.Random(3)
    pools = [_pool(12), _pool(12)]
    held: list[list[int]] = [[], []]
    for step in range(400):
        if held[0] and (rng.random() < 0.4 or not pools[0].num_free_blocks):
            i, cache = rng.randrange(len(held[0])), rng.random() < 0.5
            for pool, blocks in zip(pools, held, strict=True):
                b = blocks.pop(i)
                if cache:  # indexed, so freed as cached (evicted when nothing else is free)
                    assert pool.index is not None
                    pool.index.insert(0, (step,), b)
                pool.free([b])
            continue
        one = pools[0].allocate_one()
        assert [one] == _alloc(pools[1], 1)
        held[0].append(one)
        held[1].append(one)
    assert pools[0].num_evictions == pools[1].num_evictions > 0
    for pool, blocks in zip(pools, held, strict=True):
        pool.check(_holders(pool, blocks))
    with pytest.raises(OutOfBlocks):
        full = _pool(1)
        full.allocate_one()
        full.allocate_one()
