"""Tiny random Hugging Face models of each supported architecture, saved to a directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# Per architecture: the config kwargs that exercise its special features at a tiny size.
ARCHS: dict[str, dict[str, Any]] = {
    # llama3 rope scaling with a short original context, so all three frequency bands
    # (kept, interpolated, divided) occur at head_dim 16.
    "llama": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "rope_theta": 10000.0,
    },
    # q/k/v bias, tied embeddings.
    "qwen2": {"tie_word_embeddings": True},
    # q/k RMSNorm; head_dim 32 while hidden / heads = 16.
    "qwen3": {"head_dim": 32, "tie_word_embeddings": False},
    # sliding window shorter than the test prompts.
    "mistral": {"sliding_window": 8},
    # Gemma 3: sliding layers (window 8) around a global one, two rotary bases and linear
    # scaling on the global layer, a query scale other than head_dim's, a logit cap.
    "gemma3": {
        "num_hidden_layers": 3,
        "head_dim": 16,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "sliding_window": 8,
        "query_pre_attn_scalar": 24,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "final_logit_softcapping": 5.0,
    },
    # Phi-3: fused projections, LongRoPE (the short factors below 512 tokens, and an
    # attention factor from max / original positions).
    "phi3": {
        "pad_token_id": 0,
        "original_max_position_embeddings": 512,
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.25 * i for i in range(8)],
            "long_factor": [2.0 + 1.5 * i for i in range(8)],
        },
    },
    # Phi-4-mini: three quarters of each head rotated (LongRoPE), tied embeddings.
    "phi4": {
        "pad_token_id": 0,
        "original_max_position_embeddings": 512,
        "partial_rotary_factor": 0.75,
        "tie_word_embeddings": True,
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            "short_factor": [1.0 + 0.5 * i for i in range(6)],
            "long_factor": [3.0 + 2.0 * i for i in range(6)],
        },
    },
    # SmolLM3: every 4th layer without rotary.
    "smollm3": {"num_hidden_layers": 4, "no_rope_layer_interval": 4, "pad_token_id": 0},
}
_BASE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def hf_config(arch: str, **overrides: Any) -> Any:
    """The transformers config object for `arch` (a key of `ARCHS`)."""
    import transformers

    classes = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
        "gemma3": transformers.Gemma3TextConfig,
        "phi3": transformers.Phi3Config,
        "phi4": transformers.Phi3Config,
        "smollm3": transformers.SmolLM3Config,
    }
    if arch not in classes:
        raise ValueError(f"arch: expected one of {sorted(classes)}, got {arch!r}")
    return classes[arch](**{**_BASE, **ARCHS[arch], **overrides})


def make_hf_model(
    tmp_path: str | Path,
    arch: str,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> Path:
    """Build a tiny random HF model of `arch`, save it with `save_pretrained`, return its dir.

    Weights come from HF's own init under `seed`; norm weights and biases (HF inits them to
    1 and 0) are then perturbed so that a loader mixing them up cannot pass a logits test.
    The global torch RNG state is restored afterwards.

    Args:
        tmp_path: parent directory; the model goes to `tmp_path / f"{arch}-{seed}"`.
        arch: "llama" (llama3 rope), "qwen2" (bias, tied), "qwen3" (qk-norm, head_dim 32),
            "mistral" (sliding window 8), or a newer family of `ARCHS` ("gemma3", "phi3",
            "phi4", "smollm3").
        seed: weight seed.
        dtype: dtype of the saved weights (recorded in config.json).
        **overrides: config kwargs, e.g. num_hidden_layers=4 or initializer_range=0.1.

    Returns:
        The model directory (config.json, model.safetensors, generation_config.json).
    """
    import transformers

    config = hf_config(arch, **overrides)
    model_dir = Path(tmp_path) / f"{arch}-{seed}"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
        generator = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.dim() == 1:
                    center = 1.0 if name.endswith("norm.weight") else 0.0
                    noise = torch.randn(param.shape, generator=generator)
                    param.copy_(center + 0.1 * noise)
    model.to(dtype).save_pretrained(model_dir)
    return model_dir
