"""The prefix cache's disk tier on a tiny random Gemma 3 (two sliding layers of window 8 around
a full one: three KV cache groups): every group's block is saved under its own hash, and a
restart serves the same tokens as a cold cache, with the window's blocks or not at all.

PAGEDKV_DEBUG=1 (tests/conftest.py) runs `KVCacheManager.check()` after every step.
"""

from __future__ import annotations

import os
import struct

import pytest
from helpers import make_hf_model
from test_prefix_tier import (
    BLOCK_SIZE,
    SAMPLINGS,
    assert_same_tokens_close_logprobs,
    block_files,
    cold_run,
    make_llm,
    make_prompts,
    one_by_one,
)

from pagedkv.memory import ROOT_UID
from pagedkv.memory.content_hash import chain_hashes, group_hash

PARAMS = SAMPLINGS["greedy"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("tier-groups"), "gemma3", seed=23)


def hit_blocks(prompts: list[list[int]]) -> int:
    return sum((len(p) - 1) // BLOCK_SIZE for p in prompts)


def test_a_restart_serves_every_group_from_disk_as_a_cold_cache_would(model_dir, tmp_path):
    prompts = make_prompts(1, 4, low=24, high=40)
    cold = cold_run(model_dir, prompts, PARAMS)
    with make_llm(model_dir, prefix_cache_dir=str(tmp_path)) as first:
        groups = first.engine.runner.kv_cache.groups
        assert groups.windows == (8, 8, None) and first.engine.prefix_tier is not None
        first_run = one_by_one(first, prompts, PARAMS)
    # The full group's block of every full block, and the sliding groups' too (those that
    # slid out were still cached when the engine closed).
    assert len(block_files(tmp_path)) >= 3 * hit_blocks(prompts)
    with make_llm(model_dir, prefix_cache_dir=str(tmp_path)) as restarted:
        served = one_by_one(restarted, prompts, PARAMS)
        stats = restarted.stats()
    # The full group's blocks, and each sliding group's inside the window at the hit: at n
    # blocks the next token reads positions 4n - 7 .. 4n, so blocks n - 2 and n - 1.
    reads = [n + 2 * min(n, 2) for n in ((len(p) - 1) // BLOCK_SIZE for p in prompts)]
    assert stats["prefix_cache_disk_hits"] == sum(reads)
    assert stats["prefix_cache_hits"] == hit_blocks(prompts) * BLOCK_SIZE
    assert_same_tokens_close_logprobs(cold, served)
    assert_same_tokens_close_logprobs(cold, first_run)


def test_a_missing_window_block_shortens_the_hit(model_dir, tmp_path) -> None:
    prompt = make_prompts(2, 1, low=37, high=37)[0]  # 9 full blocks before the last token
    cold = cold_run(model_dir, [prompt], PARAMS)
    with make_llm(model_dir, prefix_cache_dir=str(tmp_path)) as llm:
        one_by_one(llm, [prompt], PARAMS)
    # Remove sliding group 0's file of block 8, which the window at a hit of 9 blocks reads.
    hashes = chain_hashes(struct.pack(f"={len(prompt)}i", *prompt), BLOCK_SIZE, ROOT_UID, 9)
    name = group_hash(0, hashes[8]).hex() + ".kvb"
    (path,) = [f for f in block_files(tmp_path) if os.path.basename(f) == name]
    os.unlink(path)
    with make_llm(model_dir, prefix_cache_dir=str(tmp_path)) as llm:
        served = one_by_one(llm, [prompt], PARAMS)
        stats = llm.stats()
    # At 8 blocks the next token reads positions 25 .. 32, blocks 6 and 7: all on disk.
    assert stats["prefix_cache_hits"] == 8 * BLOCK_SIZE
    assert_same_tokens_close_logprobs(cold, served)


def test_blocks_evicted_while_serving_come_back_from_disk(model_dir, tmp_path) -> None:
    prompts = make_prompts(3, 6, low=24, high=40)
    cold = cold_run(model_dir, prompts, PARAMS)
    with make_llm(model_dir, num_blocks=48, prefix_cache_dir=str(tmp_path)) as llm:
        first = one_by_one(llm, prompts, PARAMS)
        llm.engine.prefix_tier.flush()
        assert llm.stats()["prefix_cache_disk_bytes_written"] > 0  # evictions were saved
        again = one_by_one(llm, prompts, PARAMS)
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_blocks"]
    assert stats["prefix_cache_disk_hits"] > 0
    assert_same_tokens_close_logprobs(cold, first)
    assert_same_tokens_close_logprobs(cold, again)


def test_grouped_and_single_group_layouts_keep_apart(model_dir, tmp_path) -> None:
    prompts = make_prompts(4, 1)
    with make_llm(model_dir, prefix_cache_dir=str(tmp_path)) as llm:
        one_by_one(llm, prompts, PARAMS)
    with make_llm(model_dir, prefix_cache_dir=str(tmp_path), kv_cache_groups=False) as llm:
        one_by_one(llm, prompts, PARAMS)
        assert llm.stats()["prefix_cache_disk_hits"] == 0  # a block of one group's layers
    assert len([d for d in os.listdir(tmp_path) if os.path.isdir(tmp_path / d)]) == 2


def test_an_all_sliding_model_restarts_from_its_window_blocks(tmp_path) -> None:
    model = make_hf_model(tmp_path / "model", "mistral", seed=24)  # every layer: window 8
    prompts = make_prompts(5, 3, low=24, high=40)
    cold = cold_run(model, prompts, PARAMS)
    directory = tmp_path / "tier"
    with make_llm(model, prefix_cache_dir=str(directory)) as llm:
        one_by_one(llm, prompts, PARAMS)
    with make_llm(model, prefix_cache_dir=str(directory)) as llm:
        served = one_by_one(llm, prompts, PARAMS)
        stats = llm.stats()
    # Only the two blocks the window reads at each prompt's hit come back from disk.
    assert stats["prefix_cache_disk_hits"] == 2 * len(prompts)
    assert stats["prefix_cache_hits"] == hit_blocks(prompts) * BLOCK_SIZE
    assert_same_tokens_close_logprobs(cold, served)
