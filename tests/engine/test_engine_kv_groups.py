"""KV cache groups on a Gemma-3-shaped model: five sliding-window layers to one full layer.

A Qwen2 config with `layer_types` gives the shape (window 64, blocks of 16). The sliding
layers' group must hold only the blocks its window reaches, the peak memory must fall with
it, and the tokens must not change: against the same model in one group, and against
transformers.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers import make_hf_model

from pagedkv import LLM, SamplingParams
from pagedkv.engine.builder import allocation_figures
from pagedkv.memory.groups import sequence_blocks
from pagedkv.sim.planner import kv_bytes_per_token

WINDOW, BLOCK_SIZE = 64, 16
LAYER_TYPES = (["sliding_attention"] * 5 + ["full_attention"]) * 2  # 10:2 layers, Gemma 3's mix


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model(
        tmp_path_factory.mktemp("groups"),
        "qwen2",
        seed=5,
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=LAYER_TYPES,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=0,
        max_position_embeddings=4096,
    )


def make_llm(model_dir, *, kv_cache_groups: bool = True, **kwargs) -> LLM:
    return LLM(model_dir, device="cpu", dtype="float32", block_size=BLOCK_SIZE,
               kv_cache_groups=kv_cache_groups, **kwargs)  # fmt: skip


def run_steps(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list, list]:
    """Generate step by step; returns each prompt's tokens and the stats after every step."""
    engine, done, history = llm.engine, {}, []
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = list(output.outputs[0].token_ids)
        history.append(engine.stats())
    return [done[str(i)] for i in range(len(prompts))], history


def sliding_groups(llm: LLM) -> list[int]:
    groups = llm.engine.runner.kv_cache.groups
    return [g for g, window in enumerate(groups.windows) if window is not None]


def test_layers_form_groups_of_equal_size(model_dir) -> None:
    with make_llm(model_dir, num_blocks=64) as llm:
        groups = llm.engine.runner.kv_cache.groups
        assert groups.windows == (WINDOW,) * 5 + (None,)
        assert groups.layers_per_group == 2
        assert groups.layers[0] == (0, 1) and groups.layers[5] == (5, 11)
    with make_llm(model_dir, num_blocks=64, kv_cache_groups=False) as llm:
        assert llm.engine.runner.kv_cache.groups.windows == (None,)


def test_a_long_sequence_keeps_only_its_window_in_sliding_groups(model_dir) -> None:
    prompt = [random.Random(1).randrange(3, 512) for _ in range(16)]
    params = SamplingParams(temperature=0, max_tokens=1024 - 16, ignore_eos=True)
    with make_llm(model_dir, num_blocks=256, max_num_batched_tokens=64) as llm:
        (tokens,), history = run_steps(llm, [prompt], params)
        sliding = sliding_groups(llm)
    assert len(tokens) == 1008 and len(history) >= 1008
    limit = -(-WINDOW // BLOCK_SIZE) + 1
    for stats in history[:-1]:  # the last step freed the sequence
        for g in sliding:
            assert 0 < stats[f"group_{g}_max_seq_blocks"] <= limit, stats
    most = max(stats["group_5_max_seq_blocks"] for stats in history)
    assert most == 1024 // BLOCK_SIZE  # the full-attention group keeps every block


def test_peak_memory_falls_and_outputs_do_not_change(model_dir) -> None:
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 512) for _ in range(1920 + i)] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=128 - 0, ignore_eos=True)
    results = {}
    for grouped in (True, False):
        with make_llm(model_dir, num_blocks=8 * 6 * 130, max_num_batched_tokens=256,
                      kv_cache_groups=grouped) as llm:  # fmt: skip
            tokens, history = run_steps(llm, prompts, params)
            kv_cache = llm.engine.runner.kv_cache
            per_block = kv_cache.num_bytes // kv_cache.num_blocks
            peak = max(stats["num_used_blocks"] for stats in history) * per_block
            results[grouped] = tokens, peak
    assert results[True][0] == results[False][0]
    assert results[True][1] <= 0.3 * results[False][1], results


@torch.inference_mode()
def test_greedy_tokens_equal_transformers(model_dir) -> None:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (150, 70, 9)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with make_llm(model_dir, num_blocks=128, max_num_batched_tokens=48) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = hf.generate(
            torch.tensor([prompt]), max_new_tokens=40, do_sample=False, min_new_tokens=40
        )[0, len(prompt) :].tolist()
        assert list(output.outputs[0].token_ids) == expected


