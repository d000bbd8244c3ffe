"""The engine under memory pressure and with sharing, on a tiny random Llama.

PAGEDKV_DEBUG=1 (tests/conftest.py) runs `KVCacheManager.check()` after every step.
"""

from __future__ import annotations

import random

import pytest
from helpers import make_hf_model

from pagedkv import LLM, SamplingParams
from pagedkv.cache import PagedKVCache

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("mem"), "llama", seed=11)


def make_llm(model_dir, num_blocks: int, **kwargs) -> LLM:
    kwargs.setdefault("max_num_batched_tokens", 64)
    return LLM(
        model_dir,
        device="cpu",
        dtype="float32",
        block_size=BLOCK_SIZE,
        num_blocks=num_blocks,
        **kwargs,
    )


def prompts(seed: int, count: int, low: int = 8, high: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(low, high))] for _ in range(count)]


def assert_all_free(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert stats["num_seqs"] == 0 and stats["num_free_host_blocks"] == stats["num_host_blocks"]


def swap_bytes(model_dir, num_blocks: int) -> int:
    from pagedkv.config import ModelConfig

    config = ModelConfig.from_hf(model_dir)
    return num_blocks * PagedKVCache.bytes_per_block(
        config.num_layers, BLOCK_SIZE, config.num_kv_heads, config.head_dim, "float32"
    )


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_gives_the_roomy_pool_output(model_dir, mode: str) -> None:
    batch = prompts(1, 8)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seeded = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=24, ignore_eos=True)
        for i in range(len(batch))
    ]
    roomy = make_llm(model_dir, 400)
    expected_greedy = [
        o.outputs[0].token_ids for o in roomy.generate(batch, greedy, use_tqdm=False)
    ]
    expected_seeded = [
        o.outputs[0].token_ids for o in roomy.generate(batch, seeded, use_tqdm=False)
    ]
    # 8 requests of up to 54 tokens need up to 14 blocks each: 30 blocks force preemption.
    tiny = make_llm(
        model_dir,
        30,
        preemption_mode=mode,
        swap_space=swap_bytes(model_dir, 64) if mode == "swap" else 0,
    )
    got_greedy = tiny.generate(batch, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got_greedy] == expected_greedy
    stats = tiny.stats()
    assert stats["num_preemptions"] > 0
    assert sum(o.metrics.num_preemptions for o in got_greedy) == stats["num_preemptions"]
    if mode == "swap":
        assert stats["num_swapped_out"] > 0 and stats["num_swapped_in_blocks"] > 0
    got_seeded = tiny.generate(batch, seeded, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got_seeded] == expected_seeded
    assert tiny.stats()["num_preemptions"] > stats["num_preemptions"]
    assert_all_free(tiny)


