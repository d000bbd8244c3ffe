"""Planner arithmetic against hand-computed values and published parameter counts."""

from __future__ import annotations

import json

import pytest

from pagedkv.config import ModelConfig
from pagedkv.sim.planner import (
    ACTIVATION_MARGIN,
    builtin_models,
    format_plan,
    kv_bytes_per_token,
    kv_heads_per_gpu,
    load_model,
    plan_memory,
)

GIB = 2**30

# Parameter counts published on each model's Hugging Face page (safetensors metadata).
PUBLISHED_PARAMETERS = {
    "llama-2-7b": 6.74e9,
    "llama-2-13b": 13.0e9,
    "llama-2-70b": 69.0e9,
    "llama-3.1-8b": 8.03e9,
    "llama-3.1-70b": 70.6e9,
    "llama-3.1-405b": 406e9,
    "mistral-7b": 7.24e9,
    "qwen2.5-7b": 7.61e9,
    "qwen2.5-72b": 72.7e9,
    "qwen3-8b": 8.19e9,
    "qwen3-32b": 32.8e9,
    "gemma-3-270m": 268e6,
    "gemma-3-1b": 1.00e9,
    # The language model of the 4.30B checkpoint (less its 0.42B SigLIP vision tower).
    "gemma-3-4b": 3.88e9,
    "phi-3-mini": 3.82e9,
    "phi-4-mini": 3.84e9,
    "smollm3-3b": 3.08e9,
}


def test_builtin_names_are_the_published_list():
    assert builtin_models() == sorted(PUBLISHED_PARAMETERS)


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_parameter_count_matches_published_size(name):
    params = load_model(name).num_parameters()
    assert abs(params / PUBLISHED_PARAMETERS[name] - 1) < 0.01, params


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        # 2 (K, V) x layers x kv_heads x head_dim x 2 bytes
        ("llama-2-70b", 2 * 80 * 8 * 128 * 2),  # GQA 64 -> 8 heads: 327,680 B
        ("llama-2-7b", 2 * 32 * 32 * 128 * 2),  # no GQA: 524,288 B
        ("llama-2-13b", 2 * 40 * 40 * 128 * 2),  # no GQA: 819,200 B
        ("llama-3.1-8b", 2 * 32 * 8 * 128 * 2),  # 131,072 B
        ("qwen2.5-7b", 2 * 28 * 4 * 128 * 2),  # 7 query heads per KV head: 57,344 B
        ("qwen3-32b", 2 * 64 * 8 * 128 * 2),  # head_dim 128, not 5120 / 64 = 80: 262,144 B
        ("llama-3.1-405b", 2 * 126 * 8 * 128 * 2),  # 516,096 B
        ("gemma-3-1b", 2 * 26 * 1 * 256 * 2),  # one KV head of 256: 26,624 B
        ("gemma-3-4b", 2 * 34 * 4 * 256 * 2),  # from text_config: 139,264 B
        ("phi-4-mini", 2 * 32 * 8 * 128 * 2),  # 131,072 B
    ],
)
def test_kv_bytes_per_token_by_hand(name, expected):
    model = load_model(name)
    assert kv_bytes_per_token(model, "fp16") == expected
    assert model.kv_bytes_per_token(2) == expected
    assert kv_bytes_per_token(model, "fp8") * 2 == expected


def test_llama_2_70b_is_327680_bytes_per_token():
    plan = plan_memory(load_model("llama-2-70b"), 80 * GIB, dtype="fp16", context=4096)
    assert plan.kv_bytes_per_token == 327_680
    assert plan.kv_bytes_per_block == 327_680 * 16
    # The long-context workload's 128K-token request: 40 GiB with GQA (not 32 GB).
    assert plan.kv_bytes_per_token * 131_072 == 40 * GIB


def test_qwen3_32b_uses_config_head_dim():
    model = load_model("qwen3-32b")
    assert model.head_dim == 128 != model.hidden_size // model.num_heads


