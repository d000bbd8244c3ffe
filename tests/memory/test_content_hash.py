"""Content hashes of cached blocks, the queue of evicted blocks, and blocks loaded from
elsewhere joining the prefix index (the memory side of the disk tier)."""

from __future__ import annotations

import struct
import subprocess
import sys

from memory_testing import tokens

from pagedkv.memory import ROOT_UID, KVCacheManager, PrefixIndex
from pagedkv.memory.content_hash import ContentHashes, chain_hashes, root_hash

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
    assert content.hash_of(7) is None and len(content) == 0
    content.add(8, (ROOT_UID, (1.5, 2, 3, 4)))  # tokens that do not pack: no hash
    assert len(content) == 0


def test_cache_blocks_indexes_loaded_blocks_that_later_prompts_hit() -> None:
    kv = KVCacheManager(32, B, hash_contents=True)
    prompt = tokens(0, 5 * B + 2)
    skipped, block_ids = kv.cache_blocks(prompt, salt=None, first_block=0, num_blocks=3)
    assert skipped == 0 and len(block_ids) == 3
    assert kv.num_cached_tokens(prompt) == 3 * B
    assert kv.stats()["num_cached_blocks"] == 3  # free, evictable
    kv.check()
    # The next two blocks chain onto the three: an overlap is skipped.
    skipped, more = kv.cache_blocks(prompt, salt=None, first_block=2, num_blocks=3)
    assert skipped == 1 and len(more) == 2
    assert kv.allocate("a", prompt) == 5 * B
    assert kv.block_table("a")[:5] == block_ids + more
    kv.check()


def test_cache_blocks_takes_nothing_when_the_chain_before_is_not_cached() -> None:
    kv = KVCacheManager(32, B, hash_contents=True)
    prompt = tokens(0, 5 * B)
    assert kv.cache_blocks(prompt, salt=None, first_block=2, num_blocks=2) == (0, [])
    assert kv.cache_blocks(prompt, salt="x", first_block=0, num_blocks=2)[1]
    assert kv.num_cached_tokens(prompt) == 0  # another salt's chain
    assert kv.num_cached_tokens(prompt, salt="x") == 2 * B
    full = KVCacheManager(2, B, hash_contents=True)
    full.allocate("held", tokens(100, 2 * B))
    assert full.cache_blocks(prompt, salt=None, first_block=0, num_blocks=2) == (0, [])
    full.check()


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
