"""KVCacheManager: exact block ids, prefix hits, copy-on-write, bad input, all-or-nothing."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
from memory_testing import snapshot, tokens

from pagedkv.memory import KVCacheManager, OutOfBlocks

STATS_KEYS = {
    "num_blocks", "num_free_blocks", "num_used_blocks", "num_cached_blocks", "num_host_blocks",
    "num_free_host_blocks", "prefix_cache_queries", "prefix_cache_hits", "num_cow_copies",
    "num_evictions", "num_swapped_out_blocks", "num_swapped_in_blocks",
}  # fmt: skip


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_blocks": 0, "block_size": 4},
        {"num_blocks": -3, "block_size": 4},
        {"num_blocks": 4, "block_size": 0},
        {"num_blocks": True, "block_size": 4},
        {"num_blocks": 4, "block_size": 2.0},
        {"num_blocks": 4, "block_size": 4, "num_host_blocks": -1},
    ],
)
def test_rejects_bad_sizes(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="expected an int"):
        KVCacheManager(**kwargs)


def test_allocate_exact_blocks_and_prefix_hits() -> None:
    m = KVCacheManager(10, 4)
    assert m.allocate("a", tokens(0, 10)) == 0
    assert m.block_table("a") == [0, 1, 2] and m.num_tokens("a") == 10
    m.check()
    # Same first two blocks, different tail: both full blocks are hits.
    assert m.allocate("b", tokens(0, 8) + [99, 98]) == 8
    assert m.block_table("b") == [0, 1, 3]
    # A prompt of exactly two blocks: the last token is computed, so only one block hits.
    assert m.allocate("c", tokens(0, 8)) == 4
    assert m.block_table("c") == [0, 4]
    # A mismatch in block 0 means no hit in block 1 either (chained keys).
    assert m.allocate("d", [7] + tokens(1, 9)) == 0
    assert m.block_table("d") == [5, 6, 7]
    m.check()
    assert m._pool.ref_counts()[:8] == [3, 2, 1, 1, 1, 1, 1, 1]
    stats = m.stats()
    assert stats["prefix_cache_queries"] == 38 and stats["prefix_cache_hits"] == 12
    assert stats["num_used_blocks"] == 8 and stats["num_free_blocks"] == 2


def test_freed_blocks_stay_cached_and_lru_evicts_tails_first() -> None:
    m = KVCacheManager(4, 2)
    m.allocate("a", tokens(0, 7))  # blocks 0,1,2 full, 3 partial
    m.free("a")
    pool = m._pool
    # Full blocks are cached, last block first in eviction order; the partial one is free.
    assert pool.cached_block_ids() == [2, 1, 0] and pool.free_block_ids() == [3]
    assert m.num_free_blocks == 4 and m.stats()["num_cached_blocks"] == 3
    m.check()
    # A hit on cached-but-free blocks takes them off the queue (they count as used).
    assert m.num_blocks_to_allocate(tokens(0, 5)) == 3
    assert m.allocate("b", tokens(0, 5)) == 4
    assert m.block_table("b") == [0, 1, 3]
    assert pool.cached_block_ids() == [2] and m.num_free_blocks == 1
    # Needing more than the free stack holds evicts the least recently used cached block.
    m.append("b", [50, 51, 52])
    assert m.block_table("b") == [0, 1, 3, 2]
    assert m.stats()["num_evictions"] == 1 and m.num_cached_tokens(tokens(0, 7)) == 4
    m.check()


def test_append_allocates_on_demand_and_keys_full_blocks() -> None:
    m = KVCacheManager(8, 4)
    m.allocate("a", tokens(0, 3))
    assert m.num_blocks_to_append("a", 1) == 0
    m.append("a", [3])
    assert m.block_table("a") == [0]
    assert m.num_blocks_to_append("a", 9) == 3
    m.append("a", tokens(4, 9))
    assert m.block_table("a") == [0, 1, 2, 3] and m.num_tokens("a") == 13
    m.append("a", [])
    assert m.num_tokens("a") == 13
    m.check()
    # Chunked prefill: blocks completed by append are hits for the next identical prompt.
    assert m.num_cached_tokens(tokens(0, 13)) == 12
    assert m.allocate("b", tokens(0, 13)) == 12
    assert m.block_table("b") == [0, 1, 2, 4]
    m.check()


def test_fork_shares_blocks_and_copy_on_write_queues_in_order() -> None:
    m = KVCacheManager(8, 4)
    m.allocate("p", tokens(0, 6))  # [0, 1]: block 1 half full
    m.fork("p", "c1")
    m.fork("p", "c2")
    assert m.block_table("c1") == [0, 1] and m._pool.ref_counts()[:2] == [3, 3]
    assert m.stats()["num_forked_blocks"] == 4  # two forks of two blocks, none copied
    m.check()
    assert m.num_blocks_to_append("c1", 1) == 1  # the copy of block 1
    m.append("c1", [100])
    m.append("p", [200, 201, 202])  # copy of block 1, then a new block
    assert m.block_table("c1") == [0, 2] and m.block_table("p") == [0, 3, 4]
    # c2 is the last holder of block 1 now: it writes in place.
    assert m.num_blocks_to_append("c2", 2) == 0
    m.append("c2", [300, 301])
    assert m.block_table("c2") == [0, 1]
    assert m.pop_copies() == [(1, 2), (1, 3)] and m.pop_copies() == []
    assert m.stats()["num_cow_copies"] == 2
    m.check()
    # A full shared last block is never copied: the write goes to a new block.
    m.allocate("q", tokens(50, 4))
    m.fork("q", "q2")
    m.append("q2", [9])
    assert m.pop_copies() == [] and m.block_table("q2") == [m.block_table("q")[0], 6]
    m.check()


def test_append_hands_out_the_block_table_until_it_changes() -> None:
    m = KVCacheManager(6, 4)
    m.allocate("p", tokens(0, 6))  # [0, 1]: block 1 half full
    m.fork("p", "c")
    first = m.append("c", [100])  # copy-on-write of the shared block 1
    assert first == m.block_table("c") == [0, 2] and m.pop_copies() == [(1, 2)]
    assert m.append("c", [101]) is first  # fills block 2 (keyed): the same list
    assert m.block_table("c") is first
    assert m.append("c", [102]) == [0, 2, 3] and first == [0, 2]  # a new list
    assert m.num_cached_tokens(tokens(0, 6) + [100, 101, 7]) == 8
    m.check()
    m.allocate("q", tokens(50, 8))  # [4, 5]: the pool is full
    before = snapshot(m)
    with pytest.raises(OutOfBlocks):
        m.append("q", [9])
    assert snapshot(m) == before
    m.free("p")
    with pytest.raises(KeyError):
        m.append("p", [1])


@pytest.mark.parametrize("caching", [True, False])
def test_out_of_blocks_changes_nothing(caching: bool) -> None:
    m = KVCacheManager(5, 2, enable_prefix_caching=caching, num_host_blocks=2)
    m.allocate("a", tokens(0, 5))  # 3 blocks
    m.fork("a", "b")
    m.allocate("c", tokens(0, 3))
    before = snapshot(m)
    expected_free = m.num_free_blocks
    with pytest.raises(OutOfBlocks):
        m.allocate("d", tokens(20, 2 * expected_free + 1))
    with pytest.raises(OutOfBlocks):
        m.append("a", tokens(40, 2 * expected_free + 1))  # CoW block plus new ones
    with pytest.raises(OutOfBlocks):
        m.swap_out("a")  # 3 blocks, 2 host blocks
    assert snapshot(m) == before and "d" not in m
    m.check()
    m.swap_out("c")
    m.allocate("e", tokens(60, 2 * m.num_free_blocks))
    before = snapshot(m)
    with pytest.raises(OutOfBlocks):
        m.swap_in("c")
    assert snapshot(m) == before
    m.check()


def test_swap_round_trip_and_swapped_sequence_rejects_other_calls() -> None:
    m = KVCacheManager(6, 2, num_host_blocks=4)
    m.allocate("a", tokens(0, 5))
    assert m.swap_out("a") == [(0, 0), (1, 1), (2, 2)]
    assert m.is_swapped("a") and m.num_free_host_blocks == 1 and m.num_free_blocks == 6
    m.check()
    for call in (lambda: m.append("a", [1]), lambda: m.fork("a", "x"),
                 lambda: m.block_table("a"), lambda: m.num_tokens("a"),
                 lambda: m.slot_mapping("a", 0, 1), lambda: m.swap_out("a"),
                 lambda: m.num_blocks_to_append("a", 1)):  # fmt: skip
        with pytest.raises(ValueError, match="swapped out"):
            call()
    # a's partial block 2 went back on the free stack (top), its full blocks 1, 0 to the LRU.
    m.allocate("b", [9, 9, 9])
    assert m.block_table("b") == [2, 3]
    assert m.num_blocks_to_swap_in("a") == 3
    # Free stack first (4, 5), then the least recently used cached block (1) is evicted.
    assert m.swap_in("a") == [(0, 4), (1, 5), (2, 1)]
    assert not m.is_swapped("a") and m.block_table("a") == [4, 5, 1]
    assert m.num_tokens("a") == 5 and m.num_free_host_blocks == 4
    with pytest.raises(ValueError, match="resident"):
        m.swap_in("a")
    stats = m.stats()
    assert stats["num_swapped_out_blocks"] == 3 and stats["num_swapped_in_blocks"] == 3
    m.check()
    m.swap_out("b")
    m.free("b")  # releases its host blocks
    assert m.num_free_host_blocks == 4 and "b" not in m
    m.check()


def test_slot_mapping() -> None:
    m = KVCacheManager(8, 4)
    m.allocate("x", tokens(0, 3))
    m.allocate("a", tokens(10, 10))  # blocks [1, 2, 3]
    assert m.slot_mapping("a", 0, 10) == [4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    assert m.slot_mapping("a", 3, 9) == [7, 8, 9, 10, 11, 12]
    assert m.slot_mapping("a", 9, 10) == [13] and m.slot_mapping("a", 4, 4) == []
    for start, end in ((-1, 2), (3, 2), (0, 11), (0.0, 2)):
        with pytest.raises(ValueError, match="expected 0 <= start <= end <= 10"):
            m.slot_mapping("a", start, end)


def test_bad_input_and_unknown_ids() -> None:
    m = KVCacheManager(8, 4)
    m.allocate(("req", 0), tokens(0, 5))
    with pytest.raises(ValueError, match="already in use"):
        m.allocate(("req", 0), [1])
    with pytest.raises(ValueError, match="empty prompt"):
        m.allocate("e", [])
    with pytest.raises(ValueError, match="expected a sequence of token ids"):
        m.allocate("s", "hello")
    with pytest.raises(ValueError, match="expected a sequence of token ids"):
        m.append(("req", 0), 5)
    with pytest.raises(ValueError, match="already in use"):
        m.fork(("req", 0), ("req", 0))
    with pytest.raises(ValueError, match="num_tokens: expected an int >= 0"):
        m.num_blocks_to_append(("req", 0), -1)
    for call in (lambda: m.append("z", [1]), lambda: m.fork("z", "y"), lambda: m.free("z"),
                 lambda: m.block_table("z"), lambda: m.num_tokens("z"),
                 lambda: m.slot_mapping("z", 0, 0), lambda: m.swap_out("z"),
                 lambda: m.swap_in("z"), lambda: m.is_swapped("z"),
                 lambda: m.num_blocks_to_append("z", 1)):  # fmt: skip
        with pytest.raises(KeyError, match="unknown sequence 'z'"):
            call()
    assert m.seq_ids() == [("req", 0)] and ("req", 0) in m and len(m) == 1
    m.check()


def test_reset_prefix_cache_only_when_idle() -> None:
    m = KVCacheManager(4, 2, num_host_blocks=4)
    m.allocate("a", tokens(0, 5))
    assert m.reset_prefix_cache() is False and m.num_cached_tokens(tokens(0, 5)) == 4
    m.swap_out("a")
    assert m.reset_prefix_cache() is True
    assert m.num_cached_tokens(tokens(0, 5)) == 0 and m.stats()["num_cached_blocks"] == 0
    m.check()
    m.swap_in("a")  # its full blocks are keyed again
    assert m.num_cached_tokens(tokens(0, 5)) == 4
    m.check()


def test_prefix_caching_off_never_hits() -> None:
    m = KVCacheManager(6, 2, enable_prefix_caching=False)
    m.allocate("a", tokens(0, 5))
    assert m.allocate("b", tokens(0, 5)) == 0 and m.num_cached_tokens(tokens(0, 5)) == 0
    m.free("a")
    assert m._pool.free_block_ids() == [0, 1, 2]
    stats = m.stats()
    assert STATS_KEYS <= set(stats) and stats["num_cached_blocks"] == 0
    assert stats["prefix_cache_queries"] == 0 and not m.enable_prefix_caching
    assert (m.num_blocks, m.block_size, m.num_host_blocks) == (6, 2, 0)
    m.check()


def test_allocate_without_the_prefix_cache_takes_no_hit_but_keys_its_blocks() -> None:
    m = KVCacheManager(8, 2)
    m.allocate("a", tokens(0, 5))
    m.free("a")  # blocks 0 and 1 stay cached
    assert m.num_blocks_to_allocate(tokens(0, 5), use_prefix_cache=False) == 3
    assert m.allocate("b", tokens(0, 5), use_prefix_cache=False) == 0
    assert m.block_table("b") == [2, 3, 4] and m.stats()["prefix_cache_queries"] == 5
    assert m.allocate("c", tokens(10, 5), use_prefix_cache=False) == 0
    assert m.num_cached_tokens(tokens(10, 5)) == 4  # c's full blocks are findable
    m.check()


def test_lookups_have_no_side_effects() -> None:
    m = KVCacheManager(6, 2)
    m.allocate("a", tokens(0, 5))
    m.free("a")
    before = snapshot(m)
    assert m.num_cached_tokens(tokens(0, 5)) == 4
    assert m.num_blocks_to_allocate(tokens(0, 6)) == 3  # 2 hits on free cached + 1 fresh
    assert snapshot(m) == before


def test_memory_layer_imports_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from pagedkv.memory import KVCacheManager, OutOfBlocks\n"
        "from pagedkv import KVCacheManager as K2\n"
        "assert K2 is KVCacheManager and 'numpy' not in sys.modules\n"
        "m = KVCacheManager(4, 2); m.allocate('a', [1, 2, 3]); m.check()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_remembered_prefix_queries_match_fresh_lookups() -> None:
    """A prompt asked about again (the same list) gets what a fresh lookup of a copy gets,
    across insertions, evictions, frees and a reset."""
    rng = random.Random(11)
    m = KVCacheManager(24, 2)
    prompts = [[rng.randrange(3) for _ in range(rng.randint(1, 12))] for _ in range(6)]
    live: list[int] = []
    for step in range(800):
        prompt = rng.choice(prompts)
        if live and (rng.random() < 0.4 or m.num_free_blocks < 8):
            m.free(live.pop(rng.randrange(len(live))))
        elif m.num_blocks_to_allocate(prompt) <= m.num_free_blocks:
            m.allocate(step, prompt)
            live.append(step)
        if step % 97 == 96 and not live:
            assert m.reset_prefix_cache()
        # Only `asked` goes through the manager's queries (so its answer is remembered);
        # the expected values walk the index directly.
        asked = prompts[0]
        hits = m._index.match(asked, 2, (len(asked) - 1) // 2)[0]
        assert m.num_cached_tokens(asked) == 2 * len(hits)
        end = rng.randint(1, len(asked))
        hits = hits[: (end - 1) // 2]
        expected = -(-end // 2) - len(hits) + m._pool.num_evictable(hits)
        assert m.num_blocks_to_allocate(asked, num_tokens=end) == expected
    m.check()
