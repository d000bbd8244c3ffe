"""KV cache groups in the manager: sliding groups return the blocks that left their window,
prefix hits, fork, swap and the audit work per group."""

from __future__ import annotations

import struct

import pytest
from memory_testing import tokens

from pagedkv.memory import ROOT_UID, KVCacheManager
from pagedkv.memory.content_hash import chain_hashes
from pagedkv.memory.groups import NULL_BLOCK, first_needed_block, group_layers


def test_group_layers_splits_kinds_into_equal_groups() -> None:
    windows = [4, 4, 4, 4, 4, None] * 2 + [4, 4]  # Gemma-3-like: 12 sliding, 2 full
    groups = group_layers(windows, 14)
    assert groups.layers_per_group == 2
    assert groups.windows == (4,) * 6 + (None,)
    assert groups.layers[0] == (0, 1) and groups.layers[6] == (5, 11)
    assert groups.slot_of(11) == (6, 1)
    one = group_layers([8] * 3, 3)
    assert one.windows == (8,) and one.layers == ((0, 1, 2),) and one.layers_per_group == 3
    assert group_layers((), 2).windows == (None,)
    with pytest.raises(ValueError, match="sliding_windows: expected 3 entries, got 2"):
        group_layers([None, 4], 3)


def test_rejects_bad_windows() -> None:
    with pytest.raises(ValueError, match="windows: expected an int >= 1, got 0"):
        KVCacheManager(8, 4, windows=(None, 0))
    with pytest.raises(ValueError, match="windows: expected one entry per KV cache group"):
        KVCacheManager(8, 4, windows=())


