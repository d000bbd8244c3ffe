"""Weights of a GGUF checkpoint, dequantized and named as in a Hugging Face checkpoint.

The tensor table comes from `pagedkv.gguf_file`; the bytes of each tensor are dequantized by
the `gguf` package (llama.cpp's own Python tooling: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants,
the IQ types, F16, BF16, F32) to float32, renamed to the Hugging Face layout the loader
validates, and for the "llama" (Llama, Mistral) and "smollm3" architectures the rows of the
q and k projections are put back in Hugging Face's order (llama.cpp's converter interleaves them for
its rotary kernel; transformers' GGUF loader undoes it the same way).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pagedkv.config import ModelConfig
from pagedkv.gguf_file import GGUF_INSTALL_HINT, GGUFFile, GGUFTensorInfo
from pagedkv.models.checkpoint_layout import part_names
from pagedkv.models.quantized import BlockTensor, layer_of
from pagedkv.runtime.quant.formats import FORMATS_BY_TYPE

# GGUF tensor name -> Hugging Face name: model-wide, then per layer (`blk.{i}.` prefix).
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Where an architecture's layer names differ from Llama's (Gemma 3's four norms: its
# `ffn_norm` is the one before the MLP; Phi-3's fused projections, split by the loader).
_ARCH_LAYER_NAMES = {
    "gemma3": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
# Architectures whose q and k rows llama.cpp's converter interleaves (see `_unpermute_rotary`).
_INTERLEAVED = ("llama", "smollm3")
# llama.cpp stores Gemma's norm weights with its `1 +` added (the loader wants the raw ones).
_NORM_SHIFTS = {"gemma3": 1.0}
# Tensors that are no weights: rotary factors, read with the config (`gguf_families`).
_NOT_WEIGHTS = ("rope_factors_long.weight", "rope_factors_short.weight")
# Per-dimension rotary divisors (llama3 rope scaling), applied to inv_freq, not a weight.
ROPE_FREQS = "rope_freqs.weight"


def hf_tensor_name(name: str, arch: str = "llama") -> str:
    """The Hugging Face name of GGUF tensor `name` of architecture `arch`
    (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`); unknown names come
    back unchanged."""
    stem, _, suffix = name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{suffix}"
    return name


def dequantize(file: GGUFFile, info: GGUFTensorInfo, data: np.ndarray | None = None) -> Tensor:
    """Tensor `info` of `file` as float32 in torch's shape order (`[out, in]` for a weight).

    `data` is the file's bytes (`np.memmap` of uint8), mapped here when None.

    Raises:
        ValueError: a quantization type the `gguf` package cannot dequantize (named).
        ImportError: the `gguf` package is not installed (the message gives the command that
            installs it).
    """
    try:
        import gguf
    except ImportError:
        raise ImportError(
            f"reading GGUF weights needs the 'gguf' package: {GGUF_INSTALL_HINT}"
        ) from None
    try:
        qtype = gguf.GGMLQuantizationType(info.type_id)
    except ValueError:
        raise ValueError(
            f"GGUF tensor {info.name!r}: unknown quantization type id {info.type_id}"
        ) from None
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    row = info.shape[0]
    if row % block:
        raise ValueError(
            f"GGUF tensor {info.name!r}: expected rows of a multiple of {block} for "
            f"{qtype.name}, got {row}"
        )
    rows = int(np.prod(info.shape[1:], dtype=np.int64))
    row_bytes = row // block * type_size
    if data is None:
        data = np.memmap(file.path, dtype=np.uint8, mode="r")
    raw = data[info.offset : info.offset + rows * row_bytes].reshape(rows, row_bytes)
    try:
        values = gguf.quants.dequantize(raw, qtype)
    except NotImplementedError:
        raise ValueError(
            f"GGUF tensor {info.name!r}: unsupported quantization {qtype.name} "
            f"(the installed gguf package cannot dequantize it)"
        ) from None
    if not values.flags.writeable:  # F32 comes back as a view of the read-only map
        values = values.copy()
    return torch.from_numpy(values.astype(np.float32, copy=False)).reshape(info.shape[::-1])


def _unpermute_rotary(weight: Any, num_heads: int) -> Any:
    # llama.cpp stores each head's rows as (d/2, 2) pairs; Hugging Face as (2, d/2) halves.
    # Rows move whole, so a weight's blocks move the same way.
    if isinstance(weight, BlockTensor):
        order = _unpermute_rotary(torch.arange(weight.blocks.shape[0]), num_heads).numpy()
        return BlockTensor(weight.format, weight.blocks[order], weight.in_features)
    head_dim = weight.shape[0] // num_heads
    pairs = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return pairs.transpose(1, 2).reshape(weight.shape)


def iter_gguf_tensors(
    file: GGUFFile, config: ModelConfig, blocks: Collection[str] = ()
) -> Iterator[tuple[str, Any]]:
    """Every weight of `file` as (Hugging Face name, float32 tensor), ready for the loader;
    those named in `blocks` as their blocks (`BlockTensor`, a view of the mapped file).

    `rope_freqs.weight` is left out (see `rope_divisors`).

    Raises:
        ValueError: a tensor of an unsupported quantization type.
    """
    data = np.memmap(file.path, dtype=np.uint8, mode="r")
    arch = str(file.metadata.get("general.architecture"))
    interleaved = arch in _INTERLEAVED
    for info in file.tensors.values():
        if info.name == ROPE_FREQS or info.name in _NOT_WEIGHTS:
            continue
        name = hf_tensor_name(info.name, arch)
        tensor: Any = _blocks(info, data) if name in blocks else dequantize(file, info, data)
        if arch in _NORM_SHIFTS and name.endswith("norm.weight"):
            tensor -= _NORM_SHIFTS[arch]
        if interleaved and ".self_attn.q_proj." in name:
            tensor = _unpermute_rotary(tensor, config.num_heads)
        elif interleaved and ".self_attn.k_proj." in name:
            tensor = _unpermute_rotary(tensor, config.num_kv_heads)
        yield name, tensor


def block_weights(file: GGUFFile, config: ModelConfig) -> dict[str, int]:
    """The layers (`quantized.layer_of`) whose every part `file` stores in a block format
    pagedkv multiplies in place, with their number of parts."""
    arch = file.metadata.get("general.architecture", "llama")
    kinds: dict[str, list[bool]] = {}
    for info in file.tensors.values():
        for name in part_names(hf_tensor_name(info.name, arch)):
            layer = layer_of(name, config)
            if layer is not None:
                kinds.setdefault(layer[0], []).append(info.type_id in FORMATS_BY_TYPE)
    return {path: len(kind) for path, kind in kinds.items() if all(kind)}


def _blocks(info: GGUFTensorInfo, data: np.ndarray) -> BlockTensor:
    """Tensor `info`'s bytes as rows of blocks, where they lie in the mapped file."""
    fmt = FORMATS_BY_TYPE[info.type_id]
    in_features, rows = info.shape[0], int(np.prod(info.shape[1:], dtype=np.int64))
    row_bytes = fmt.row_bytes(in_features)
    view = data[info.offset : info.offset + rows * row_bytes].reshape(rows, row_bytes)
    return BlockTensor(fmt, np.asarray(view), in_features)


def rope_divisors(file: GGUFFile) -> Tensor | None:
    """`rope_freqs.weight` ([head_dim // 2] float32): llama.cpp's form of llama3 rope
    scaling, the factor each inverse frequency is divided by; None when absent."""
    info = file.tensors.get(ROPE_FREQS)
    return None if info is None else dequantize(file, info)
