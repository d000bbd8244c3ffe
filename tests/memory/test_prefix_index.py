"""Prefix index: chained keys, verification on hit, hash collisions, check() catching bugs."""

from __future__ import annotations

import pytest
from memory_testing import tokens

from pagedkv.memory import ROOT_UID, KVCacheManager, PrefixIndex
from pagedkv.memory.block_tokens import iter_full_blocks


class CollidingToken:
    """A token whose hash is the same for every value: every key lands in one dict bucket."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __hash__(self) -> int:
        return 0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CollidingToken) and other.value == self.value


def test_iter_full_blocks_skips_the_partial_block() -> None:
    assert list(iter_full_blocks(tokens(0, 7), 3)) == [(0, 1, 2), (3, 4, 5)]
    assert list(iter_full_blocks(tokens(0, 7), 3, 1)) == [(3, 4, 5)]
    assert list(iter_full_blocks(tokens(0, 7), 3, 0, 1)) == [(0, 1, 2)]
    assert list(iter_full_blocks(tokens(0, 2), 3)) == []


def test_match_follows_the_chain_and_stops_at_the_first_miss() -> None:
    index = PrefixIndex(8)
    u1 = index.insert(ROOT_UID, (1, 2), 5)
    u2 = index.insert(u1, (3, 4), 6)
    assert index.match([1, 2, 3, 4, 9], 2, 2) == ([5, 6], u2)
    assert index.match([1, 2, 3, 4], 2, 1) == ([5], u1)
    assert index.match([9, 9, 3, 4], 2, 2) == ([], ROOT_UID)  # block 1 alone never matches
    # The same tokens after another parent are another key.
    assert index.insert(u2, (1, 2), 7) not in (u1, u2)
    # A duplicate prefix returns the existing uid and is not indexed.
    assert index.insert(ROOT_UID, (1, 2), 3) == u1 and index.block_entries[3] is None
    index.check()


def test_evicted_parent_makes_its_children_unreachable() -> None:
    index = PrefixIndex(4)
    u1 = index.insert(ROOT_UID, (1,), 0)
    index.insert(u1, (2,), 1)
    index.remove(0)
    # The same first block cached again gets a new uid: the old child must not be served.
    u2 = index.insert(ROOT_UID, (1,), 2)
    assert u2 != u1
    assert index.match([1, 2, 3], 1, 2) == ([2], u2)
    index.check()


def test_real_hash_collision_is_rejected() -> None:
    # Python hashes 2**61 - 1 to 0, like 0: the two prompts' block keys hash alike.
    collider = 2**61 - 1
    assert hash((ROOT_UID, (0,) * 4)) == hash((ROOT_UID, (collider,) * 4))
    m = KVCacheManager(8, 4)
    m.allocate("a", [0] * 4 + [1])
    assert m.num_cached_tokens([collider] * 4 + [1]) == 0
    assert m.allocate("b", [collider] * 4 + [1]) == 0
    assert set(m.block_table("a")).isdisjoint(m.block_table("b"))
    m.check()


def test_every_key_colliding_still_serves_only_equal_prompts() -> None:
    # Every token hashes to 0, as if the hash were patched to a constant.
    m = KVCacheManager(16, 2)
    prompt_a = [CollidingToken(v) for v in (1, 2, 3, 4, 5)]
    prompt_b = [CollidingToken(v) for v in (1, 2, 7, 8, 5)]
    m.allocate("a", prompt_a)
    assert m.allocate("b", prompt_b) == 2  # block 0 equal, block 1 differs
    assert m.block_table("b")[0] == m.block_table("a")[0]
    assert m.block_table("b")[1] != m.block_table("a")[1]
    assert m.allocate("c", [CollidingToken(v) for v in (1, 2, 3, 4, 6)]) == 4
    m.check()


def test_check_catches_a_forgotten_decrement() -> None:
    m = KVCacheManager(8, 2)
    m.allocate("a", tokens(0, 5))
    m.fork("a", "b")
    m.check()
    # Dropping b's table without releasing its references: a forgotten decrement.
    del m._seqs["b"]
    with pytest.raises(AssertionError, match="ref_count 2 != 1 holders"):
        m.check()


def test_check_catches_a_leaked_block() -> None:
    m = KVCacheManager(8, 2)
    m.allocate("a", tokens(0, 5))
    m._seqs["a"].groups[0].block_ids.pop()  # block 2 forgotten by its only holder
    m._seqs["a"].token_ids = m._seqs["a"].token_ids[:4]
    m._seqs["a"].num_tokens = m._seqs["a"].in_place_end = 4
    with pytest.raises(AssertionError, match="block 2 is neither free nor held"):
        m.check()


def test_check_catches_a_block_both_free_and_held() -> None:
    m = KVCacheManager(8, 2, enable_prefix_caching=False)
    m.allocate("a", tokens(0, 5))
    m._pool._stack.append(1)
    with pytest.raises(AssertionError, match="block 1 is free but held by 1"):
        m.check()


def test_check_catches_a_wrong_cached_key() -> None:
    m = KVCacheManager(8, 2)
    m.allocate("a", tokens(0, 5))
    other = list(m._seqs["a"].token_ids)
    other[2] = 99  # the block holds other tokens than its key says
    m._seqs["a"].token_ids = other
    with pytest.raises(AssertionError, match="indexed under other tokens"):
        m.check()


def test_keys_are_per_block_so_int32_blocks_hit_beside_other_tokens() -> None:
    m = KVCacheManager(16, 2)
    m.allocate("a", [1, 2, 3, 4, 5])
    # A token past int32 in block 2 sends this prompt down the block-by-block path; its
    # int32 blocks still get the same keys, so blocks 0 and 1 hit.
    assert m.allocate("b", [1, 2, 3, 4, 2**40, 6, 7]) == 4
    assert m.block_table("b")[:2] == m.block_table("a")[:2]
    assert m.num_cached_tokens([1, 2, 3, 4, 2**40, 6, 8]) == 6
    assert m.num_cached_tokens([1, 2, 3, 4, 2**40 + 1, 6, 8]) == 4
    m.check()


def _span_manager() -> tuple[KVCacheManager, list[int]]:
    """Blocks 0-3 hold a cached 4-block prompt, and a hit made them one span of 4."""
    m = KVCacheManager(6, 2)
    m._index.span_blocks = 4
    prompt = tokens(0, 9)
    m.allocate("a", prompt)
    m.free("a")
    assert m.allocate("b", prompt) == 8 and len(m._index._spans) == 1  # walked: span made
    m.free("b")
    return m, prompt


def test_a_span_serves_the_same_chain_as_a_walk() -> None:
    m, prompt = _span_manager()
    assert m._index.match(prompt, 2, 4) == m._index.match_keys(m._index.keys_of(prompt, 2), 4)
    assert m.allocate("c", prompt) == 8 and m.block_table("c")[:4] == [0, 1, 2, 3]
    assert m.num_cached_tokens(tokens(0, 7) + [99, 98]) == 6  # block 3 differs: no span
    m.check()


def test_a_span_with_an_evicted_block_is_not_served() -> None:
    m, prompt = _span_manager()
    # 3 blocks with 1 never used and 1 free: evicts the least recently used cached block,
    # block 3 (a prompt's last blocks go first), which x takes for its partial last block.
    m.allocate("x", tokens(50, 5))
    assert m.block_table("x")[2] == 3
    m.free("x")
    assert m.allocate("c", prompt) == 6  # blocks 0-2 by walking; block 3 is not a hit
    assert m.block_table("c")[:3] == [0, 1, 2]
    m.check()


def test_check_catches_a_span_with_other_tokens() -> None:
    m, _ = _span_manager()
    ((key, span),) = m._index._spans.items()
    m._index._spans[key] = (span[0], b"x" * len(span[1]), *span[2:])
    with pytest.raises(AssertionError, match="holds other tokens than its entries"):
        m.check()