def test_swap_falls_back_to_recompute_when_host_is_full(model_dir) -> None:
    batch = prompts(2, 6)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = [
        o.outputs[0].token_ids
        for o in make_llm(model_dir, 400).generate(batch, params, use_tqdm=False)
    ]
    llm = make_llm(model_dir, 24, preemption_mode="swap", swap_space=swap_bytes(model_dir, 3))
    got = llm.generate(batch, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == expected
    stats = llm.stats()
    assert stats["num_preemptions"] > stats["num_swapped_out"]  # some were recomputed
    assert_all_free(llm)


def peak_blocks(llm: LLM, prompt: list[int], params_list: list[SamplingParams]):
    engine, peak, outputs = llm.engine, 0, {}
    for i, params in enumerate(params_list):
        engine.add_request(f"peak-{i}", prompt, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output
        peak = max(peak, engine.stats()["num_used_blocks"])
    return peak, outputs


def test_parallel_sampling_shares_blocks_and_is_reproducible(model_dir) -> None:
    prompt = prompts(3, 1, 30, 30)[0]
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = make_llm(model_dir, 200)
        peak, outputs = peak_blocks(llm, prompt, [params])
        runs.append([c.token_ids for c in outputs["peak-0"].outputs])
        assert_all_free(llm)
    assert runs[0] == runs[1]
    assert len({tuple(t) for t in runs[0]}) == 4, "the 4 samples should differ"
    assert llm.stats()["num_cow_copies"] > 0
    # Prompt blocks counted once: 7 full prompt blocks + 4 x 3 blocks of 2 + 10 tokens.
    separate = [
        SamplingParams(temperature=1.0, seed=7 + i, max_tokens=10, ignore_eos=True)
        for i in range(4)
    ]
    separate_peak, _ = peak_blocks(
        make_llm(model_dir, 200, enable_prefix_caching=False), prompt, separate
    )
    assert separate_peak == 4 * 10
    assert peak <= 30 // BLOCK_SIZE + 4 * 3 < separate_peak


def test_parallel_sampling_under_preemption(model_dir) -> None:
    batch = prompts(4, 4)
    params = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=16, ignore_eos=True)
    expected = [
        [c.token_ids for c in o.outputs]
        for o in make_llm(model_dir, 400).generate(batch, params, use_tqdm=False)
    ]
    for mode in ("recompute", "swap"):
        llm = make_llm(model_dir, 26, preemption_mode=mode, swap_space=swap_bytes(model_dir, 64))
        got = llm.generate(batch, params, use_tqdm=False)
        assert [[c.token_ids for c in o.outputs] for o in got] == expected
        assert llm.stats()["num_preemptions"] > 0
        assert_all_free(llm)


def test_greedy_n_gives_identical_samples(model_dir) -> None:
    llm = make_llm(model_dir, 100)
    output = llm.generate(
        prompts(5, 1)[0], SamplingParams(n=3, temperature=0, max_tokens=6), use_tqdm=False
    )[0]
    assert len(output.outputs) == 3
    assert all(c.token_ids == output.outputs[0].token_ids for c in output.outputs)
    assert [c.index for c in output.outputs] == [0, 1, 2]


def test_impossible_request_is_rejected_and_the_engine_keeps_serving(model_dir) -> None:
    llm = make_llm(model_dir, 10)
    engine = llm.engine
    with pytest.raises(ValueError, match="fits the pool"):
        engine.add_request("big", list(range(3, 43)), SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok", [5, 6, 7], SamplingParams(max_tokens=2))
        engine.add_request("ok", [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("bad", [5, 100_000], SamplingParams())
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request("bias", [5, 6, 7], SamplingParams(logit_bias={10**6: 1.0}))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].request_id == "ok" and outputs[-1].finished
    assert len(outputs[-1].outputs[0].token_ids) == 2
    # A completion longer than the whole pool ends with "length" once it is alone: every
    # slot holds a computed token, plus the last sampled one.
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    long = llm.generate([5, 6, 7], params, use_tqdm=False)[0].outputs[0]
    assert long.finish_reason == "length" and len(long.token_ids) == 10 * BLOCK_SIZE - 3 + 1
    assert_all_free(llm)


def test_abort_frees_blocks_at_once(model_dir) -> None:
    llm = make_llm(model_dir, 100)
    engine = llm.engine
    engine.add_request("a", prompts(6, 1)[0], SamplingParams(n=2, max_tokens=50, seed=1))
    engine.step()
    engine.step()
    assert engine.stats()["num_used_blocks"] > 0 and engine.num_running == 1
    engine.abort_request("a")
    engine.abort_request("never-existed")
    assert engine.stats()["num_used_blocks"] == 0 and not engine.has_unfinished_requests()


def test_seeded_request_does_not_depend_on_the_batch(model_dir) -> None:
    llm = make_llm(model_dir, 200)
    prompt = prompts(7, 1)[0]
    params = SamplingParams(temperature=0.7, top_k=50, seed=123, max_tokens=10)
    alone = llm.generate(prompt, params, use_tqdm=True)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=12) for _ in range(5)]
    batch = llm.generate([*prompts(8, 5), prompt], [*others, params], use_tqdm=False)
    assert batch[-1].outputs[0].token_ids == alone
