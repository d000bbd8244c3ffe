"""The GGUF metadata of Gemma 3, Phi-3 and SmolLM3 as `config.json` fields, where llama.cpp
keeps them under its own keys, in tensors, or nowhere (its loader's built-in values).

Standard library only, as `pagedkv.gguf_file`, which calls `family_config`.
"""

from __future__ import annotations

import mmap
import struct
from typing import Any

# GGUF `general.architecture` -> the Hugging Face architecture it stores.
FAMILY_ARCHITECTURES = {
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
}
# llama.cpp's built-in values for Gemma 3 where the file has no key.
_GEMMA3_LOCAL_THETA = 10000.0
_GEMMA3_27B_LAYERS = 62  # the one size whose queries are scaled by hidden / heads
_F32 = 0  # GGML type id


def family_config(file: Any, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """The fields of `arch`'s config.json beyond the shared keys in `config`.

    `file` is the `GGUFFile`. Raises ValueError on a broken LongRoPE factor tensor.
    """
    if arch == "gemma3":
        return _gemma3(file.metadata, config)
    if arch == "phi3":
        return _phi3(file, config)
    return {}


def _gemma3(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    # llama.cpp scales queries by head_dim ** -0.5 but for the 27B model (hidden / heads):
    # transformers' `query_pre_attn_scalar` of each released size.
    is_27b = config["num_hidden_layers"] == _GEMMA3_27B_LAYERS
    out: dict[str, Any] = {
        "model_type": "gemma3_text",  # transformers' "gemma3" is the multimodal model
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": hidden // heads if is_27b else head_dim,
        "rope_local_base_freq": meta.get("gemma3.rope.freq_base_swa", _GEMMA3_LOCAL_THETA),
        "final_logit_softcapping": meta.get("gemma3.final_logit_softcapping"),
    }
    pattern = meta.get("gemma3.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        out["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    elif pattern:
        out["sliding_window_pattern"] = int(pattern)
    return out


def _phi3(file: Any, config: dict[str, Any]) -> dict[str, Any]:
    meta = file.metadata
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    out: dict[str, Any] = {}
    dims = meta.get("phi3.rope.dimension_count")
    if dims:
        out["partial_rotary_factor"] = dims / head_dim
    if "rope_factors_long.weight" in file.tensors:
        out["rope_scaling"] = {
            "rope_type": "longrope",
            "long_factor": read_f32(file, "rope_factors_long.weight"),
            "short_factor": read_f32(file, "rope_factors_short.weight"),
            "original_max_position_embeddings": meta.get(
                "phi3.rope.scaling.original_context_length"
            ),
            "attention_factor": meta.get("phi3.rope.scaling.attn_factor"),
            "partial_rotary_factor": out.get("partial_rotary_factor", 1.0),
        }
        out["original_max_position_embeddings"] = out["rope_scaling"][
            "original_max_position_embeddings"
        ]
    return out


def read_f32(file: Any, name: str) -> list[float]:
    """The values of F32 tensor `name` of `file` (small tensors such as rope factors).

    Raises:
        ValueError: no such tensor, or not F32.
    """
    info = file.tensors.get(name)
    if info is None or info.type_id != _F32:
        raise ValueError(f"{file.path}: expected an F32 tensor {name!r}, found {info}")
    count = 1
    for size in info.shape:
        count *= size
    with open(file.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return list(struct.unpack_from(f"<{count}f", buf, info.offset))
