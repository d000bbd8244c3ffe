"""GGUF checkpoints written by `gguf.GGUFWriter` from tiny random HF models: pagedkv loads
each supported architecture and quantization type and matches transformers' logits on the
same dequantized weights; unsupported files fail with a message naming the problem."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest
import torch
from helpers import make_hf_model

from pagedkv.config import ModelConfig
from pagedkv.engine.llm import LLM
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.models.gguf import hf_tensor_name
from pagedkv.models.loader import load_model

gguf = pytest.importorskip("gguf")
from helpers.gguf_models import write_gguf  # noqa: E402 (needs gguf)

PROMPT = [1, 17, 300, 42, 7, 99, 250, 3, 64, 128, 5, 77]  # longer than Mistral's window 8
CASES = [
    ("llama", "F32"),
    ("llama", "F16"),
    ("llama", "Q8_0"),
    ("llama", "Q4_0"),
    ("mistral", "Q8_0"),
    ("qwen2", "Q4_0"),
    ("qwen3", "F16"),
    ("gemma3", "F32"),
    ("gemma3", "Q8_0"),
    ("phi3", "Q8_0"),
    ("phi4", "F16"),
    ("smollm3", "Q8_0"),
]
# What llama.cpp's Gemma 3 loader assumes and its files therefore cannot say otherwise:
# a query scale of head_dim ** -0.5 and every sixth layer global.
GGUF_OVERRIDES = {
    "gemma3": {"query_pre_attn_scalar": 16, "num_hidden_layers": 6, "layer_types": None}
}


def hf_reference(hf_dir, state):
    """transformers' model from `hf_dir` with the GGUF file's dequantized weights."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model.eval()


@pytest.mark.parametrize(("arch", "qtype"), CASES, ids=[f"{a}-{q}" for a, q in CASES])
def test_gguf_matches_transformers(tmp_path, arch, qtype):
    hf_dir = make_hf_model(tmp_path, arch, **GGUF_OVERRIDES.get(arch, {}))
    path = tmp_path / f"{arch}-{qtype}.gguf"
    reference = hf_reference(hf_dir, write_gguf(hf_dir, path, qtype))
    assert_same_shape(ModelConfig.from_hf(path), ModelConfig.from_hf(hf_dir))
    llm = LLM(path, device="cpu", dtype="float32", block_size=4, num_blocks=32)
    params = SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=1)
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    with torch.no_grad():
        logits = reference(torch.tensor([PROMPT])).logits[0]
    expected = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(PROMPT[1:])[:, None])
    got = torch.tensor([out.prompt_logprobs[i][t] for i, t in enumerate(PROMPT) if i > 0])
    torch.testing.assert_close(got, expected[:, 0], atol=2e-4, rtol=1e-4)
    with torch.no_grad():
        hf_tokens = reference.generate(
            torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False, eos_token_id=None
        )[0, len(PROMPT) :]
    assert out.outputs[0].token_ids == hf_tokens.tolist()
    llm.engine.kv_manager.check()


@pytest.mark.parametrize("arch", ["gemma3", "phi3", "phi4", "smollm3"])
def test_converted_family_loads_in_transformers(tmp_path, arch):
    from pagedkv.cli.convert import convert_gguf

    hf_dir = make_hf_model(tmp_path, arch, **GGUF_OVERRIDES.get(arch, {}))
    path = tmp_path / f"{arch}.gguf"
    reference = hf_reference(hf_dir, write_gguf(hf_dir, path))
    import transformers

    converted_dir = convert_gguf(path, tmp_path / "converted")
    converted = transformers.AutoModelForCausalLM.from_pretrained(converted_dir).eval()
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits
        got = converted(torch.tensor([PROMPT])).logits
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ["gemma3", "smollm3"])
def test_family_gguf_carries_its_tokenizer_and_chat_template(tmp_path, arch):
    from helpers import make_tokenizer

    from pagedkv.models.loader import load_tokenizer
    from pagedkv.models.tokenizer import Tokenizer

    hf_dir = make_hf_model(tmp_path, arch, **GGUF_OVERRIDES.get(arch, {}))
    tokenizer_dir = make_tokenizer(tmp_path / "tokenizer")
    path = tmp_path / f"{arch}.gguf"
    write_gguf(hf_dir, path, tokenizer_dir=tokenizer_dir)
    expected, got = Tokenizer.from_dir(tokenizer_dir), load_tokenizer(path)
    assert got is not None and got.chat_template == expected.chat_template
    text = "A paged KV cache, héllo wörld 🙂 <|im_end|>"
    assert got.encode(text) == expected.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    llm = LLM(path, device="cpu", dtype="float32", block_size=4, num_blocks=32)
    (out,) = llm.chat(messages, SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    rendered = expected.apply_chat_template(messages, add_generation_prompt=True)
    assert out.prompt_token_ids == expected.encode(rendered, add_special_tokens=False)


def assert_same_shape(got: ModelConfig, expected: ModelConfig) -> None:
    """The GGUF file's config is the HF one's, but for what travels otherwise: llama3 rope
    scaling as rope_freqs divisors, and LongRoPE's factors as float32 tensors."""
    if expected.rope_scaling and expected.rope_scaling["rope_type"] == "llama3":
        expected = replace(expected, rope_scaling=None)
    if got.rope_scaling and got.rope_scaling["rope_type"] == "longrope":
        assert expected.rope_scaling is not None
        for key in ("short_factor", "long_factor", "original_max_position_embeddings"):
            assert got.rope_scaling[key] == pytest.approx(expected.rope_scaling[key], rel=1e-6)
        got = replace(got, rope_scaling=expected.rope_scaling)
    if expected.rope_scaling and expected.rope_scaling["rope_type"] == "linear":
        assert got.rope_scaling is not None
        assert got.rope_scaling["factor"] == expected.rope_scaling["factor"]
        got = replace(got, rope_scaling=expected.rope_scaling)
    assert got == expected


def test_hf_tensor_names_follow_gguf_package():
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, 2)
    for hf in (
        "model.embed_tokens",
        "model.norm",
        "lm_head",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.self_attn.k_norm",
        "model.layers.0.self_attn.o_proj",
        "model.layers.0.mlp.down_proj",
        "model.layers.0.post_attention_layernorm",
    ):
        assert hf_tensor_name(f"{name_map.get_name(hf)}.weight") == f"{hf}.weight"


def _write_minimal(path, arch="llama", tensor_type=None):
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(32)
    writer.add_head_count(2)
    if tensor_type is None:
        writer.add_tensor("token_embd.weight", torch.zeros(8, 32).numpy())
    else:
        block, size = gguf.GGML_QUANT_SIZES[tensor_type]
        raw = torch.zeros(8, 32 // block * size, dtype=torch.uint8).numpy()
        writer.add_tensor("token_embd.weight", raw, raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_architecture_is_named(tmp_path):
    path = _write_minimal(tmp_path / "m.gguf", arch="gpt2")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        ModelConfig.from_hf(path)


def test_unsupported_quantization_is_named(tmp_path):
    path = _write_minimal(tmp_path / "m.gguf", tensor_type=gguf.GGMLQuantizationType.Q8_1)
    with pytest.raises(ValueError, match="unsupported quantization Q8_1"):
        load_model(path)


def test_missing_gguf_package_says_how_to_install(tmp_path, monkeypatch):
    path = _write_minimal(tmp_path / "m.gguf")
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(ImportError, match=r'pip install "pagedkv\[gguf\]"'):
        load_model(path)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_text(json.dumps({"not": "gguf"}))
    with pytest.raises(ValueError, match="expected a GGUF file"):
        ModelConfig.from_hf(path)