def generated(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def batch(model_dir):
    """Prompts past the window (half of them sharing a prefix of six blocks), and their
    tokens from the model in one group and a roomy pool."""
    rng = random.Random(4)
    shared = [rng.randrange(3, 512) for _ in range(96)]
    prompts = [
        (shared if i % 2 else []) + [rng.randrange(3, 512) for _ in range(rng.randint(20, 90))]
        for i in range(6)
    ]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with make_llm(model_dir, num_blocks=2048, kv_cache_groups=False) as llm:
        return prompts, params, generated(llm, prompts, params)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_the_tokens(model_dir, batch, mode: str) -> None:
    prompts, params, expected = batch
    swap = 512 * 2 * 2 * BLOCK_SIZE * 2 * 16 * 4 if mode == "swap" else 0  # 512 blocks
    with make_llm(model_dir, num_blocks=90, max_num_batched_tokens=64, preemption_mode=mode,
                  swap_space=swap) as llm:  # fmt: skip
        assert generated(llm, prompts, params) == expected
        stats = llm.stats()
        assert stats["num_preemptions"] > 0
        if mode == "swap":
            assert stats["num_swapped_in_blocks"] > 0
        assert stats["num_free_blocks"] == stats["num_blocks"]


def test_prefix_hits_and_parallel_samples_keep_the_tokens(model_dir, batch) -> None:
    prompts, params, expected = batch
    with make_llm(model_dir, num_blocks=400, max_num_batched_tokens=128) as llm:
        assert generated(llm, prompts, params) == expected
        assert llm.stats()["prefix_cache_hits"] > 0  # the shared prefix, within one run
        hits = llm.stats()["prefix_cache_hits"]
        assert generated(llm, prompts, params) == expected
        assert llm.stats()["prefix_cache_hits"] > hits
    sampled = SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=24, ignore_eos=True)
    runs = {}
    for grouped in (True, False):
        with make_llm(model_dir, num_blocks=1024, kv_cache_groups=grouped) as llm:
            runs[grouped] = generated(llm, prompts[:3], sampled)
            assert llm.stats()["num_cow_copies"] > 0
    assert runs[True] == runs[False]


def test_beam_search_keeps_the_beams(model_dir, batch) -> None:
    from pagedkv import BeamSearchParams

    prompts, _, _ = batch
    params = BeamSearchParams(beam_width=3, max_tokens=20, ignore_eos=True)
    beams = {}
    for grouped in (True, False):
        with make_llm(model_dir, num_blocks=1024, kv_cache_groups=grouped) as llm:
            outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts[:2]], params)
            beams[grouped] = [[s.tokens for s in o.sequences] for o in outputs]
    assert beams[True] == beams[False]


def test_a_shared_prefix_hits_after_its_slid_out_blocks_were_evicted(model_dir) -> None:
    rng = random.Random(6)
    first = [rng.randrange(3, 512) for _ in range(400)]  # 25 blocks, far past the window
    filler = [rng.randrange(3, 512) for _ in range(160)]
    second = first + [rng.randrange(3, 512) for _ in range(20)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with make_llm(model_dir, num_blocks=200, enable_prefix_caching=False) as llm:
        expected = [generated(llm, [p], params)[0] for p in (first, filler, second)]
    with make_llm(model_dir, num_blocks=200) as llm:
        assert generated(llm, [first], params)[0] == expected[0]
        # The first prompt's blocks that slid out of the window were freed first: the
        # filler's blocks evict them, while the full group's and the last window's stay.
        assert generated(llm, [filler], params)[0] == expected[1]
        stats = llm.stats()
        assert stats["num_evictions"] > 0
        hits = stats["prefix_cache_hits"]
        assert generated(llm, [second], params)[0] == expected[2]
        assert llm.stats()["prefix_cache_hits"] - hits == len(first)


def test_a_prompt_whose_whole_prefill_does_not_fit_runs_in_smaller_chunks(model_dir) -> None:
    """Alone, a prefill chunk that does not fit the pool shrinks to what does: the sliding
    groups free their old blocks as it goes, so the prompt runs (not ended at 0 tokens)."""
    prompt = random.Random(3).choices(range(3, 500), k=300)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with make_llm(model_dir) as llm:
        expected = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        windows = llm.engine.runner.kv_cache.groups.windows
    held = sum(sequence_blocks(windows, len(prompt) + 8, BLOCK_SIZE))
    whole = len(windows) * -(-(len(prompt) + 1) // BLOCK_SIZE)  # every group, one chunk
    assert held < whole
    with make_llm(model_dir, num_blocks=held + len(windows)) as llm:
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == list(expected) and out.finish_reason == "length"


def test_the_start_up_figures_count_every_layer_as_the_plan_does(model_dir) -> None:
    with make_llm(model_dir, num_blocks=32) as llm:
        runner = llm.engine.runner
        figures = allocation_figures(runner.model, runner.kv_cache)
        config = llm.engine.model_config
    assert len(runner.kv_cache.groups.windows) > 1
    assert figures["kv_bytes_per_token"] == kv_bytes_per_token(config, "float32")
