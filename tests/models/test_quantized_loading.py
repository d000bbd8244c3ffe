"""Loading weights into GGML blocks (`pagedkv.models.quantized`): tiny GGUF files of each
family in blocks against the same file dequantized, tensor parallelism over blocks, and
the checks on bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import make_hf_model
from helpers.gguf_models import write_gguf

from pagedkv import LLM, SamplingParams
from pagedkv.models.loader import load_model
from pagedkv.models.quantized import BlockTensor
from pagedkv.runtime.linear import Linear
from pagedkv.runtime.quant.formats import FORMATS

gguf = pytest.importorskip("gguf")
PROMPTS = [[5, 17, 42, 99, 7, 250, 3, 11], [300, 2, 8]]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, ignore_eos=True)


def _logprobs(path, **kwargs) -> tuple[list[list[int]], list[float]]:
    with LLM(path, device="cpu", dtype="float32", block_size=8, num_blocks=64, **kwargs) as llm:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    chosen = [
        o.outputs[0].logprobs[i][t] for o in outs for i, t in enumerate(o.outputs[0].token_ids)
    ]
    return tokens, chosen


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q5_0", "Q5_1"])
def test_gguf_in_blocks_matches_it_dequantized(tmp_path, arch, qtype):
    path = tmp_path / "model.gguf"
    write_gguf(make_hf_model(tmp_path, arch), path, qtype)
    model = load_model(path)
    layers = [m for m in model.modules() if isinstance(m, Linear) and m.blocks is not None]
    assert len(layers) == 4 * model.config.num_layers + 1  # and the LM head, tied or not
    dense = load_model(path, quantization="none")
    qkv, dense_qkv = (
        model.model.layers[0].self_attn.qkv_proj,
        dense.model.layers[0].self_attn.qkv_proj,
    )
    torch.testing.assert_close(qkv.blocks.dequantize(), dense_qkv.weight, rtol=0, atol=0)
    want, got = _logprobs(path, quantization="none"), _logprobs(path)
    assert got[0] == want[0]
    np.testing.assert_allclose(got[1], want[1], atol=1e-4)


def test_tensor_parallel_ranks_hold_their_rows_of_blocks(tmp_path):
    path = tmp_path / "model.gguf"
    write_gguf(make_hf_model(tmp_path, "qwen2", vocab_size=509), path, "Q8_0")
    want = _logprobs(path)
    got = _logprobs(path, tensor_parallel_size=2)
    assert got[0] == want[0]
    np.testing.assert_allclose(got[1], want[1], atol=2e-3)


def test_a_split_off_block_boundaries_is_refused():
    fmt = FORMATS["Q8_0"]
    tensor = BlockTensor(fmt, np.zeros((4, 2 * fmt.block_bytes), dtype=np.uint8), 64)
    assert tensor[(slice(None), slice(32, 64))].get_shape() == [4, 32]
    assert tensor[(slice(1, 3),)].get_shape() == [2, 64]
    with pytest.raises(ValueError, match="expected input columns cut at multiples of 32"):
        tensor[(slice(None), slice(0, 48))]


def test_quantization_values_are_checked(tmp_path):
    model_dir = make_hf_model(tmp_path, "llama")
    with pytest.raises(ValueError, match="quantization: expected one of"):
        load_model(model_dir, quantization="q4_k")
    with pytest.raises(ValueError, match="quantization: expected one of"):
        LLM(model_dir, quantization="int8")
    model = load_model(model_dir, quantization="q8_0")
    assert model.model.layers[0].mlp.down_proj.blocks.format_names == ["Q8_0"]
    assert model.model.embed_tokens.weight.dtype == torch.float32  # the lookup stays dense
