"""Content hashes of cached blocks, the queue of evicted blocks, and blocks loaded from
elsewhere joining the prefix index (the memory side of the disk tier)."""

from __future__ import annotations

import struct
import subprocess
import sys

from memory_testing import tokens

from pagedkv.memory import ROOT_UID, KVCacheManager, PrefixIndex
from pagedkv.memory.content_hash import ContentHashes, chain_hashes, group_hash, root_hash

B = 4


def packed(token_ids: list[int]) -> bytes:
    return struct.pack(f"={len(token_ids)}i", *token_ids)


def test_chain_hash_depends_on_every_earlier_block_and_the_salt() -> None:
    a = tokens(0, 4 * B)
    b = [99] + a[1:]  # first block differs
    ha, hb = chain_hashes(packed(a), B, ROOT_UID, 4), chain_hashes(packed(b), B, ROOT_UID, 4)
    assert len(ha) == 4 and all(len(h) == 32 for h in ha)
    assert all(x != y for x, y in zip(ha, hb, strict=True))  # equal later blocks, other hashes
    salted = chain_hashes(packed(a), B, "tenant", 4)
    assert all(x != y for x, y in zip(ha, salted, strict=True))
    assert chain_hashes(packed(a), B, "tenant", 4) == salted  # deterministic
    assert root_hash("tenant") != root_hash(ROOT_UID)
    assert chain_hashes(packed(a[: 2 * B + 1]), B, ROOT_UID, 4) == ha[:2]  # full blocks only


def test_evicted_blocks_are_queued_with_the_hash_of_their_prompt() -> None:
    kv = KVCacheManager(6, B, hash_contents=True)
    prompt = tokens(10, 3 * B + 1)
    kv.allocate("a", prompt, salt="s")
    table = kv.block_table("a")
    kv.free("a")
    assert kv.content_hashes.pop_evicted() == []
    kv.allocate("b", tokens(500, 6 * B))  # needs every block: evicts a's three
    evicted = kv.content_hashes.pop_evicted()
    expected = chain_hashes(packed(prompt), B, "s", 3)
    by_block = {e.block_id: e for e in evicted}
    assert sorted(by_block) == sorted(table[:3])
    for i, block_id in enumerate(table[:3]):
        block = by_block[block_id]
        assert block.content_hash == expected[i]
        assert block.parent_hash == (expected[i - 1] if i else root_hash("s"))
        assert block.tokens == packed(prompt[i * B : (i + 1) * B])
    assert kv.content_hashes.pop_evicted() == []
    kv.check()


def test_hashed_blocks_lists_held_and_cached_blocks() -> None:
    kv = KVCacheManager(16, B, hash_contents=True)
    kv.allocate("a", tokens(0, 2 * B + 1))
    kv.allocate("b", tokens(100, 2 * B))
    kv.free("b")
    hashes = {e.content_hash for e in kv.content_hashes.indexed()}
    expected = chain_hashes(packed(tokens(0, 2 * B)), B, ROOT_UID, 2)
    expected += chain_hashes(packed(tokens(100, 2 * B)), B, ROOT_UID, 2)
    assert hashes == set(expected)
    assert KVCacheManager(16, B).content_hashes is None  # off by default


def test_a_chain_from_an_unhashed_parent_is_not_hashed() -> None:
    content = ContentHashes()
    content.add(7, (3, packed(tokens(0, B))))  # uid 3 was never hashed
    assert len(content) == 0
    content.add(8, (ROOT_UID, (1.5, 2, 3, 4)))  # tokens that do not pack: no hash
    assert len(content) == 0


def anchor_blocks(first: int, num: int) -> list[tuple[int, int]]:
    return [(0, i) for i in range(first, first + num)]


def test_cache_blocks_indexes_loaded_blocks_that_later_prompts_hit() -> None:
    kv = KVCacheManager(32, B, hash_contents=True)
    prompt = tokens(0, 5 * B + 2)
    block_ids = kv.cache_blocks(prompt, salt=None, blocks=anchor_blocks(0, 3))
    assert None not in block_ids and len(block_ids) == 3
    assert kv.num_cached_tokens(prompt) == 3 * B
    assert kv.stats()["num_cached_blocks"] == 3  # free, evictable
    kv.check()
    # The next two blocks chain onto the three: an overlap is skipped.
    more = kv.cache_blocks(prompt, salt=None, blocks=anchor_blocks(2, 3))
    assert more[0] is None and None not in more[1:]
    assert kv.allocate("a", prompt) == 5 * B
    assert kv.block_table("a")[:5] == block_ids + more[1:]
    kv.check()


