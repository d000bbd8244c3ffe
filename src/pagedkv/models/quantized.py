"""Which linear layers a model holds in GGML blocks (`pagedkv.runtime.quant`), and their
blocks as a checkpoint hands them over.

`quantization` (`EngineArgs.quantization`):
    "auto"          a GGUF file's block formats kept as they are; float weights as today
    "none"          every weight dequantized at load (the model's dtype)
    "q8_0", "q4_0"  every projection and the LM head quantized at load (`quantize`)

A layer is held in blocks only whole: a fused projection (q|k|v, gate|up) whose parts are
not all in block formats is dequantized. Token embeddings stay dense (a lookup reads rows);
a tied LM head multiplies the same tensor's blocks. Under tensor parallelism a rank holds
its rows of blocks; an input-split projection must be cut on a block boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagedkv.config import ModelConfig
from pagedkv.runtime.linear import Linear
from pagedkv.runtime.quant.formats import QUANTIZATIONS, BlockFormat
from pagedkv.runtime.quant.quantize import quantize
from pagedkv.runtime.quant.weight import QuantPart, QuantWeight

FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
"""Checkpoint projection -> (fused layer, index of its part in the fusion)."""
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TIED_HEAD = "tied_head"
"""The layer a tied LM head becomes (`CausalLM.tied_head`), fed by the embedding tensor."""


def check_quantization(quantization: str) -> str:
    """Raises: ValueError: not one of `QUANTIZATIONS`."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization: expected one of {QUANTIZATIONS}, got {quantization!r}")
    return quantization


def layer_of(name: str, config: ModelConfig) -> tuple[str, int] | None:
    """(layer path, part index) that checkpoint weight `name` feeds, for a projection or LM
    head (the embedding of a tied model feeds `TIED_HEAD`); None for any other tensor."""
    if name == "lm_head.weight":
        return "lm_head", 0
    if name == "model.embed_tokens.weight" and config.tie_word_embeddings:
        return TIED_HEAD, 0
    module_path, _, leaf = name.rpartition(".")
    parent, _, proj = module_path.rpartition(".")
    if leaf != "weight" or proj not in _PROJECTIONS:
        return None
    fused, index = FUSED.get(proj, (proj, 0))
    return f"{parent}.{fused}", index


class BlockTensor:
    """A checkpoint tensor's blocks [rows, row_bytes] with its float shape [rows,
    in_features], sliced as a safetensors slice is (`loader._read`): by rows, or by
    columns on block boundaries."""

    def __init__(self, fmt: BlockFormat, blocks: np.ndarray, in_features: int) -> None:
        self.format, self.blocks, self.in_features = fmt, blocks, in_features

    def get_shape(self) -> list[int]:
        return [int(self.blocks.shape[0]), self.in_features]

    def __getitem__(self, index: Any) -> BlockTensor:
        index = index if isinstance(index, tuple) else (index,)
        columns = index[1] if len(index) > 1 else slice(None)
        blocks = self.blocks[index[0]]
        start, stop, _ = columns.indices(self.in_features)
        size = self.format.block_size
        if start % size or stop % size:
            raise ValueError(
                f"tensor parallelism: expected input columns cut at multiples of {size} "
                f"({self.format.name} blocks), got {start}:{stop}"
            )
        per = self.format.block_bytes
        blocks = blocks[:, start // size * per : stop // size * per]
        return BlockTensor(self.format, blocks, stop - start)

    def split(self, sizes: list[int], dim: int = 0) -> list[BlockTensor]:
        """The tensor cut into consecutive row ranges of `sizes` (a fused projection's
        parts; rows are independent in every block format)."""
        assert dim == 0, "blocks split by rows only"
        bounds = np.cumsum([0, *sizes])
        return [self[int(a) : int(b)] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.blocks.shape[0]), self.in_features

    def part(self, rows: int) -> QuantPart:
        """The blocks as one layer part of `rows` rows (zero rows past the tensor's: a
        vocabulary shard's padding)."""
        blocks = self.blocks
        if blocks.shape[0] < rows:
            padding = np.zeros((rows - blocks.shape[0], blocks.shape[1]), dtype=np.uint8)
            blocks = np.concatenate([blocks, padding])
        blocks = np.ascontiguousarray(blocks)  # a view of the file where it already is
        blocks.flags.writeable = False
        return QuantPart(self.format, blocks)


@dataclass
class BlockPlan:
    """The layers of one model held in blocks, and their parts as they arrive.

    Attributes:
        layers: layer path -> number of parts (3 for q|k|v, 2 for gate|up, else 1).
        quantizer: the format float weights of those layers are quantized to ("q8_0",
            "q4_0"), or None (the checkpoint brings blocks).
    """

    layers: dict[str, int]
    quantizer: str | None
    parts: dict[str, dict[int, QuantPart]] = field(default_factory=dict)

    def weight_names(self) -> set[str]:
        """The model parameters that are never made dense (the huge-page placement skips
        them)."""
        return {f"{path}.weight" for path in self.layers}

    def takes(self, name: str, config: ModelConfig) -> bool:
        layer = layer_of(name, config)
        return layer is not None and layer[0] in self.layers

    def add(self, name: str, source: Any, config: ModelConfig, rows: int) -> None:
        """Keep checkpoint weight `name` (a `BlockTensor` or a float tensor, this rank's
        part) as part of its layer, padded to `rows` rows."""
        layer = layer_of(name, config)
        assert layer is not None, f"{name} feeds no layer held in blocks"
        if isinstance(source, BlockTensor):
            part = source.part(rows)
        else:
            assert self.quantizer is not None, f"{name}: float weight, no quantizer"
            dense = source if source.shape[0] == rows else _padded(source, rows)
            part = quantize(dense, self.quantizer)
        self.parts.setdefault(layer[0], {})[layer[1]] = part

    def finish(self, model: torch.nn.Module) -> None:
        """Give every planned layer of `model` its blocks (`Linear.use_blocks`)."""
        for path, count in self.layers.items():
            parts = self.parts.get(path, {})
            assert len(parts) == count, f"{path}: {len(parts)} of {count} parts arrived"
            linear = model.get_submodule(path)
            assert isinstance(linear, Linear), f"{path} is not a Linear"
            linear.use_blocks(QuantWeight([parts[i] for i in range(count)], linear.in_features))


def block_bytes(model: torch.nn.Module) -> int:
    """Bytes of the blocks `model`'s layers hold (its parameters leave them out)."""
    layers = [m for m in model.modules() if isinstance(m, Linear) and m.blocks is not None]
    return sum(m.blocks.nbytes for m in layers if m.blocks is not None)


def _padded(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    out = tensor.new_zeros(rows, tensor.shape[1])
    out[: tensor.shape[0]] = tensor
    return out
