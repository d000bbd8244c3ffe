"""`SamplingParams(prompt_logprobs=k)`: vLLM's shape, equal to transformers' log-softmax, the
same with prefix caching on and off, chunked prefill and preemption."""

from __future__ import annotations

import pytest
import torch
from helpers import make_hf_model

from pagedkv import LLM, SamplingParams

SHARED = list(range(3, 40))  # 37 tokens: several blocks of 8 shared by every prompt
PROMPTS = [SHARED + [50, 51, 52], SHARED + [60], [7, 8, 9, 10]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("plp"), "qwen2", seed=3)


@pytest.fixture(scope="module")
def reference(model_dir):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)

    return logprobs


def _run(model_dir, enable_prefix_caching: bool, num_blocks: int = 64, max_tokens: int = 3):
    llm = LLM(
        model_dir,
        device="cpu",
        dtype="float32",
        block_size=8,
        num_blocks=num_blocks,
        max_num_batched_tokens=16,  # every long prompt is prefilled in chunks
        enable_prefix_caching=enable_prefix_caching,
    )
    params = SamplingParams(
        temperature=0, max_tokens=max_tokens, prompt_logprobs=2, ignore_eos=True
    )
    # Warm the prefix cache first: the prompt-logprob requests must still compute it all.
    llm.generate([SHARED + [1]], SamplingParams(max_tokens=1), use_tqdm=False)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.stats()["prefix_cache_hits"] == 0
    return outputs, llm.stats()["num_preemptions"]


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_prompt_logprobs_equal_transformers(model_dir, reference, enable_prefix_caching):
    outputs, _ = _run(model_dir, enable_prefix_caching)
    for output, prompt in zip(outputs, PROMPTS, strict=True):
        entries = output.prompt_logprobs
        assert len(entries) == len(prompt) and entries[0] is None
        rows = reference(prompt)
        for i in range(1, len(prompt)):
            entry = entries[i]
            assert prompt[i] in entry and len(entry) in (2, 3)  # top 2 + the prompt token
            assert entry[prompt[i]] == pytest.approx(rows[i - 1, prompt[i]].item(), abs=2e-4)
            top2 = rows[i - 1].topk(2).indices.tolist()
            assert set(top2) <= set(entry)


def test_identical_with_prefix_caching_on_and_off(model_dir):
    on, _ = _run(model_dir, True)
    off, _ = _run(model_dir, False)
    assert [o.prompt_logprobs for o in on] == [o.prompt_logprobs for o in off]
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]


def test_a_recomputed_prompt_keeps_its_logprobs(model_dir):
    # 12 blocks of 8 tokens cannot hold the three requests at full length: some are
    # preempted and recompute their prompts.
    small, num_preemptions = _run(model_dir, True, num_blocks=12, max_tokens=30)
    assert num_preemptions > 0
    roomy, _ = _run(model_dir, True, max_tokens=30)
    for a, b in zip(small, roomy, strict=True):
        assert len(a.prompt_logprobs) == len(a.prompt_token_ids)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            assert x == pytest.approx(y, abs=1e-4)


def test_without_prompt_logprobs_there_are_none(model_dir):
    llm = LLM(model_dir, device="cpu", dtype="float32", block_size=8, num_blocks=64)
    output = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert output.prompt_logprobs is None
    zero = SamplingParams(max_tokens=1, prompt_logprobs=0)
    only = llm.generate([PROMPTS[2]], zero, use_tqdm=False)[0].prompt_logprobs
    assert only[0] is None and [list(e) for e in only[1:]] == [[8], [9], [10]]