def test_cache_blocks_takes_nothing_when_the_chain_before_is_not_cached() -> None:
    kv = KVCacheManager(32, B, hash_contents=True)
    prompt = tokens(0, 5 * B)
    assert kv.cache_blocks(prompt, salt=None, blocks=anchor_blocks(2, 2)) == [None, None]
    assert None not in kv.cache_blocks(prompt, salt="x", blocks=anchor_blocks(0, 2))
    assert kv.num_cached_tokens(prompt) == 0  # another salt's chain
    assert kv.num_cached_tokens(prompt, salt="x") == 2 * B
    full = KVCacheManager(2, B, hash_contents=True)
    full.allocate("held", tokens(100, 2 * B))
    assert full.cache_blocks(prompt, salt=None, blocks=anchor_blocks(0, 2)) == [None, None]
    full.check()


def test_grouped_blocks_are_hashed_per_group_and_loaded_back() -> None:
    # A sliding group (window 4) beside the full anchor (group 1).
    kv = KVCacheManager(64, B, hash_contents=True, windows=(4, None))
    prompt = tokens(0, 6 * B)
    kv.allocate("a", prompt)
    kv.append("a", [1])  # the sliding group's blocks 0 .. 4 slide out, still indexed
    hashes = chain_hashes(packed(prompt), B, ROOT_UID, 6)
    saved = {(e.content_hash, e.parent_hash, e.tokens) for e in kv.content_hashes.indexed()}
    for i, h in enumerate(hashes):
        tokens_i = packed(prompt[i * B : (i + 1) * B])
        assert (h, hashes[i - 1] if i else root_hash(ROOT_UID), tokens_i) in saved
        assert (group_hash(0, h), h, tokens_i) in saved
    assert len(saved) == 12
    # A fresh manager loads the anchor's blocks and the window's: the prompt hits them all.
    fresh = KVCacheManager(64, B, hash_contents=True, windows=(4, None))
    query = prompt + [1]
    loaded = [(1, i) for i in range(6)] + [(0, 5)]
    block_ids = fresh.cache_blocks(query, salt=None, blocks=loaded)
    assert None not in block_ids
    assert fresh.num_cached_tokens(query) == 6 * B
    assert fresh.cache_blocks(query, salt=None, blocks=loaded) == [None] * 7  # cached now
    fresh.check()
    # Without the sliding group's block the window needs, the hit stops before it.
    other = KVCacheManager(64, B, hash_contents=True, windows=(4, None))
    other.cache_blocks(query, salt=None, blocks=[(1, i) for i in range(6)] + [(0, 3)])
    assert other.num_cached_tokens(query) == 4 * B
    other.check()


def test_all_sliding_blocks_load_with_no_block_before_the_window() -> None:
    kv = KVCacheManager(32, B, hash_contents=True, windows=(2 * B,))
    prompt = tokens(0, 8 * B + 1)
    block_ids = kv.cache_blocks(prompt, salt=None, blocks=anchor_blocks(5, 3))
    assert None not in block_ids
    # The window at 8 blocks reads blocks 6 and 7; at 7 blocks, 5 and 6.
    assert kv.num_cached_tokens(prompt) == 8 * B
    assert kv.num_cached_tokens(prompt[: 7 * B + 1]) == 7 * B
    assert kv.num_cached_tokens(prompt[: 6 * B + 1]) == 0
    evicted = {e.content_hash for e in kv.content_hashes.indexed()}
    assert evicted == set(chain_hashes(packed(prompt), B, ROOT_UID, 8)[5:])
    kv.check()


def test_content_hash_imports_no_torch() -> None:
    code = "import sys; sys.modules['torch'] = None; import pagedkv.memory.content_hash"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_index_forgets_hashes_on_clear() -> None:
    index = PrefixIndex(8)
    index.content = ContentHashes()
    index.insert(ROOT_UID, tokens(0, B), 0)
    assert len(index.content) == 1
    index.clear()
    assert len(index.content) == 0