def test_plan_llama_3_1_8b_by_hand():
    plan = plan_memory(load_model("llama-3.1-8b"), 80 * GIB, context=131_072, dtype="bf16")
    assert plan.weight_bytes == 8_030_261_248 * 2 == 16_060_522_496
    assert ACTIVATION_MARGIN == plan.activation_margin == 0.10
    assert plan.activation_margin_bytes == 8 * GIB == 8_589_934_592
    assert plan.kv_budget_bytes == 85_899_345_920 - 16_060_522_496 - 8_589_934_592
    assert plan.kv_budget_bytes == 61_248_888_832
    assert plan.kv_bytes_per_block == 131_072 * 16 == 2_097_152
    assert plan.num_blocks == 29_205  # 61,248,888,832 / 2,097,152 = 29,205.99
    assert plan.max_kv_tokens == 29_205 * 16
    assert plan.blocks_per_sequence == 8192
    assert plan.max_sequences_at_context == 3  # 29,205 // 8,192
    assert plan.weights_fit and plan.full_context_sequence_fits
    assert plan.max_position_embeddings == 131_072 and not plan.context_exceeds_model
    assert not plan.warnings


def test_no_margin_gives_the_whole_remainder_to_the_kv_cache():
    plan = plan_memory(load_model("llama-3.1-8b"), 80 * GIB, context=131_072, activation_margin=0)
    assert plan.activation_margin_bytes == 0
    assert plan.kv_budget_bytes == 85_899_345_920 - 16_060_522_496
    assert plan.num_blocks == 33_301 and plan.max_sequences_at_context == 4
    with pytest.raises(ValueError, match=r"activation_margin: expected in \[0, 1\), got 1"):
        plan_memory(load_model("llama-3.1-8b"), 80 * GIB, activation_margin=1)


def test_weights_fit_but_no_full_context_sequence_beyond_the_model():
    # llama-2-70b on two 80 GiB GPUs: 64 GiB of weights each, 7.8 GiB of KV left, while a
    # 128K-token sequence needs 20 GiB; and the model knows only 4,096 positions.
    plan = plan_memory(load_model("llama-2-70b"), 80 * GIB, context=131_072, tp=2)
    assert plan.weights_fit and not plan.full_context_sequence_fits
    assert plan.max_sequences_at_context == 0 < plan.num_blocks
    assert plan.context_exceeds_model and plan.max_position_embeddings == 4096
    table = format_plan(plan)
    first, *_ = table.splitlines()
    assert first.startswith("warning: context 131,072 exceeds") and "(4,096)" in first
    assert "weights fit                   yes" in table
    assert "a full-context sequence fits  NO: one needs 20.00 GiB of KV" in table
    assert "activation margin             8.00 GiB (10% of memory" in table
    assert "fits: yes" not in table and "\nfits" not in table
    within = plan_memory(load_model("llama-2-70b"), 80 * GIB, context=4096, tp=2)
    assert within.full_context_sequence_fits and not within.warnings


def test_fp8_kv_halves_bytes_and_doubles_tokens():
    model = load_model("llama-3.1-8b")
    bf16 = plan_memory(model, 40 * GIB, context=8192)
    fp8 = plan_memory(model, 40 * GIB, context=8192, kv_dtype="fp8")
    assert fp8.kv_bytes_per_token * 2 == bf16.kv_bytes_per_token
    assert fp8.weight_bytes == bf16.weight_bytes
    assert fp8.activation_margin_bytes == bf16.activation_margin_bytes == 4 * GIB
    assert fp8.kv_budget_bytes == bf16.kv_budget_bytes
    assert fp8.num_blocks in (2 * bf16.num_blocks, 2 * bf16.num_blocks + 1)


def test_tensor_parallel_splits_weights_and_kv_heads():
    model = load_model("llama-3.1-70b")
    plan = plan_memory(model, 80 * GIB, tp=4)
    assert plan.weight_bytes == 70_553_706_496 * 2 // 4
    assert plan.kv_heads_per_gpu == 2
    assert plan.kv_bytes_per_token == 2 * 80 * 2 * 128 * 2
    assert not plan.kv_heads_replicated and not plan.notes