def test_sliding_group_returns_blocks_that_left_the_window() -> None:
    m = KVCacheManager(64, 4, windows=(None, 8))
    m.allocate("a", tokens(0, 2))
    most = 0
    for token in range(200):
        table = m.append("a", [token])
        m.check()
        stats = m.stats()
        assert stats["group_1_max_seq_blocks"] <= 8 // 4 + 1
        most = max(most, stats["group_1_max_seq_blocks"])
        # The full group keeps every block; the sliding one only those the next token reads.
        assert NULL_BLOCK not in table[0::2]
    assert most == 3 and m.stats()["group_0_num_held_blocks"] == -(-202 // 4)
    first = (202 - 8 + 1) // 4
    assert table[1::2][:first] == [NULL_BLOCK] * first and NULL_BLOCK not in table[1::2][first:]
    # Slots of the window are there; a slot before it would be a NULL_BLOCK's.
    assert min(m.slot_mapping("a", 202 - 8, 202, 1)) >= 0
    assert m.num_free_blocks == 64 - (-(-202 // 4)) - (len(table) // 2 - first)
    m.free("a")
    assert m.num_free_blocks == 64
    m.check()


def test_append_counts_blocks_sliding_out() -> None:
    m = KVCacheManager(9, 2, windows=(None, 1), enable_prefix_caching=False)
    m.allocate("a", tokens(0, 8))  # 4 + 4 blocks
    assert m.num_free_blocks == 1
    # One new block per group, four released by the sliding group: a net three come back.
    assert m.num_blocks_to_append("a", 1) == -2
    m.append("a", [7])
    assert m.num_free_blocks == 3
    m.check()


def test_prefix_hit_holds_only_the_window_blocks() -> None:
    m = KVCacheManager(64, 4, windows=(None, 4))
    prompt = tokens(0, 40)
    m.allocate("a", prompt)
    m.append("a", [1])  # the sliding group drops blocks 0..8; they stay cached
    m.check()
    assert m.num_cached_tokens(prompt + [5]) == 40
    need = m.num_blocks_to_allocate(prompt + [5])
    free = m.num_free_blocks
    assert m.allocate("b", prompt + [5]) == 40
    assert m.num_free_blocks == free - need
    table = m.block_table("b")
    assert table[0::2][:10] == m.block_table("a")[0::2][:10]  # the full group shares all
    sliding = table[1::2]
    # The next token (position 40) reads 37..40: block 9 (a hit) and block 10 (fresh).
    assert sliding[:9] == [NULL_BLOCK] * 9 and NULL_BLOCK not in sliding[9:]
    m.check()


def test_sliding_group_hit_needs_only_its_window_blocks() -> None:
    m = KVCacheManager(24, 4, windows=(None, 4))
    prompt = tokens(0, 40)
    m.allocate("a", prompt)  # 10 blocks per group
    m.append("a", [1])  # the sliding group leaves blocks 0..8 cached, holds 9 and 10
    assert m.stats()["num_cached_blocks"] == 9
    # 2 free blocks and 4 evicted: the sliding group's blocks 8, 7, 6, 5 (last ones first).
    m.allocate("c", tokens(100, 12))
    assert m.stats()["num_evictions"] == 4
    m.check()
    # Position 40 reads 37..40: sliding block 9, still held by "a", so all 10 blocks hit.
    assert m.num_cached_tokens(prompt + [1]) == 40
    # After 7 blocks the window needs block 6, after 6 block 5 (both evicted); after 5,
    # block 4 (cached): the hit stops there, whatever the full group still holds.
    assert m.num_cached_tokens(prompt[:28] + [7]) == 20
    shared = m.block_table("a")[0::2]
    m.free("c")
    assert m.allocate("d", prompt[:28] + [7]) == 20
    assert m.block_table("d")[1::2][:4] == [NULL_BLOCK] * 4
    assert m.block_table("d")[0::2][:5] == shared[:5]
    m.check()
    m.free("d")
    assert m.allocate("b", prompt + [1]) == 40
    table = m.block_table("b")
    assert table[0::2][:10] == shared[:10]
    assert table[1::2][:9] == [NULL_BLOCK] * 9 and table[1::2][9] == m.block_table("a")[19]
    m.check()


def test_remembered_window_hits_follow_new_and_evicted_blocks() -> None:
    m = KVCacheManager(24, 4, windows=(None, 4))
    prompt = tokens(0, 40)
    m.allocate("a", prompt)
    m.append("a", [1])
    m.allocate("c", tokens(100, 10))  # evicts the sliding group's blocks 8, 7, 6, 5
    m.free("c")
    m.free("a")
    m.allocate("e", prompt[:23])
    query = prompt[:28] + [7]  # the same list asked again, as a waiting prompt is
    assert m.num_cached_tokens(query) == 20
    evictions = m.stats()["num_evictions"]
    # "e" fills its block 5, keyed in the sliding group too: after 6 blocks the window
    # needs only block 5, so 24 tokens hit now, with no eviction in between.
    m.append("e", prompt[23:24])
    assert m.stats()["num_evictions"] == evictions
    assert m.num_cached_tokens(query) == 24 == m.num_cached_tokens(list(query))
    m.free("e")
    m.allocate("f", tokens(200, 48))  # takes all 24 blocks: every cached one evicted
    assert m.num_cached_tokens(query) == 0
    m.check()


def test_all_sliding_groups_key_the_widest_window_by_content() -> None:
    # No full-attention group: the widest window's group (1) names prefixes by content hash.
    m = KVCacheManager(32, 4, windows=(4, 8))
    prompt = tokens(0, 24)
    m.allocate("a", prompt)
    m.append("a", [1])
    m.check()
    assert m.num_cached_tokens(prompt + [2]) == 24
    index = m._index
    assert index is not None
    entry = index.block_entries[m.block_table("a")[2 * 5 + 1]]
    names = m._seqs["a"].prefix_uids
    assert names == chain_hashes(struct.pack("=24i", *prompt), 4, ROOT_UID, 6)
    assert entry is not None and entry[2][0] == names[4]  # block 5 under blocks 0..4's hash
    m.free("a")
    assert m.allocate("b", prompt + [2]) == 24
    m.check()


def test_all_sliding_hit_needs_only_the_window_blocks() -> None:
    # Mistral's shape: one group, every layer sliding (window 8, blocks of 4).
    m = KVCacheManager(16, 4, windows=(8,))
    prompt = tokens(0, 40)  # 10 blocks
    m.allocate("a", prompt)
    m.append("a", [1])  # the window at 40 reads 33..40: blocks 0..7 slid out, cached
    m.free("a")
    # 6 free blocks, then 4 cached ones evicted: the slid-out 7, 6, 5, 4 (last freed first).
    m.allocate("filler", tokens(500, 10 * 4))
    assert m.stats()["num_evictions"] == 4
    m.check()
    # Blocks 8 and 9, the window at 40, are still cached: a hit with no block before them.
    assert m.num_cached_tokens(prompt + [1]) == 40
    assert m.num_blocks_to_allocate(prompt + [1]) == 1 + 2  # token 40's, the 2 cached hits
    assert m.allocate("b", prompt + [1]) == 40
    table = m.block_table("b")
    assert table[:8] == [NULL_BLOCK] * 8 and NULL_BLOCK not in table[8:]
    m.check()
    # "b"'s fresh block evicted block 3 too. After 5 blocks the window needs blocks 3 and
    # 4, after 4 blocks 2 and 3 (both cut by an evicted block); after 3, blocks 1 and 2.
    assert m.num_cached_tokens(prompt[:20] + [3]) == 12
    m.free("filler")
    assert m.allocate("c", prompt[:20] + [3]) == 12
    assert m.block_table("c")[:1] == [NULL_BLOCK] and NULL_BLOCK not in m.block_table("c")[1:]
    m.check()
    m.free("c")
    m.free("b")
    m.allocate("all", tokens(900, 64))  # every cached block evicted
    assert m.num_cached_tokens(prompt + [1]) == 0
    m.free("all")
    m.check()


def test_all_sliding_hits_keep_salts_apart_and_survive_swap() -> None:
    m = KVCacheManager(32, 4, num_host_blocks=32, windows=(8,))
    prompt = tokens(0, 30)
    m.allocate("a", prompt, salt="s")
    m.append("a", [1, 2])
    assert m.num_cached_tokens(prompt + [1, 2, 3]) == 0  # another salt's chain
    assert m.num_cached_tokens(prompt + [1, 2, 3], salt="s") == 32
    m.swap_out("a")
    m.check()
    m.swap_in("a")  # re-keyed from the salted chain's start
    m.check()
    m.allocate("b", prompt + [1, 2, 3], salt="s")
    m.fork("b", "c")
    m.append("c", [4])
    m.check()


def test_fork_swap_and_free_cover_every_group() -> None:
    m = KVCacheManager(64, 4, num_host_blocks=64, windows=(None, 8, 4))
    m.allocate("a", tokens(0, 30))
    m.append("a", [1, 2, 3])
    m.fork("a", "b")
    m.append("b", [9])  # copy-on-write in every group whose partial last block is shared
    copies = m.pop_copies()
    assert len(copies) == 3
    m.check()
    assert m.stats()["group_2_max_seq_blocks"] == 3  # "a": 30..33 (+1 past 32); "b": 31..34
    held = sum(b != NULL_BLOCK for b in m.block_table("b"))
    pairs = m.swap_out("b")
    assert len(pairs) == held and m.is_swapped("b")
    m.check()
    assert m.num_blocks_to_swap_in("b") == len(pairs)
    back = m.swap_in("b")
    assert [h for h, _ in back] == [h for _, h in pairs]
    table = m.block_table("b")
    assert sum(b != NULL_BLOCK for b in table) == len(back)
    m.check()
    m.free("a")
    m.free("b")
    m.check()
    assert m.num_free_blocks == 64 and m.num_free_host_blocks == 64


def test_audit_catches_a_block_leaked_by_a_sliding_group() -> None:
    m = KVCacheManager(32, 4, windows=(None, 4))
    m.allocate("a", tokens(0, 20))
    m.append("a", [1])
    group = m._seqs["a"].groups[1]
    group.block_ids[group.num_dropped - 1] = 0  # claims a block it gave back
    with pytest.raises(AssertionError):
        m.check()


@pytest.mark.parametrize("windows", [(None,), (None, 8), (6, None, 3)])
def test_a_decode_token_that_changes_no_block_skips_grow(windows: tuple[int | None, ...]) -> None:
    # A sequence's in-place end is exact for one token: past it exactly when the next token
    # takes a block or moves a window past a block, so every other decode step is in place.
    m = KVCacheManager(64, 4, windows=windows)
    m.allocate("a", tokens(0, 3))
    for token in range(60):
        seq = m._seqs["a"]
        num = seq.num_tokens
        changes = num % 4 == 0 or any(
            first_needed_block(w, num, 4) > g.num_dropped
            for w, g in zip(windows, seq.groups, strict=True)
        )
        assert (seq.in_place_end <= num) == changes, f"at {num} tokens"
        table = m.block_table("a")
        assert (m.append("a", [token]) is table) == (not changes)  # in place: the same table
        m.check()
    m.fork("a", "b")  # the shared partial last block must be copied on the next append
    assert m._seqs["a"].in_place_end <= m.num_tokens("a")
    m.append("a", [0])
    assert len(m.pop_copies()) == len(windows)
