"""Engines sharing one prefix cache directory keep one disk budget between them, whichever
model (namespace) their files belong to, and still serve the tokens of a cold cache."""

from __future__ import annotations

import glob
import os

from helpers import make_hf_model
from test_prefix_tier import (
    assert_same_tokens_close_logprobs,
    block_files,
    greedy_case,
    make_llm,
    one_by_one,
)


def directory_bytes(directory) -> int:
    return sum(os.path.getsize(path) for path in block_files(directory))


def test_two_engines_on_one_directory_keep_one_budget(tmp_path) -> None:
    models = [make_hf_model(tmp_path / f"model{seed}", "llama", seed=seed) for seed in (21, 22)]
    params, prompts, cold = greedy_case(models[1], 13, 6)
    with make_llm(models[0], num_blocks=4) as probe:
        file_bytes = probe.engine.runner.kv_cache.bytes_per_stored_block + 200
    budget = 24 * file_bytes
    directory = tmp_path / "tier"
    tier = {"prefix_cache_dir": str(directory), "prefix_cache_disk_size": budget}
    with make_llm(models[0], num_blocks=16, **tier) as first:
        with make_llm(models[1], num_blocks=16, **tier) as second:
            for llm in (first, second, first, second):  # both write while both run
                one_by_one(llm, prompts, params)
                llm.engine.prefix_tier.flush()
                assert directory_bytes(directory) <= budget
            evictions = [llm.stats()["prefix_cache_disk_evictions"] for llm in (first, second)]
    assert directory_bytes(directory) <= budget  # after both saved their pools at close
    namespaces = [p for p in glob.glob(str(directory / "*")) if os.path.isdir(p)]
    assert len(namespaces) == 2 and min(evictions) > 0, evictions
    with make_llm(models[1], **tier) as again:  # the last to close: its files the newest
        served = one_by_one(again, prompts, params)
        assert again.stats()["prefix_cache_disk_hits"] > 0
    assert_same_tokens_close_logprobs(cold, served)
