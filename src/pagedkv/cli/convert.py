"""`pagedkv convert FILE.gguf OUT_DIR`: a GGUF checkpoint as a Hugging Face model directory.

Writes config.json, model.safetensors (the dequantized weights in Hugging Face's layout and
order), tokenizer.json and tokenizer_config.json (special tokens and the chat template):
a directory that transformers' `from_pretrained` and pagedkv's `LLM` both load, giving the
same tokens as the GGUF file itself.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pagedkv.config import ModelConfig


def _llama3_rope_scaling(model: ModelConfig, divisors: Any) -> dict[str, Any]:
    """The `rope_scaling` dict whose inverse frequencies equal the file's divided ones.

    Raises:
        ValueError: no llama3 parameters reproduce the divisors.
    """
    import torch

    from pagedkv.models.layers import compute_inv_freq

    plain = compute_inv_freq(model.head_dim, model.rope_theta)
    # llama.cpp keeps llama3 rope scaling only as per-frequency divisors (`rope_freqs`); these
    # are the parameters of every Llama 3.x release, checked against the divisors below.
    scaling = {
        "rope_type": "llama3",
        "factor": float(divisors.max()),
        "original_max_position_embeddings": 8192,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    }
    scaled = compute_inv_freq(model.head_dim, model.rope_theta, scaling)
    if not torch.allclose(scaled, plain / divisors, rtol=1e-4):
        raise ValueError(
            "rope_freqs: expected llama3 rope scaling (low/high frequency factors 1 and 4, "
            "original context 8192), got divisors it does not reproduce"
        )
    return scaling


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, *, dtype: str = "auto") -> Path:
    """Write the Hugging Face directory of a GGUF checkpoint; returns `out_dir` as a Path.

    Args:
        gguf_path: a `.gguf` file of a supported architecture (Llama, Mistral, Qwen2, Qwen3,
            Gemma 3, Phi-3, SmolLM3).
        out_dir: created if needed; existing files of the same names are replaced.
        dtype: of the saved weights: "auto" (float32 for a quantized file, which holds every
            dequantized value exactly; else the file's), "float32", "bfloat16", "float16".

    Raises:
        ValueError: an unsupported architecture, quantization or tokenizer, or a tensor
            missing or misshapen for the architecture.
        ImportError: the `gguf` package or transformers is missing.
    """
    from safetensors.torch import save_file

    from pagedkv.gguf_file import hf_config_from_gguf, read_gguf
    from pagedkv.models.checkpoint_layout import canonical_tensors
    from pagedkv.models.gguf import iter_gguf_tensors, rope_divisors
    from pagedkv.models.gguf_tokenizer import load_gguf_tokenizer
    from pagedkv.models.loader import checked_tensors, resolve_dtype

    file = read_gguf(gguf_path)
    config = hf_config_from_gguf(file)
    model = ModelConfig.from_hf(config)
    torch_dtype = resolve_dtype(dtype, model)
    divisors = rope_divisors(file)
    if divisors is not None:
        config["rope_scaling"] = _llama3_rope_scaling(model, divisors)
    if config["architectures"] == ["MistralForCausalLM"]:
        # transformers' MistralConfig defaults to a 4096-token window; say "none" explicitly.
        config.setdefault("sliding_window", None)
    config["dtype"] = config["torch_dtype"] = str(torch_dtype).removeprefix("torch.")
    tensors = {
        name: tensor.to(torch_dtype).contiguous() for name, tensor in iter_gguf_tensors(file, model)
    }
    # Checked in the loader's layout, written in the family's own (Phi-3's fused projections).
    for _ in checked_tensors(canonical_tensors(tensors.items(), model), model):
        pass
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer = load_gguf_tokenizer(file)
    if tokenizer is not None:
        _write_tokenizer(tokenizer, out, model.max_position_embeddings)
    return out


def _write_tokenizer(tokenizer: Any, out: Path, max_length: int) -> None:
    tokenizer.backend.save(str(out / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }
    if tokenizer.chat_template is not None:
        config["chat_template"] = tokenizer.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def register(subparsers: Any) -> None:
    """Add `convert` to the `pagedkv` command."""
    parser = subparsers.add_parser(
        "convert",
        help="write a GGUF checkpoint as a Hugging Face model directory",
        description="Dequantize a .gguf file (Llama, Mistral, Qwen2, Qwen3, Gemma 3, Phi-3, "
        "SmolLM3) and write "
        "config.json, model.safetensors, tokenizer.json and tokenizer_config.json (with "
        'the chat template) to OUT_DIR. Needs: pip install "pagedkv[gguf]".',
    )
    parser.add_argument("gguf", metavar="FILE.gguf")
    parser.add_argument("out_dir", metavar="OUT_DIR")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="of the saved weights (auto: float32 for a quantized file, else the file's)",
    )
    parser.set_defaults(handler=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    """Convert and say where the directory went."""
    out = convert_gguf(args.gguf, args.out_dir, dtype=args.dtype)
    print(f"wrote {out} (config.json, model.safetensors, tokenizer.json, tokenizer_config.json)")
    return 0
