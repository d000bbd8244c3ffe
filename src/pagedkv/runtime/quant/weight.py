"""A linear layer's weight kept in GGML blocks (`QuantWeight`), and its products.

    rows <= few_rows   `dots.block_products`: the rows quantized to integers, integer
                       products with each block read in place (a decode step, bound by
                       reading the weight: it is read in its packed size)
    otherwise          tiles of output rows dequantized to float32 and multiplied by torch's
                       matmul, one tile at a time (prefill, bound by arithmetic): no dense
                       copy of the whole weight is ever made

A fused projection (q|k|v, gate|up) holds one part per checkpoint tensor, each in its own
format (a Q4_K_M file mixes Q4_K and Q6_K within a layer). The many-row product sums in
float32; the few-row one in integers, scaled in float32. A bfloat16 input gives the float32
result rounded once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from pagedkv.ops import checks
from pagedkv.ops.cpu.arrays import sync_threads
from pagedkv.runtime.quant import blocks, dots
from pagedkv.runtime.quant.formats import BlockFormat
from pagedkv.runtime.threads import workers_spin

TILE_BYTES = 1 << 22
"""Float32 bytes of a dequantized tile: a few MiB, so a tile stays in the L2/L3 cache
between its dequantization and its matmul."""


@dataclass(frozen=True)
class QuantPart:
    """Consecutive output rows of a weight in one format.

    Attributes:
        format: the rows' block format.
        blocks: uint8 [rows, format.row_bytes(in_features)], C-contiguous, read-only (a view
            of the checkpoint's mapped bytes, or what `quantize` made).
    """

    format: BlockFormat
    blocks: np.ndarray

    @property
    def rows(self) -> int:
        return int(self.blocks.shape[0])

    def dequantize(self, row_ids: np.ndarray, in_features: int) -> Tensor:
        """row_ids: int64 [n] -> float32 [n, in_features]."""
        out = torch.empty(len(row_ids), in_features, dtype=torch.float32)
        f = self.format
        blocks.dequantize_rows(
            self.blocks, f.type_id, f.block_size, f.block_bytes, row_ids, out.numpy()
        )
        return out


class QuantWeight:
    """A weight [out_features, in_features] as row parts of blocks (`QuantPart`)."""

    def __init__(self, parts: list[QuantPart], in_features: int) -> None:
        """Raises:
        ValueError: a part's bytes per row do not fit `in_features` in its format."""
        for part in parts:
            expected = part.format.row_bytes(in_features)
            if part.blocks.ndim != 2 or part.blocks.shape[1] != expected:
                raise ValueError(
                    f"blocks: expected [rows, {expected}] uint8 for {part.format.name} rows "
                    f"of {in_features}, got {list(part.blocks.shape)}"
                )
        self.parts = parts
        self.in_features = in_features
        self.out_features = sum(part.rows for part in parts)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def nbytes(self) -> int:
        return sum(part.blocks.nbytes for part in self.parts)

    @property
    def format_names(self) -> list[str]:
        return [part.format.name for part in self.parts]

    def dequantize(self) -> Tensor:
        """The whole weight as float32 [out_features, in_features] (a reference)."""
        return torch.cat([p.dequantize(np.arange(p.rows), self.in_features) for p in self.parts])

    def rows(self, row_ids: Tensor) -> Tensor:
        """row_ids: int64 [n] -> float32 [n, in_features] (an embedding lookup)."""
        ids = row_ids.numpy()
        out = torch.empty(len(ids), self.in_features, dtype=torch.float32)
        start = 0
        for part in self.parts:
            inside = (ids >= start) & (ids < start + part.rows)
            if inside.any():
                out[torch.from_numpy(inside)] = part.dequantize(
                    ids[inside] - start, self.in_features
                )
            start += part.rows
        return out

    def matmul(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """x: [num_tokens, in_features] -> x @ weight.T (+ bias), in x's dtype, tile by tile."""
        x32 = _checked(x, self.in_features).float()
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        tile = max(1, TILE_BYTES // (4 * self.in_features))
        start = 0
        for part in self.parts:
            for first in range(0, part.rows, tile):
                ids = np.arange(first, min(part.rows, first + tile))
                weights = part.dequantize(ids, self.in_features)
                out[:, start + first : start + first + len(ids)] = x32 @ weights.T
            start += part.rows
        return _finish(out, bias, x.dtype)

    def few_rows(self, x: Tensor, bias: Tensor | None, parallel_work: float) -> Tensor:
        """`matmul` for a few rows of x, from the blocks in place (`dots.block_products`),
        split over the threads where the product is at least `parallel_work` weights x
        rows."""
        x32 = np.ascontiguousarray(_checked(x, self.in_features).float().numpy())
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        flat_out, parts, sums = out.numpy(), sync_threads(), dots.x_sums(x32)
        spread = parts > 1 and x.shape[0] * self.out_features * self.in_features >= parallel_work
        quantized: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # by the group size
        start = 0
        for part in self.parts:
            f = part.format
            if f.block_size not in quantized:
                levels = dots.LEVELS[f.block_size]
                quantized[f.block_size] = dots.quantize_rows(x32, f.block_size, levels)
            xq, xd = quantized[f.block_size]
            args = (xq, xd, sums, part.blocks, f.type_id, f.block_size, f.block_bytes, flat_out,
                    start)  # fmt: skip
            if spread:
                dots.block_products_parallel(*args, parts)
            else:
                dots.block_products(*args, 0, part.rows)
            start += part.rows
        return _finish(out, bias, x.dtype)


def few_rows_product(weight: QuantWeight, bias: Tensor | None, parallel_work: int):  # type: ignore[no-untyped-def]
    """`x -> weight.few_rows(x, bias)` with the thread policy of `products.linear_rows`:
    split over every thread where the workers spin, else from `parallel_work`."""
    threshold: float = 0 if workers_spin() else parallel_work or math.inf
    return lambda x: weight.few_rows(x, bias, threshold)


def _checked(x: Tensor, in_features: int) -> Tensor:
    if x.dim() != 2 or x.shape[1] != in_features:
        raise checks.fail("x", f"[num_tokens, {in_features}]", list(x.shape))
    return x


def _finish(out: Tensor, bias: Tensor | None, dtype: torch.dtype) -> Tensor:
    if bias is not None:
        out += bias.float()
    return out if dtype == torch.float32 else out.to(dtype)
