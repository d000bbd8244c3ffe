"""Gemma 3, Phi-3 and SmolLM3 config.json files of either transformers era normalize to the
same `ModelConfig`; what pagedkv cannot run is refused with the field named."""

from __future__ import annotations

import pytest
from helpers import hf_config

from pagedkv.config import ModelConfig
from pagedkv.models.llama import fused_decode_applies, rotary_kinds

# A Gemma 3 config.json as the releases on the hub spell it (transformers 4.5x).
GEMMA3_V4 = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 12,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "vocab_size": 512,
    "query_pre_attn_scalar": 32,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "sliding_window": 16,
    "sliding_window_pattern": 6,
}


def test_gemma3_of_both_transformers_eras_agree():
    old = ModelConfig.from_hf(GEMMA3_V4)
    new = ModelConfig.from_hf(
        hf_config(
            "gemma3",
            **{k: v for k, v in GEMMA3_V4.items() if k not in ("architectures", "model_type")},
            layer_types=None,
            rope_parameters=None,
        ).to_dict()
    )
    assert old.sliding_windows == (16,) * 5 + (None,) + (16,) * 5 + (None,)
    assert (old.rope_theta, old.rope_local_theta) == (1e6, 1e4)
    assert old.rope_scaling is not None and old.rope_scaling["factor"] == 8.0
    assert old.attention_scale == pytest.approx(32**-0.5)
    assert (old.norm_offset, old.sandwich_norm, old.hidden_act) == (1.0, True, "gelu_tanh")
    for field in ("sliding_windows", "rope_theta", "rope_local_theta", "attention_scale"):
        assert getattr(new, field) == getattr(old, field), field
    assert new.rope_scaling is not None and new.rope_scaling["factor"] == 8.0
    # Two tables: the sliding layers' plain one, the global layers' scaled one.
    kinds, indices = rotary_kinds(old)
    assert kinds == [(1e4, None), (1e6, old.rope_scaling)]
    assert indices == [0] * 5 + [1] + [0] * 5 + [1]
    assert not fused_decode_applies(old)


def test_multimodal_gemma3_reads_its_text_config():
    config = ModelConfig.from_hf(
        {
            "architectures": ["Gemma3ForConditionalGeneration"],
            "model_type": "gemma3",
            "text_config": {k: v for k, v in GEMMA3_V4.items() if k != "architectures"},
            "vision_config": {"hidden_size": 1152},
        }
    )
    assert config.architecture == "Gemma3ForConditionalGeneration"
    assert config.num_layers == 12 and config.sandwich_norm


def test_phi3_su_rope_and_top_level_original_length():
    factors = [1.0] * 8
    config = ModelConfig.from_hf(
        {
            "architectures": ["Phi3ForCausalLM"],
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "vocab_size": 512,
            "max_position_embeddings": 1024,
            "original_max_position_embeddings": 256,
            "rope_scaling": {"type": "su", "short_factor": factors, "long_factor": factors},
            "sliding_window": 100,
        }
    )
    assert config.rope_scaling is not None
    assert config.rope_scaling["rope_type"] == "longrope"
    assert config.rope_scaling["original_max_position_embeddings"] == 256
    assert config.sliding_windows == (100, 100)  # every layer, as transformers' Phi-3
    assert fused_decode_applies(config)


def test_smollm3_rope_layers_from_list_or_interval():
    base = {k: v for k, v in GEMMA3_V4.items() if k.startswith(("hidden", "inter", "num", "voc"))}
    smol = {**base, "architectures": ["SmolLM3ForCausalLM"], "num_hidden_layers": 6}
    by_interval = ModelConfig.from_hf({**smol, "no_rope_layer_interval": 3})
    assert by_interval.rope_layers == (True, True, False, True, True, False)
    by_list = ModelConfig.from_hf({**smol, "no_rope_layers": [0, 1, 1, 1, 1, 0]})
    assert by_list.rope_layers == (False, True, True, True, True, False)
    assert rotary_kinds(by_list)[1] == [None, 0, 0, 0, 0, None]
    with pytest.raises(ValueError, match="no_rope_layers: expected 6 entries, got 2"):
        ModelConfig.from_hf({**smol, "no_rope_layers": [1, 0]})


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping: expected null"),
        ({"hidden_activation": "relu"}, "hidden_act: expected one of"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "expected rope_type in"),
    ],
)
def test_unsupported_options_are_named(override, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**GEMMA3_V4, **override})


def test_longrope_factor_count_is_checked():
    from pagedkv.models.layers import create_rotary

    scaling = {
        "rope_type": "longrope",
        "short_factor": [1.0] * 3,
        "long_factor": [1.0] * 8,
        "original_max_position_embeddings": 64,
    }
    with pytest.raises(ValueError, match="expected 8 longrope factors, got 3"):
        create_rotary(16, 10000.0, scaling, 1024)
