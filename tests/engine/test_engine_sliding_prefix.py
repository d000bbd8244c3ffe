"""Prefix hits on a Mistral-shaped model: every layer slides (window 8, blocks of 4), so the
one KV cache group names prefixes by content and a hit needs only its window's blocks.

PAGEDKV_DEBUG=1 (tests/conftest.py) runs `KVCacheManager.check()` after every step.
"""

from __future__ import annotations

import random
import struct

import pytest
from helpers import make_hf_model
from test_prefix_tier import assert_same_tokens_close_logprobs

from pagedkv import LLM, SamplingParams
from pagedkv.memory import ROOT_UID
from pagedkv.memory.content_hash import chain_hashes, root_hash

WINDOW, BLOCK_SIZE = 8, 4
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("sliding"), "mistral", seed=31)


def make_llm(model_dir, **kwargs) -> LLM:
    return LLM(model_dir, device="cpu", dtype="float32", block_size=BLOCK_SIZE,
               max_num_batched_tokens=512, **kwargs)  # fmt: skip


def serve(llm: LLM, prompt: list[int]) -> object:
    return llm.generate(prompt, PARAMS, use_tqdm=False)[0]


def cached_blocks(llm: LLM, prompt: list[int]) -> list[int | None]:
    """Per full block of `prompt`, the pool block caching it (None: not cached)."""
    index = llm.engine.kv_manager._index
    packed = struct.pack(f"={len(prompt)}i", *prompt)
    names = [root_hash(ROOT_UID), *chain_hashes(packed, BLOCK_SIZE, ROOT_UID, len(prompt))]
    width = 4 * BLOCK_SIZE
    return [
        index.block_of(names[i], packed[i * width : (i + 1) * width])
        for i in range(len(prompt) // BLOCK_SIZE)
    ]


def evict(llm: LLM, num: int, seed: int) -> None:
    """Serve a prompt that takes every free block and evicts the `num` least recent cached."""
    kv = llm.engine.kv_manager
    free = kv.num_free_blocks - kv.stats()["num_cached_blocks"]
    evictions = kv.stats()["num_evictions"]
    rng = random.Random(seed)
    filler = [rng.randrange(3, 512) for _ in range((free + num) * BLOCK_SIZE - 1)]
    llm.generate(filler, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert kv.stats()["num_evictions"] - evictions == num


def test_a_hit_needs_only_the_window_blocks_and_matches_a_cold_run(model_dir) -> None:
    rng = random.Random(1)
    prompt = [rng.randrange(3, 512) for _ in range(60)]  # 15 blocks, far past the window
    second = prompt + [rng.randrange(3, 512) for _ in range(7)]
    third = prompt + [rng.randrange(3, 512) for _ in range(5)]
    with make_llm(model_dir, num_blocks=64, enable_prefix_caching=False) as llm:
        cold = [serve(llm, p) for p in (prompt, second, third)]
    with make_llm(model_dir, num_blocks=64) as llm:
        kv = llm.engine.kv_manager
        assert kv.windows == (WINDOW,)
        warm = [serve(llm, prompt)]
        blocks = cached_blocks(llm, prompt)
        assert None not in blocks  # slid out and freed, still cached
        # Evict every block that slid out before the last window's (blocks 0 .. 12 are
        # older in the cached queue than 13 and 14, which the window at token 60 reads).
        order = kv._pool.cached_block_ids()
        evict(llm, min(order.index(blocks[13]), order.index(blocks[14])), seed=2)
        blocks = cached_blocks(llm, prompt)
        assert blocks[0] is None and blocks[13] is not None and blocks[14] is not None
        assert kv.num_cached_tokens(prompt[: BLOCK_SIZE + 1]) == 0  # no chain from the root
        hits = llm.stats()["prefix_cache_hits"]
        warm.append(serve(llm, second))
        assert llm.stats()["prefix_cache_hits"] - hits == len(prompt)
        # Evicting the window's blocks too: the same prefix is a miss, computed afresh.
        evict(llm, kv.stats()["num_cached_blocks"], seed=3)
        hits = llm.stats()["prefix_cache_hits"]
        warm.append(serve(llm, third))
        assert llm.stats()["prefix_cache_hits"] == hits
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_blocks"]  # nothing leaked
    assert_same_tokens_close_logprobs(cold, warm)
