"""What sets each model family apart, read once from its `config.json` into `ModelConfig`
fields: the rotary options and the layer options of Gemma 3, Phi-3 and SmolLM3.

Standard library only (the planner reads configs without torch). One decoder runs every
family (`pagedkv.models.decoder`); these fields switch its options:

    family     norm (1 + w)  sandwich norms  MLP gate   scale              embeddings x
    Llama ...  no            no              SiLU       head_dim ** -0.5   1
    Gemma 3    yes           yes             tanh GELU  query_pre_attn_scalar ** -0.5  sqrt(hidden)
    Phi-3      no            no              SiLU       head_dim ** -0.5   1
    SmolLM3    no            no              SiLU       head_dim ** -0.5   1

Rotary: Gemma 3's sliding layers rotate with their own base (`rope_local_theta`, never
scaled), its global ones with `rope_theta` and the scaling; Phi-3 rotates the first
`partial_rotary_factor` of each head with LongRoPE; SmolLM3 leaves every
`no_rope_layer_interval`-th layer unrotated (`rope_layers`).
"""

from __future__ import annotations

import math
from typing import Any

HIDDEN_ACTS = {"silu", "gelu_tanh"}
# config.json's activation names -> the decoder's.
_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
}
ROPE_TYPES = ("default", "linear", "llama3", "longrope")
# Gemma 3's bases when config.json names none (transformers' defaults).
_GEMMA3_THETA, _GEMMA3_LOCAL_THETA = 1_000_000.0, 10_000.0


def is_gemma3(architecture: str) -> bool:
    return architecture.startswith("Gemma3")


def _activation(name: str) -> str:
    if name not in _ACTIVATIONS:
        raise ValueError(f"hidden_act: expected one of {sorted(_ACTIVATIONS)}, got {name!r}")
    return _ACTIVATIONS[name]


def rope_options(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    """`rope_theta`, `rope_scaling`, `rope_local_theta` and `partial_rotary_factor`.

    transformers >= 5 folds rope_theta and rope_scaling into `rope_parameters`, per layer
    type for Gemma 3 (`full_attention`, `sliding_attention`); older configs keep them at
    the top level (Gemma 3's local base as `rope_local_base_freq`).

    Raises:
        ValueError: an unsupported rope type, or a scaled sliding-layer rotary.
    """
    params = dict(config.get("rope_parameters") or {})
    gemma = is_gemma3(architecture)
    local_theta = config.get("rope_local_base_freq", _GEMMA3_LOCAL_THETA) if gemma else None
    if "full_attention" in params or "sliding_attention" in params:
        local = params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(
                f"rope_parameters.sliding_attention: expected rope_type 'default', "
                f"got {local.get('rope_type')!r}"
            )
        local_theta = local.get("rope_theta", local_theta)
        params = dict(params.get("full_attention") or {})
    elif not params:
        params = dict(config.get("rope_scaling") or {})
    default_theta = _GEMMA3_THETA if gemma else 10000.0
    theta = params.get("rope_theta") or config.get("rope_theta") or default_theta
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = "longrope" if rope_type == "su" else rope_type  # Phi-3's first name for it
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_scaling: expected rope_type in {ROPE_TYPES}, got {rope_type!r}")
    scaling = None if rope_type == "default" else {**params, "rope_type": rope_type}
    if scaling is not None and rope_type == "longrope":
        scaling.setdefault(
            "original_max_position_embeddings", config.get("original_max_position_embeddings")
        )
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    return {
        "rope_theta": float(theta),
        "rope_scaling": scaling,
        "rope_local_theta": None if local_theta is None else float(local_theta),
        "partial_rotary_factor": float(partial),
    }


def family_options(config: dict[str, Any], architecture: str, num_layers: int) -> dict[str, Any]:
    """The layer options of `architecture` (see the module table).

    Raises:
        ValueError: an unknown activation, or attention logit softcapping (no kernel has it).
    """
    if is_gemma3(architecture):
        if config.get("attn_logit_softcapping") is not None:
            raise ValueError(
                f"attn_logit_softcapping: expected null (Gemma 3), "
                f"got {config['attn_logit_softcapping']!r}"
            )
        # transformers caps the logits in Gemma3ForCausalLM only, not in the multimodal model.
        cap = config.get("final_logit_softcapping")
        if architecture != "Gemma3ForCausalLM":
            cap = None
        return {
            "norm_offset": 1.0,
            "sandwich_norm": True,
            "hidden_act": _activation(config.get("hidden_activation") or "gelu_pytorch_tanh"),
            "attention_scale": float(config.get("query_pre_attn_scalar", 256)) ** -0.5,
            "embedding_scale": math.sqrt(int(config["hidden_size"])),
            "final_logit_softcapping": None if cap is None else float(cap),
        }
    options: dict[str, Any] = {"hidden_act": _activation(config.get("hidden_act") or "silu")}
    if architecture == "SmolLM3ForCausalLM":
        options["rope_layers"] = smollm3_rope_layers(config, num_layers)
    return options


def smollm3_rope_layers(config: dict[str, Any], num_layers: int) -> tuple[bool, ...]:
    """Per layer, whether it is rotated: `no_rope_layers` (1: rotated), or every
    `no_rope_layer_interval`-th layer unrotated (transformers' default, interval 4)."""
    flags = config.get("no_rope_layers")
    if flags is None:
        interval = int(config.get("no_rope_layer_interval") or 4)
        return tuple((i + 1) % interval != 0 for i in range(num_layers))
    if len(flags) < num_layers:
        raise ValueError(f"no_rope_layers: expected {num_layers} entries, got {len(flags)}")
    return tuple(bool(flag) for flag in flags[:num_layers])


def layer_types(
    config: dict[str, Any], num_layers: int, default_pattern: int | None = None
) -> list[str] | None:
    """config.json's `layer_types`, or Gemma 3's from `sliding_window_pattern` (every
    pattern-th layer global, the others sliding; `default_pattern` where it is absent)."""
    if config.get("layer_types"):
        return list(config["layer_types"])
    pattern = config.get("sliding_window_pattern", default_pattern)
    if not pattern:
        return None
    return [
        "full_attention" if (i + 1) % int(pattern) == 0 else "sliding_attention"
        for i in range(num_layers)
    ]
