"""Salted prefix keys: a salt roots its own chain, so salts never share a cached block."""

from __future__ import annotations

import random

import pytest
from memory_testing import tokens

from pagedkv.memory import ROOT_UID, KVCacheManager, PrefixIndex
from pagedkv.memory.prefix import chain_root


def _chain_keys(index: PrefixIndex, block_ids: list[int]) -> list[tuple[object, object]]:
    keys = []
    for block_id in block_ids:
        entry = index.block_entries[block_id]
        assert entry is not None, f"block {block_id} is not indexed"
        keys.append(entry[2])
    return keys


def test_chain_root_is_root_uid_without_a_salt() -> None:
    assert chain_root(None) == ROOT_UID
    assert chain_root("tenant-a") == "tenant-a" != ROOT_UID


@pytest.mark.parametrize("span_blocks", [2, 16])
def test_salted_first_key_differs_and_every_chained_key_differs(span_blocks: int) -> None:
    index = PrefixIndex(64, span_blocks=span_blocks)
    prompt = tokens(100, 4 * 6)
    plain = index.block_tokens
    keys = [plain(prompt[i : i + 4]) for i in range(0, len(prompt), 4)]
    index.insert_keys(ROOT_UID, keys, range(0, 6))
    index.insert_keys(chain_root("a"), keys, range(10, 16))
    index.insert_keys(chain_root("b"), keys, range(20, 26))
    chains = {name: _chain_keys(index, list(range(s, s + 6))) for name, s in
              (("none", 0), ("a", 10), ("b", 20))}  # fmt: skip
    assert chains["none"][0][0] == ROOT_UID and chains["a"][0][0] == "a"
    for i in range(6):
        parents = {name: chain[i][0] for name, chain in chains.items()}
        assert len(set(parents.values())) == 3, f"block {i} chains alike: {parents}"
        assert len({chain[i][1] for chain in chains.values()}) == 1  # same tokens
    for root, first in ((ROOT_UID, 0), ("a", 10), ("b", 20)):
        for _ in range(2):  # the second lookup goes through the spans
            assert index.match(prompt, 4, 6, root=root)[0] == list(range(first, first + 6))
    assert index.match(prompt, 4, 6, root="c") == ([], "c")
    index.check()


def test_manager_shares_blocks_only_within_a_salt() -> None:
    manager = KVCacheManager(num_blocks=32, block_size=4)
    prompt = tokens(0, 17)  # four full blocks and one token
    assert manager.allocate("a1", prompt, salt="a") == 0
    assert manager.num_cached_tokens(prompt) == 0
    assert manager.num_cached_tokens(prompt, salt="b") == 0
    assert manager.num_cached_tokens(prompt, salt="a") == 16
    assert manager.num_blocks_to_allocate(prompt, salt="b") == 5
    assert manager.num_blocks_to_allocate(prompt, salt="a") == 1
    assert manager.allocate("b1", prompt, salt="b") == 0
    assert manager.allocate("none", prompt) == 0
    assert manager.allocate("a2", prompt, salt="a") == 16
    table_a1, table_b1 = manager.block_table("a1"), manager.block_table("b1")
    assert manager.block_table("a2")[:4] == table_a1[:4]
    assert not set(table_a1) & set(table_b1)
    assert not set(manager.block_table("none")) & (set(table_a1) | set(table_b1))
    manager.check()
    stats = manager.stats()
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (4 * 17, 16)


def test_salt_survives_fork_append_swap_and_reset() -> None:
    manager = KVCacheManager(num_blocks=32, block_size=4, num_host_blocks=16)
    manager.allocate("p", tokens(0, 6), salt="s")
    manager.fork("p", "c")
    manager.append("c", tokens(6, 6))  # blocks 1 and 2 become full under the salt's chain
    manager.check()
    manager.swap_out("c")
    manager.swap_in("c")  # re-keyed from the salt's root
    manager.check()
    assert manager.num_cached_tokens(tokens(0, 13), salt="s") == 12
    assert manager.num_cached_tokens(tokens(0, 13)) == 0
    for seq_id in ("p", "c"):
        manager.free(seq_id)
    assert manager.reset_prefix_cache()
    assert manager.num_cached_tokens(tokens(0, 13), salt="s") == 0
    manager.check()


def test_check_catches_a_block_keyed_under_another_salt() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=2)
    manager.allocate("x", tokens(0, 5), salt="a")
    manager._seqs["x"].chain_root = "b"  # the state now claims another salt's chain
    with pytest.raises(AssertionError, match="chains from"):
        manager.check()


@pytest.mark.parametrize("first, second", [("a", "b"), ("b", "a"), (None, "a"), ("a", None)])
def test_a_remembered_query_is_never_another_salts_answer(
    first: str | None, second: str | None
) -> None:
    """The same prompt list asked under two salts in turn: each gets its own salt's hits,
    never the answer remembered for the other."""
    manager = KVCacheManager(num_blocks=32, block_size=4)
    manager.allocate("a1", tokens(0, 17), salt="a")  # holds four full blocks under "a"
    asked = tokens(0, 17)  # one list, so the manager may remember its answer
    # (cached tokens, blocks to allocate): four held hits under "a", none under another salt.
    expected = {"a": (16, 1), "b": (0, 5), None: (0, 5)}
    for salt in (first, second, first, second):
        got = (
            manager.num_cached_tokens(asked, salt=salt),
            manager.num_blocks_to_allocate(asked, salt=salt),
        )
        assert got == expected[salt], f"salt {salt!r}, asked after {first!r}: {got}"
    manager.check()


def test_remembered_salted_queries_match_fresh_lookups() -> None:
    """Prompts allocated and asked about under random salts: every query of the same list
    gets what a fresh walk from its salt's root gets, across frees, evictions and a reset."""
    rng = random.Random(5)
    m = KVCacheManager(24, 2)
    assert m._index is not None
    salts = [None, "a", "b"]
    prompts = [[rng.randrange(3) for _ in range(rng.randint(1, 12))] for _ in range(6)]
    live: list[int] = []
    for step in range(800):
        prompt, salt = rng.choice(prompts), rng.choice(salts)
        if live and (rng.random() < 0.4 or m.num_free_blocks < 8):
            m.free(live.pop(rng.randrange(len(live))))
        elif m.num_blocks_to_allocate(prompt, salt=salt) <= m.num_free_blocks:
            m.allocate(step, prompt, salt=salt)
            live.append(step)
        if step % 97 == 96 and not live:
            assert m.reset_prefix_cache()
        asked, asked_salt = prompts[0], rng.choice(salts)
        max_blocks = (len(asked) - 1) // 2
        hits = m._index.match(asked, 2, max_blocks, root=chain_root(asked_salt))[0]
        assert m.num_cached_tokens(asked, salt=asked_salt) == 2 * len(hits)
        expected = -(-len(asked) // 2) - len(hits) + m._pool.num_evictable(hits)
        assert m.num_blocks_to_allocate(asked, salt=asked_salt) == expected
    m.check()
