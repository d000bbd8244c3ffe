"""The engine over an int8 KV cache: pressure (recompute and swap preemption), prefix
caching, n > 1, beam search and 2 ranks give the tokens of the same int8 configuration
without them; the pool's bytes per token are the planner's."""

from __future__ import annotations

import random

import pytest
from helpers import make_hf_model

from pagedkv import LLM, BeamSearchParams, SamplingParams
from pagedkv.cache import PagedKVCache
from pagedkv.config import ModelConfig
from pagedkv.engine.builder import allocation_figures
from pagedkv.sim.planner import kv_bytes_per_token

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("int8"), "llama", seed=11)


def make_llm(model_dir, num_blocks: int, **kwargs) -> LLM:
    kwargs.setdefault("max_num_batched_tokens", 64)
    return LLM(model_dir, device="cpu", dtype="float32", block_size=BLOCK_SIZE,
               num_blocks=num_blocks, kv_cache_dtype="int8", **kwargs)  # fmt: skip


def prompts(seed: int, count: int, prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 512) for _ in range(prefix)]
    return [shared + [rng.randrange(3, 512) for _ in range(rng.randint(8, 30))]
            for _ in range(count)]  # fmt: skip


def tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def test_kv_cache_dtype_is_validated(model_dir) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype: expected one of"):
        LLM(model_dir, kv_cache_dtype="int4")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_gives_the_roomy_pool_tokens(model_dir, mode: str) -> None:
    batch = prompts(1, 8)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(n=2, temperature=0.9, seed=100, max_tokens=16, ignore_eos=True)
    roomy = make_llm(model_dir, 400)
    assert roomy.engine.runner.kv_cache.is_quantized
    want = [tokens(roomy.generate(batch, p, use_tqdm=False)) for p in (greedy, seeded)]
    config = ModelConfig.from_hf(model_dir)
    shape = (config.num_layers, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    per_block = PagedKVCache.bytes_per_block(*shape, "int8")
    tiny = make_llm(model_dir, 30, preemption_mode=mode,
                    swap_space=64 * per_block if mode == "swap" else 0)  # fmt: skip
    got = [tokens(tiny.generate(batch, p, use_tqdm=False)) for p in (greedy, seeded)]
    assert got == want
    stats = tiny.stats()
    assert stats["num_preemptions"] > 0
    if mode == "swap":
        assert stats["num_swapped_out"] > 0


def test_prefix_hits_and_beams_give_the_tokens_without_sharing(model_dir) -> None:
    batch = prompts(2, 6, prefix=24)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    shared, alone = make_llm(model_dir, 400), make_llm(model_dir, 400, enable_prefix_caching=False)
    first = tokens(shared.generate(batch[:1], greedy, use_tqdm=False))
    got = first + tokens(shared.generate(batch[1:], greedy, use_tqdm=False))
    assert shared.stats()["prefix_cache_hits"] > 0
    assert got == tokens(alone.generate(batch, greedy, use_tqdm=False))
    beams = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
    roomy = [[s.tokens for s in r.sequences] for r in alone.beam_search(batch[:2], beams)]
    tight = make_llm(model_dir, 24, enable_prefix_caching=False)
    assert [[s.tokens for s in r.sequences] for r in tight.beam_search(batch[:2], beams)] == roomy


def test_two_ranks_quantize_their_own_heads(tmp_path) -> None:
    model_dir = make_hf_model(tmp_path, "qwen3")
    batch = prompts(3, 3)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    results = []
    for size in (1, 2):
        with LLM(model_dir, dtype="float32", block_size=BLOCK_SIZE, num_blocks=64,
                 kv_cache_dtype="int8", tensor_parallel_size=size) as llm:  # fmt: skip
            results.append(tokens(llm.generate(batch, greedy, use_tqdm=False)))
            runner = llm.engine.runner
            figures = allocation_figures(runner.model, runner.kv_cache)
            config = llm.engine.model_config
        assert figures["kv_bytes_per_token"] == kv_bytes_per_token(config, "int8", size)
    assert results[0] == results[1]


def test_int8_holds_about_twice_the_tokens_per_gib(tmp_path) -> None:
    """head_dim 64 (SmolLM2-135M's): 64 B + a 2 B scale per token and KV head, against 128 B
    in bfloat16 and 256 B in float32; the engine's pools and the planner agree."""
    model_dir = make_hf_model(tmp_path, "llama", hidden_size=128, num_attention_heads=2,
                              num_key_value_heads=1)  # fmt: skip
    per_token = {}
    for dtype, kv in (("float32", "auto"), ("bfloat16", "auto"), ("float32", "int8")):
        with LLM(model_dir, dtype=dtype, kv_cache_dtype=kv, num_blocks=8) as llm:
            runner = llm.engine.runner
            figures = allocation_figures(runner.model, runner.kv_cache)
            config = llm.engine.model_config
        assert config.head_dim == 64
        name = dtype if kv == "auto" else kv
        assert figures["kv_bytes_per_token"] == kv_bytes_per_token(config, name)
        per_token[name] = figures["kv_bytes_per_token"]
    assert per_token["bfloat16"] / per_token["int8"] >= 1.9
    assert per_token["float32"] / per_token["int8"] >= 3.8
