"""Checkpoint tensors of every family in one layout, the one `loader.checkpoint_shapes`
lists: Llama's names under `model.`, one tensor per projection.

Two families store theirs otherwise:
    Gemma 3 multimodal  the language model under `language_model.model.` (or
                        `model.language_model.`), beside the vision tower, which is dropped
    Phi-3               q|k|v in one `qkv_proj`, gate|up in one `gate_up_proj` (split here,
                        so tensor parallelism and the shape checks see Llama's tensors)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pagedkv.config import ModelConfig

# Prefix of a multimodal checkpoint's language model -> Llama's prefix.
_TEXT_PREFIXES = {
    "language_model.model.": "model.",
    "model.language_model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
# Tensors of a multimodal checkpoint that are not the language model's.
_OTHER_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                   "model.multi_modal_projector.")  # fmt: skip
FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def canonical_tensors(
    tensors: Iterable[tuple[str, Any]], config: ModelConfig
) -> Iterator[tuple[str, Any]]:
    """`tensors` (name, tensor or lazy safetensors slice) in Llama's layout: multimodal
    prefixes stripped, other towers dropped, fused projections split into their parts."""
    for name, source in tensors:
        if name.startswith(_OTHER_PREFIXES):
            continue
        name = _text_name(name)
        fused = _fused_of(name)
        if fused is None:
            yield name, source
            continue
        whole = source if isinstance(source, torch.Tensor) else source[:]
        parts = whole.split(_part_sizes(name, fused, config, whole.shape[0]), dim=0)
        yield from zip(part_names(name), parts, strict=True)


def part_names(name: str) -> list[str]:
    """The Llama-layout tensors that checkpoint tensor `name` holds: itself, or a fused
    projection's parts."""
    fused = _fused_of(name)
    if fused is None:
        return [name]
    stem, _, suffix = name.rpartition(".")
    prefix = stem.removesuffix(fused)
    return [f"{prefix}{part}.{suffix}" for part in FUSED_PROJECTIONS[fused]]


def _fused_of(name: str) -> str | None:
    """The fused projection (a `FUSED_PROJECTIONS` key) tensor `name` is, or None."""
    stem = name.rpartition(".")[0]
    return next((f for f in FUSED_PROJECTIONS if stem.endswith("." + f)), None)


def with_fused_names(names: set[str]) -> set[str]:
    """`names` (Llama-layout tensor names) plus the fused checkpoint tensors whose every
    part is among them (a GGUF file of Phi-3 stores q|k|v and gate|up fused)."""
    fused = set()
    for whole, parts in FUSED_PROJECTIONS.items():
        for name in names:
            stem, _, suffix = name.rpartition(".")
            if not stem.endswith("." + parts[0]):
                continue
            prefix = stem.removesuffix(parts[0])
            if all(f"{prefix}{part}.{suffix}" in names for part in parts):
                fused.add(f"{prefix}{whole}.{suffix}")
    return names | fused


def _text_name(name: str) -> str:
    for prefix, replacement in _TEXT_PREFIXES.items():
        if name.startswith(prefix):
            return replacement + name.removeprefix(prefix)
    return name


def _part_sizes(name: str, fused: str, config: ModelConfig, rows: int) -> list[int]:
    """Rows of each part of fused tensor `name`.

    Raises:
        ValueError: `rows` is not the parts' sum.
    """
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    sizes = [config.intermediate_size] * 2 if fused == "mlp.gate_up_proj" else [q, kv, kv]
    if rows != sum(sizes):
        raise ValueError(f"weight {name!r}: expected {sum(sizes)} rows, got {rows}")
    return sizes
