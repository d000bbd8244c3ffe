"""A process that compiles the CPU kernels and one that loads them from the kernel cache
compute the same bits: same greedy tokens, same logprobs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import make_hf_model

_GENERATE = """
import json
import sys

from pagedkv import LLM, SamplingParams

model_dir, dtypes = sys.argv[1], sys.argv[2:]
# Prompts longer than an attention span (64 tokens) and a token budget that splits them:
# steps that mix decode rows with prefill chunks (the attention kernel) and steps of
# decode rows only (the compiled decoder stack).
prompts = [[3 + (7 * i + 11 * j) % 500 for j in range(n)] for i, n in enumerate((150, 90, 200, 40))]
params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
result = {}
for dtype in dtypes:
    llm = LLM(model_dir, device="cpu", dtype=dtype, block_size=8, num_blocks=128,
              max_num_batched_tokens=64, seed=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    result[dtype] = [
        [o.outputs[0].token_ids, [sorted(step.items()) for step in o.outputs[0].logprobs]]
        for o in outputs
    ]
print(json.dumps(result))
"""


def _generate(model_dir: str, cache_dir: str, dtypes: tuple[str, ...]) -> tuple[dict, str]:
    env = os.environ | {"PAGEDKV_CACHE_DIR": cache_dir}
    result = subprocess.run(
        [sys.executable, "-c", _GENERATE, model_dir, *dtypes],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1]), result.stderr


@pytest.mark.slow
def test_compiling_and_loading_processes_agree_bit_for_bit(tmp_path) -> None:
    """The first process (an empty cache: it compiles) and the next (it loads) give the
    same tokens and the same logprobs, in float32 and bfloat16."""
    # Sizes that are not multiples of a vector: the sums' last elements are summed apart.
    model_dir = str(make_hf_model(tmp_path, "llama", seed=3, hidden_size=72, intermediate_size=100))
    cache_dir = str(tmp_path / "cache")
    dtypes = ("float32", "bfloat16")
    compiled, stderr = _generate(model_dir, cache_dir, dtypes)
    assert "compiling CPU kernels" in stderr, stderr
    loaded, stderr = _generate(model_dir, cache_dir, dtypes)
    assert "compiling CPU kernels" not in stderr, stderr
    for dtype in dtypes:
        assert loaded[dtype] == compiled[dtype], dtype
