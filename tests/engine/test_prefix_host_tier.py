"""The prefix cache's host-memory tier on a tiny random Llama, alone and before the disk:
hits give the tokens of a cold cache; what it evicts goes on to the disk, and at close all
it holds does; its counters reach `stats()` and `/metrics`.

PAGEDKV_DEBUG=1 (tests/conftest.py) runs `KVCacheManager.check()` after every step.
"""

from __future__ import annotations

import pytest
from helpers import make_hf_model
from test_prefix_tier import (
    BLOCK_SIZE,
    assert_same_tokens_close_logprobs,
    block_files,
    greedy_case,
    make_llm,
    one_by_one,
)

from pagedkv.engine.args import EngineArgs
from pagedkv.server.metrics import ServerMetrics


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("host-tier"), "llama", seed=21)


@pytest.fixture(scope="module")
def block_bytes(model_dir) -> int:
    with make_llm(model_dir, num_blocks=4) as llm:
        return llm.engine.runner.kv_cache.bytes_per_stored_block


def test_blocks_evicted_while_serving_come_back_from_host_memory(model_dir, block_bytes) -> None:
    params, prompts, cold = greedy_case(model_dir, 2, 8)
    with make_llm(model_dir, num_blocks=16, prefix_cache_host_size=64 * block_bytes) as llm:
        first = one_by_one(llm, prompts, params)
        llm.engine.prefix_tier.flush()
        assert llm.stats()["prefix_cache_host_bytes_written"] > 0
        again = one_by_one(llm, prompts, params)
        stats = llm.stats()
        metrics = ServerMetrics(llm.stats).render().decode()
    hits = stats["prefix_cache_host_hits"]
    assert hits > 0 and stats["prefix_cache_host_bytes_read"] == hits * block_bytes
    assert stats["prefix_cache_host_misses"] >= len(prompts)  # the first pass found none
    assert "prefix_cache_disk_hits" not in stats
    assert f"pagedkv_prefix_cache_host_hits_blocks_total {float(hits)}" in metrics
    for name in ("misses", "read_bytes", "written_bytes", "evictions_blocks"):
        assert f"pagedkv_prefix_cache_host_{name}_total" in metrics
    assert_same_tokens_close_logprobs(cold, first)
    assert_same_tokens_close_logprobs(cold, again)


def test_blocks_the_host_tier_evicts_go_on_to_the_disk(model_dir, tmp_path, block_bytes) -> None:
    params, prompts, cold = greedy_case(model_dir, 2, 8)
    tiers = {"prefix_cache_host_size": 4 * block_bytes, "prefix_cache_dir": str(tmp_path)}
    with make_llm(model_dir, num_blocks=16, **tiers) as llm:
        one_by_one(llm, prompts, params)
        llm.engine.prefix_tier.flush()
        stats = llm.stats()
        assert stats["prefix_cache_host_blocks"] == 4 and stats["prefix_cache_host_evictions"] > 0
        assert stats["prefix_cache_disk_bytes_written"] > 0
        again = one_by_one(llm, prompts, params)
        stats = llm.stats()
    assert stats["prefix_cache_host_hits"] > 0 and stats["prefix_cache_disk_hits"] > 0
    assert_same_tokens_close_logprobs(cold, again)
    num_blocks = sum((len(p) - 1) // BLOCK_SIZE for p in prompts)
    assert len(block_files(tmp_path)) >= num_blocks  # host memory's blocks went down at close
    with make_llm(model_dir, prefix_cache_dir=str(tmp_path)) as restarted:
        served = one_by_one(restarted, prompts, params)
        assert restarted.stats()["prefix_cache_disk_hits"] == num_blocks
    assert_same_tokens_close_logprobs(cold, served)


def test_engine_args_check_the_host_tier_size(model_dir) -> None:
    assert EngineArgs(model="m").create_cache_config().prefix_cache_host_size == 0
    args = EngineArgs(model="m", prefix_cache_host_size="3MiB")
    assert args.create_cache_config().prefix_cache_host_size == 3 << 20
    with pytest.raises(ValueError, match="prefix_cache_host_size: expected a non-negative"):
        EngineArgs(model="m", prefix_cache_host_size=-1)
    with pytest.raises(ValueError, match="prefix_cache_host_size: expected enable_prefix_c"):
        EngineArgs(model="m", prefix_cache_host_size="1GiB", enable_prefix_caching=False)
    with pytest.raises(ValueError, match="prefix_cache_host_size: expected at least one block"):
        make_llm(model_dir, prefix_cache_host_size=100)


def test_the_host_tier_flag_reaches_serve() -> None:
    from pagedkv.cli import build_parser

    namespace = build_parser().parse_args(["serve", "--model", "m", "--prefix-cache-host-size",
                                           "2GiB"])  # fmt: skip
    assert EngineArgs.from_cli_args(namespace).prefix_cache_host_size == 2 << 30
