"""Matmuls through oneDNN: packed (blocked) bfloat16 weights give the same logits bit for
bit; plain float32 ones the same logits up to rounding; both the same tokens."""

from __future__ import annotations

import pytest
import torch
from helpers import make_hf_model

from pagedkv import LLM, SamplingParams
from pagedkv.models import load_model
from pagedkv.models.layers import can_pack_linear, linear, pack_linear_

needs_bf16 = pytest.mark.skipif(
    not can_pack_linear(torch.bfloat16, torch.device("cpu")),
    reason="no oneDNN bfloat16 on this CPU",
)
needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 300, 12], [8, 9], list(range(20, 60))]


@needs_bf16
def test_a_biased_linear_stays_plain():
    layer = torch.nn.Linear(96, 80, bias=True, dtype=torch.bfloat16)
    pack_linear_(layer)
    assert not layer.weight.is_mkldnn


@needs_bf16
@pytest.mark.parametrize("rows", [1, 3, 64, 512])
def test_packed_linear_gives_the_same_bits(rows):
    generator = torch.Generator().manual_seed(rows)
    layer = torch.nn.Linear(96, 80, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(80, 96, generator=generator))
    x = torch.randn(rows, 96, generator=generator).to(torch.bfloat16)
    expected = torch.nn.functional.linear(x, layer.weight)
    pack_linear_(layer)
    assert layer.weight.is_mkldnn
    assert "weight" not in dict(layer.named_parameters())
    assert torch.equal(linear(x, layer), expected)


@needs_onednn
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_float32_weights_stay_in_place_and_the_logits_move_only_by_rounding(tmp_path, arch):
    model_dir = make_hf_model(tmp_path, arch)
    plain = load_model(model_dir, dtype=torch.float32, device="cpu")
    marked = load_model(model_dir, dtype=torch.float32, device="cpu")
    weights = {name: t.data_ptr() for name, t in marked.named_parameters()}
    assert marked.pack_weights()
    # No copy: every weight is the tensor it was, plain.
    assert {name: t.data_ptr() for name, t in marked.named_parameters()} == weights
    assert not any(t.is_mkldnn for t in [*marked.parameters(), *marked.buffers()])
    layer = marked.model.layers[0].mlp.down_proj
    assert layer.__dict__.get("onednn")
    x = torch.randn(7, layer.in_features)
    torch.testing.assert_close(linear(x, layer), torch.nn.functional.linear(x, layer.weight))
    hidden = torch.randn(5, plain.config.hidden_size)
    torch.testing.assert_close(marked.compute_logits(hidden), plain.compute_logits(hidden))


@needs_bf16
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # untied LM head; tied, with q/k/v bias
def test_pack_weights_keeps_the_logits(tmp_path, arch):
    model_dir = make_hf_model(tmp_path, arch, dtype=torch.bfloat16)
    plain = load_model(model_dir, dtype=torch.bfloat16, device="cpu")
    packed = load_model(model_dir, dtype=torch.bfloat16, device="cpu")
    assert packed.pack_weights()
    hidden = torch.randn(5, plain.config.hidden_size).to(torch.bfloat16)
    assert torch.equal(packed.compute_logits(hidden), plain.compute_logits(hidden))
    # The tied embedding stays a plain table for lookups.
    assert not packed.model.embed_tokens.weight.is_mkldnn


@pytest.mark.parametrize(
    "dtype",
    [pytest.param("bfloat16", marks=needs_bf16), pytest.param("float32", marks=needs_onednn)],
)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_tokens_match_the_plain_path(tmp_path, arch, dtype):
    model_dir = make_hf_model(tmp_path, arch, dtype=getattr(torch, dtype))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    tokens = {}
    for pack in (False, True):
        llm = LLM(str(model_dir), dtype=dtype, device="cpu", num_blocks=64,
                  block_size=8, pack_weights=pack)  # fmt: skip
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tokens[pack] = [o.outputs[0].token_ids for o in outputs]
    assert tokens[True] == tokens[False]
