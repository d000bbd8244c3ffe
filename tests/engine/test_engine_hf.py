"""Greedy generation on the paged engine against transformers' `generate` (float32).

Random weights make near-ties: the comparison of a prompt stops at the first step whose
top-2 logit margin in HF's logits is below 1e-4 (either side may pick either token there).
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers import make_hf_model

from pagedkv import LLM, SamplingParams

MARGIN = 1e-4
LOGPROB_TOL = 2e-3
NEW_TOKENS = 12
PROMPT_LENS = [1, 5, 16, 37, 130, 300]

# (arch, block_size): block sizes include non-powers of two.
CASES = [
    ("llama", 16),
    ("qwen2", 5),
    ("qwen3", 7),
    ("mistral", 3),
    ("gemma3", 4),
    ("phi3", 16),
    ("phi4", 5),
    ("smollm3", 7),
]
FAMILIES = ["gemma3", "phi3", "phi4", "smollm3"]


def hf_greedy(model_dir, prompts: list[list[int]]) -> list[tuple[list[int], torch.Tensor]]:
    """Per prompt: HF's greedy tokens and raw logits [NEW_TOKENS, vocab] (EOS ignored)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    results = []
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        tokens = out.sequences[0, len(prompt) :].tolist()
        results.append((tokens, torch.cat(out.logits).float()))
    return results


def compare_greedy(expected, outputs) -> int:
    """Assert token and logprob agreement up to each prompt's first near-tie; returns the
    number of tokens compared."""
    compared = 0
    for (tokens, logits), output in zip(expected, outputs, strict=True):
        completion = output.outputs[0]
        assert len(completion.token_ids) == NEW_TOKENS
        logprobs = torch.log_softmax(logits, dim=-1)
        for step, token in enumerate(tokens):
            top2 = logits[step].topk(2).values
            if top2[0] - top2[1] < MARGIN:
                break
            assert completion.token_ids[step] == token, f"step {step}"
            got = completion.logprobs[step][token]
            assert abs(got - logprobs[step, token].item()) < LOGPROB_TOL
            compared += 1
        sampled = zip(completion.logprobs, completion.token_ids, strict=True)
        assert completion.cumulative_logprob == pytest.approx(sum(e[t] for e, t in sampled))
    return compared


@pytest.mark.parametrize("arch,block_size", CASES)
def test_greedy_matches_transformers(tmp_path, arch: str, block_size: int) -> None:
    model_dir = make_hf_model(tmp_path, arch, seed=3)
    rng = random.Random(arch)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENS]
    expected = hf_greedy(model_dir, prompts)
    # A small token budget: long prompts are chunked and share steps with decodes.
    llm = LLM(
        model_dir,
        dtype="float32",
        device="cpu",
        block_size=block_size,
        num_blocks=400,
        max_num_batched_tokens=48,
    )
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts
    compared = compare_greedy(expected, outputs)
    assert compared >= len(prompts) * NEW_TOKENS // 2, "too few tokens compared"
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_prefix_caching_on_and_off_agree(tmp_path) -> None:
    model_dir = make_hf_model(tmp_path, "llama", seed=5)
    rng = random.Random(0)
    shared = [rng.randrange(3, 512) for _ in range(45)]
    prompts = [shared + [rng.randrange(3, 512) for _ in range(k)] for k in (1, 9, 20, 33)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    results = {}
    for caching in (True, False):
        llm = LLM(
            model_dir,
            device="cpu",
            block_size=8,
            num_blocks=200,
            max_num_batched_tokens=64,
            enable_prefix_caching=caching,
        )
        # One at a time first, so later prompts find the shared prefix cached.
        first = llm.generate(prompts[0], params, use_tqdm=False)
        rest = llm.generate(prompts[1:], params, use_tqdm=False)
        results[caching] = [o.outputs[0].token_ids for o in first + rest], llm.stats()
        # No logprobs asked for: none computed, as in vLLM.
        assert all(o.outputs[0].cumulative_logprob is None for o in first + rest)
    assert results[True][0] == results[False][0]
    hits_on, hits_off = (
        results[True][1]["prefix_cache_hits"],
        results[False][1]["prefix_cache_hits"],
    )
    assert hits_on >= 3 * 40 and hits_off == 0
    assert results[True][1]["prefix_cache_queries"] > 0


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(arch, HF model dir, GGUF file written from it, prompts sharing a prefix, HF's greedy
    tokens and logits for them). Gemma 3 takes the shape llama.cpp assumes (see test_gguf)."""
    pytest.importorskip("gguf")
    from helpers.gguf_models import write_gguf

    arch = request.param
    overrides = (
        {"query_pre_attn_scalar": 16, "num_hidden_layers": 6, "layer_types": None}
        if arch == "gemma3"
        else {}
    )
    model_dir = make_hf_model(tmp_path_factory.mktemp(arch), arch, seed=7, **overrides)
    gguf_path = model_dir.parent / f"{arch}.gguf"
    write_gguf(model_dir, gguf_path)  # F32: the very weights HF runs
    rng = random.Random(arch)
    shared = [rng.randrange(3, 512) for _ in range(21)]
    prompts = [shared + [rng.randrange(3, 512) for _ in range(k)] for k in (3, 26, 11, 40, 1)]
    return arch, model_dir, gguf_path, prompts, hf_greedy(model_dir, prompts)


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_families_with_prefix_caching_and_preemption(family, source: str, mode: str) -> None:
    from pagedkv.cache import PagedKVCache
    from pagedkv.config import ModelConfig
    from pagedkv.memory.groups import group_layers

    arch, model_dir, gguf_path, prompts, expected = family
    path = model_dir if source == "safetensors" else gguf_path
    config = ModelConfig.from_hf(path)
    groups = group_layers(config.sliding_windows, config.num_layers)
    block_bytes = PagedKVCache.bytes_per_block(
        groups.layers_per_group, 4, config.num_kv_heads, config.head_dim, "float32"
    )
    # 24 blocks of 4 tokens for a full-attention group, a few for each other (a sliding
    # group keeps its window): fewer than the batch needs, so it preempts; chunks of 16.
    llm = LLM(
        path,
        dtype="float32",
        device="cpu",
        block_size=4,
        num_blocks=24 + 6 * (groups.num_groups - 1),
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
        preemption_mode=mode,
        swap_space=64 * block_bytes if mode == "swap" else 0,
    )
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    # The first alone, so the others find the shared prefix cached.
    outputs = llm.generate(prompts[:1], params, use_tqdm=False)
    outputs += llm.generate(prompts[1:], params, use_tqdm=False)
    compared = compare_greedy(expected, outputs)
    assert compared >= len(prompts) * NEW_TOKENS // 2, "too few tokens compared"
    stats = llm.stats()
    assert stats["prefix_cache_hits"] >= 16 and stats["num_preemptions"] > 0, stats
    if mode == "swap":
        assert stats["num_swapped_out"] > 0
    assert stats["num_free_blocks"] == stats["num_blocks"]
