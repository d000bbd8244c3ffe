"""Loading checkpoints: sharded, dtypes, tied heads, and every error naming its cause."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_hf_model
from safetensors.torch import load_file, save_file

from pagedkv.config import ModelConfig
from pagedkv.models import checkpoint_shapes, load_model, save_random_checkpoint

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
}


@pytest.fixture
def qwen2_dir(tmp_path):
    return make_hf_model(tmp_path, "qwen2")


def _rewrite(model_dir, edit) -> None:
    tensors = load_file(model_dir / "model.safetensors")
    edit(tensors)
    save_file(tensors, model_dir / "model.safetensors")


def test_weights_land_in_fused_parameters(qwen2_dir):
    model = load_model(qwen2_dir)
    tensors = load_file(qwen2_dir / "model.safetensors")
    attn = model.model.layers[1].self_attn
    q, k, v = (tensors[f"model.layers.1.self_attn.{n}_proj.bias"] for n in "qkv")
    assert torch.equal(attn.qkv_proj.bias, torch.cat([q, k, v]))
    gate, up = (tensors[f"model.layers.1.mlp.{n}_proj.weight"] for n in ("gate", "up"))
    assert torch.equal(model.model.layers[1].mlp.gate_up_proj.weight, torch.cat([gate, up]))
    assert model.lm_head is None and "lm_head.weight" not in tensors  # tied


def test_sharded_checkpoint_and_dtype_cast(tmp_path):
    import transformers

    source = make_hf_model(tmp_path, "qwen3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(source)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    sharded, single = load_model(tmp_path / "sharded", dtype="float16"), load_model(source)
    assert sharded.dtype == torch.float16
    for (name, a), (_, b) in zip(
        sharded.named_parameters(), single.named_parameters(), strict=True
    ):
        assert torch.equal(a, b.half()), name


def test_missing_weight_is_named(qwen2_dir):
    _rewrite(qwen2_dir, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.1\.self_attn\.k_proj\.bias"):
        load_model(qwen2_dir)


def test_misshapen_weight_gives_expected_and_got(qwen2_dir):
    def shrink(tensors):
        tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(127, 64)

    _rewrite(qwen2_dir, shrink)
    with pytest.raises(ValueError, match=r"up_proj.*expected shape \(128, 64\), got \(127, 64\)"):
        load_model(qwen2_dir)


def test_unexpected_weight_is_named(qwen2_dir):
    def add(tensors):
        tensors["model.layers.0.self_attn.extra.weight"] = torch.zeros(3)

    _rewrite(qwen2_dir, add)
    with pytest.raises(ValueError, match=r"unexpected weight 'model\.layers\.0\.self_attn\.extra"):
        load_model(qwen2_dir)


def test_rotary_inv_freq_is_ignored_and_tied_head_tolerated(qwen2_dir):
    def add(tensors):
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()

    _rewrite(qwen2_dir, add)
    assert load_model(qwen2_dir).lm_head is None


def test_config_errors(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({**TINY, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="expected a directory"):
        load_model(tmp_path / "nowhere")
    save_random_checkpoint(tmp_path, TINY)
    with pytest.raises(ValueError, match="dtype"):
        load_model(tmp_path, dtype="int8")


def test_save_random_checkpoint_round_trip(tmp_path):
    config = {k: v for k, v in TINY.items() if k != "architectures"} | {"model_type": "llama"}
    path = save_random_checkpoint(tmp_path / "a", config, seed=3, dtype="bfloat16")
    again = save_random_checkpoint(tmp_path / "b", config, seed=3, dtype="bfloat16")
    other = save_random_checkpoint(tmp_path / "c", config, seed=4, dtype="bfloat16")
    saved = json.loads((path / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForCausalLM"] and saved["dtype"] == "bfloat16"
    tensors = load_file(path / "model.safetensors")
    assert {n: tuple(t.shape) for n, t in tensors.items()} == checkpoint_shapes(
        ModelConfig.from_hf(saved)
    )
    weight = tensors["model.layers.0.mlp.down_proj.weight"].float()
    assert 0.015 < weight.std() < 0.025
    assert torch.equal(tensors["model.norm.weight"].float(), torch.ones(32))
    assert torch.equal(
        weight,
        load_file(again / "model.safetensors")["model.layers.0.mlp.down_proj.weight"].float(),
    )
    assert not torch.equal(
        weight,
        load_file(other / "model.safetensors")["model.layers.0.mlp.down_proj.weight"].float(),
    )
    model = load_model(path)  # "auto" = the recorded bfloat16
    assert model.dtype == torch.bfloat16
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight.float(), weight)
