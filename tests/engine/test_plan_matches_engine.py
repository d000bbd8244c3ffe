"""`pagedkv plan` against the engine's own sizing, on Gemma 3 4B's configuration.

No weights are loaded: the engine's figures come from the functions its builder sizes the
KV pool with at start-up (`kv_block_shape`, `_num_device_blocks`, `kv_capacity`, the
figures its start-up log prints), given the plan's KV budget as `kv_cache_memory`; and the
manager, driven as the engine drives it, counts how many full-context sequences really fit.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from pagedkv.cache import PagedKVCache
from pagedkv.config import ModelConfig
from pagedkv.engine import builder
from pagedkv.engine.args import EngineArgs
from pagedkv.engine.builder import create_engine_config, kv_block_shape, kv_capacity
from pagedkv.errors import OutOfBlocks
from pagedkv.memory import KVCacheManager
from pagedkv.sim import planner

MODEL, MEMORY, CONTEXT, BLOCK_SIZE = "gemma-3-4b", 16 * 2**30, 32 * 1024, 16


def within(measured: int, planned: int, share: float = 0.05) -> bool:
    return abs(measured - planned) <= share * planned


@pytest.fixture(scope="module")
def plan() -> planner.Plan:
    model = planner.load_model(MODEL)
    return planner.plan_memory(model, MEMORY, name=MODEL, context=CONTEXT, block_size=BLOCK_SIZE)


@pytest.fixture(scope="module")
def engine_sizes(plan, tmp_path_factory) -> tuple[tuple[int | None, ...], int, int]:
    """The builder's (group windows, num_blocks, bytes per block) for the plan's budget."""
    model_dir = tmp_path_factory.mktemp("gemma")
    shutil.copy(Path(str(planner._CONFIGS / f"{MODEL}.json")), model_dir / "config.json")
    args = EngineArgs(model=str(model_dir), dtype="bfloat16", block_size=BLOCK_SIZE,
                      kv_cache_memory=plan.kv_budget_bytes, max_model_len=CONTEXT)  # fmt: skip
    config = create_engine_config(args, ModelConfig.from_hf(model_dir), "cpu")
    _, groups, shape = kv_block_shape(args, config, config.model.kv_heads_per_rank(1))
    num_blocks = builder._num_device_blocks(
        config.cache, config.scheduler, shape, CONTEXT, "cpu", 1, groups.windows
    )
    return groups.windows, num_blocks, PagedKVCache.bytes_per_block(*shape)


def test_plan_blocks_and_groups_match_the_engine_pool(plan, engine_sizes) -> None:
    windows, num_blocks, per_block = engine_sizes
    assert per_block == plan.kv_bytes_per_block
    assert within(num_blocks, plan.num_blocks)
    assert windows == tuple(window for window, _, _ in plan.kv_groups)
    assert len(windows) == 7 and windows.count(None) == 1  # six sliding groups, one full
    capacity = kv_capacity(windows, num_blocks, BLOCK_SIZE, CONTEXT)
    assert capacity["blocks_per_sequence"] == plan.blocks_per_sequence
    assert within(capacity["max_sequences_at_context"], plan.max_sequences_at_context)


def test_plan_max_sequences_fit_in_the_manager(plan, engine_sizes) -> None:
    windows, num_blocks, _ = engine_sizes
    m = KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=False, windows=windows)
    block = [0] * BLOCK_SIZE
    num_full = 0
    try:
        while True:  # sequences grown one at a time to the full context, a block per step
            m.allocate(num_full, block)
            for _ in range(CONTEXT // BLOCK_SIZE - 1):
                m.append(num_full, block)
            num_full += 1
    except OutOfBlocks:
        pass
    m.check()
    stats = m.stats()
    held = [stats[f"group_{g}_max_seq_blocks"] for g in range(len(windows))]
    assert held == [blocks for _, _, blocks in plan.kv_groups]
    assert sum(held) == plan.blocks_per_sequence
    assert within(num_full, plan.max_sequences_at_context), (num_full, plan)


def test_start_up_log_reports_the_capacity(caplog, tmp_path) -> None:
    from helpers import make_hf_model

    from pagedkv import LLM

    model_dir = make_hf_model(tmp_path, "qwen2", seed=1, num_hidden_layers=4,
                              layer_types=["sliding_attention"] * 3 + ["full_attention"],
                              use_sliding_window=True, sliding_window=32, max_window_layers=0,
                              max_position_embeddings=512)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="pagedkv.engine.builder"):
        with LLM(model_dir, device="cpu", dtype="float32", block_size=16, num_blocks=300,
                 max_model_len=512):  # fmt: skip
            pass
    plan = planner.plan_memory(planner.load_model(model_dir), 2**30, context=512, block_size=16)
    expected = 512 // 16 + 3 * (32 // 16 + 1)
    assert plan.blocks_per_sequence == expected
    line = f"a sequence of 512 tokens holds {expected} blocks: {300 // expected} such sequences"
    assert line in caplog.text
