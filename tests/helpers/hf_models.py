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
    """The transformers config object for `arch` ("llama", "qwen2", "qwen3", "mistral")."""
    import transformers

    classes = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
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
            "mistral" (sliding window 8).
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
