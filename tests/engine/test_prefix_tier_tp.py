"""The prefix cache's disk tier under tensor parallelism (2 CPU processes, gloo): each rank
saves and loads its own KV heads' blocks in its own namespace; a restart with 2 ranks hits
and gives the tokens of a cold cache; 1 and 2 ranks never share files; a block is placed
only if every rank read it whole."""

from __future__ import annotations

import glob
import json
import os

import pytest
from helpers import make_hf_model
from test_prefix_tier import (
    BLOCK_SIZE,
    SAMPLINGS,
    assert_same_tokens_close_logprobs,
    make_llm,
    make_prompts,
    one_by_one,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("tier-tp"), "llama", seed=21)


def namespaces(directory) -> dict[tuple[int, int], str]:
    """(tp_rank, tp_size) -> namespace directory."""
    out = {}
    for path in glob.glob(os.path.join(str(directory), "*", "namespace.json")):
        with open(path) as file:
            description = json.load(file)
        out[description["tp_rank"], description["tp_size"]] = os.path.dirname(path)
    return out


def files_of(namespace: str) -> list[str]:
    return sorted(glob.glob(os.path.join(namespace, "*", "*.kvb")))


def cold_then_saved(model_dir, directory, prompts: list[list[int]], params) -> list:
    """The prompts' outputs with 2 ranks and no prefix cache; then served by 2 ranks with
    the disk tier in `directory`, which holds their blocks once that engine closed."""
    with make_llm(model_dir, tensor_parallel_size=2, enable_prefix_caching=False) as llm:
        cold = one_by_one(llm, prompts, params)
    with make_llm(model_dir, tensor_parallel_size=2, prefix_cache_dir=str(directory)) as llm:
        one_by_one(llm, prompts, params)
    return cold


def test_each_rank_saves_and_loads_its_own_blocks(model_dir, tmp_path) -> None:
    params, prompts = SAMPLINGS["greedy"], make_prompts(31, 3)
    tp2 = {"tensor_parallel_size": 2, "prefix_cache_dir": str(tmp_path)}
    cold = cold_then_saved(model_dir, tmp_path, prompts, params)
    found = namespaces(tmp_path)
    assert set(found) == {(0, 2), (1, 2)}
    names = [[os.path.basename(f) for f in files_of(found[rank, 2])] for rank in (0, 1)]
    assert names[0] == names[1] and names[0]  # the same blocks, each rank its share
    num_blocks = sum((len(p) - 1) // BLOCK_SIZE for p in prompts)
    with make_llm(model_dir, **tp2) as restarted:
        served = one_by_one(restarted, prompts, params)
        stats = restarted.stats()
    assert stats["prefix_cache_disk_hits"] == num_blocks
    assert stats["prefix_cache_hits"] == num_blocks * BLOCK_SIZE
    assert_same_tokens_close_logprobs(cold, served)
    with make_llm(model_dir, prefix_cache_dir=str(tmp_path)) as one_rank:  # another namespace
        one_by_one(one_rank, prompts, params)
        assert one_rank.stats()["prefix_cache_disk_hits"] == 0
    assert set(namespaces(tmp_path)) == {(0, 2), (1, 2), (0, 1)}


def test_a_block_one_rank_lacks_is_a_miss_on_every_rank(model_dir, tmp_path) -> None:
    params, prompts = SAMPLINGS["greedy"], make_prompts(32, 2)
    tp2 = {"tensor_parallel_size": 2, "prefix_cache_dir": str(tmp_path)}
    cold = cold_then_saved(model_dir, tmp_path, prompts, params)
    for path in files_of(namespaces(tmp_path)[1, 2]):  # rank 1's share of every block gone
        os.unlink(path)
    with make_llm(model_dir, **tp2) as restarted:
        served = one_by_one(restarted, prompts, params)
        stats = restarted.stats()
    assert stats["prefix_cache_disk_hits"] > 0  # rank 0 read its share ...
    assert stats["prefix_cache_hits"] == 0  # ... but no block was placed
    assert_same_tokens_close_logprobs(cold, served)


def test_an_aborted_load_leaves_the_ranks_in_step(model_dir, tmp_path) -> None:
    params, prompts = SAMPLINGS["greedy"], make_prompts(33, 2)
    tp2 = {"tensor_parallel_size": 2, "prefix_cache_dir": str(tmp_path)}
    with make_llm(model_dir, **tp2) as first:
        cold = one_by_one(first, prompts, params)  # an empty directory: a cold cache
    with make_llm(model_dir, **tp2) as llm:
        engine = llm.engine
        engine.add_request("aborted", prompts[0], params)
        engine.add_request("loading", prompts[1], params)
        assert "aborted" in engine.prefix_tier and "loading" in engine.prefix_tier
        engine.abort_request("aborted")
        outputs = {}
        while engine.has_unfinished_requests():
            outputs |= {o.request_id: o for o in engine.step() if o.finished}
        assert set(outputs) == {"loading"} and llm.stats()["prefix_cache_hits"] > 0
        again = one_by_one(llm, prompts[:1], params)  # the aborted prompt, loaded now
    assert_same_tokens_close_logprobs(cold, again + [outputs["loading"]])


def test_each_rank_keeps_its_share_in_host_memory(model_dir) -> None:
    params, prompts = SAMPLINGS["greedy"], make_prompts(34, 6)
    with make_llm(model_dir, tensor_parallel_size=2, enable_prefix_caching=False) as llm:
        cold = one_by_one(llm, prompts, params)
    host = {"tensor_parallel_size": 2, "num_blocks": 16, "prefix_cache_host_size": "8MiB"}
    with make_llm(model_dir, **host) as llm:
        one_by_one(llm, prompts, params)  # a pool of 16 blocks: earlier prompts evicted
        hits = llm.stats()["prefix_cache_hits"]
        again = one_by_one(llm, prompts, params)
        stats = llm.stats()
    num_blocks = sum((len(p) - 1) // BLOCK_SIZE for p in prompts)
    assert stats["prefix_cache_host_hits"] > 0
    # Every prompt block hit again: those rank 0 and rank 1 both placed, and the few
    # still in the pool (a block placed on rank 0 alone would not be hit).
    assert stats["prefix_cache_hits"] - hits == num_blocks * BLOCK_SIZE, (stats, hits)
    assert_same_tokens_close_logprobs(cold, again)