def test_tensor_parallel_beyond_kv_heads_replicates_them():
    plan = plan_memory(load_model("llama-3.1-405b"), 80 * GIB, tp=16)
    assert plan.kv_heads_per_gpu == 1
    assert plan.kv_bytes_per_token == 2 * 126 * 1 * 128 * 2
    assert plan.kv_heads_replicated
    assert any("replicated 2x" in note for note in plan.notes)


def test_impossible_tp_is_rejected():
    model = load_model("llama-2-70b")
    with pytest.raises(ValueError, match="tp"):
        kv_heads_per_gpu(model, 3)
    with pytest.raises(ValueError, match="tp"):
        kv_heads_per_gpu(model, 0)


def test_weights_that_do_not_fit():
    plan = plan_memory(load_model("llama-2-70b"), 80 * GIB, dtype="fp16")
    assert plan.weight_bytes == 68_976_648_192 * 2 > 80 * GIB
    assert not plan.weights_fit and not plan.full_context_sequence_fits
    assert plan.kv_budget_bytes == plan.max_kv_tokens == plan.max_sequences_at_context == 0


def test_default_context_is_model_maximum_and_mistral_window_noted():
    plan = plan_memory(load_model("mistral-7b"), 80 * GIB)
    assert plan.context == 32_768
    assert any("sliding window 4096" in note for note in plan.notes)


def test_load_model_from_dir_and_file(tmp_path):
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    for source in (tmp_path, tmp_path / "config.json"):
        model = load_model(source)
        assert isinstance(model, ModelConfig)
        assert kv_bytes_per_token(model, "fp32") == 2 * 2 * 2 * 64 * 4


def test_unknown_model_and_dtype():
    with pytest.raises(ValueError, match="unknown model 'llama-9'"):
        load_model("llama-9")
    with pytest.raises(ValueError, match="expected a dtype"):
        plan_memory(load_model("qwen3-8b"), GIB, dtype="fp7")


@pytest.mark.parametrize(
    ("name", "num_sliding", "rotary_dim", "num_unrotated"),
    [
        ("gemma-3-270m", 15, 256, 0),  # every sixth of 18 layers global
        ("gemma-3-1b", 22, 256, 0),
        ("gemma-3-4b", 29, 256, 0),
        ("phi-3-mini", 32, 96, 0),  # a 2,047-token window on every layer
        ("phi-4-mini", 32, 96, 0),  # 0.75 of each 128-dimension head rotated
        ("smollm3-3b", 0, 128, 9),  # every fourth of 36 layers without rotary
    ],
)
def test_new_family_layer_types(name, num_sliding, rotary_dim, num_unrotated):
    model = load_model(name)
    assert sum(window is not None for window in model.sliding_windows) == num_sliding
    assert model.rotary_dim == rotary_dim
    assert sum(not rotated for rotated in model.rope_layers) == num_unrotated


def test_sliding_layers_are_planned_per_group(tmp_path):
    layer_types = (["sliding_attention"] * 5 + ["full_attention"]) * 2
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 12,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
        "max_position_embeddings": 32768,
        "use_sliding_window": True,
        "sliding_window": 512,
        "layer_types": layer_types,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = load_model(tmp_path)
    plan = plan_memory(model, GIB, context=32768, dtype="fp32", block_size=16)
    # Groups of 2 layers: five sliding ones (at most 512 / 16 + 1 blocks) and one full one.
    assert plan.kv_groups == ((512, 2, 33),) * 5 + ((None, 2, 2048),)
    assert plan.kv_bytes_per_block == 2 * 2 * 2 * 64 * 4 * 16
    assert plan.blocks_per_sequence == 5 * 33 + 2048
    assert plan.max_sequences_at_context == plan.num_blocks // (5 * 33 + 2048)
    # One block table for every layer would keep 6 x 2048 blocks of this size per sequence.
    assert plan.blocks_per_sequence < 0.2 * 6 * 2048
    assert "KV group 5" in format_plan(plan) and "window 512, 2 layers" in format_plan(plan)
