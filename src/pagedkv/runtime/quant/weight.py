"""A linear layer's weight kept in GGML blocks (`QuantWeight`), and its products.

    rows <= few_rows   `dots.block_products`: the rows quantized to integers, integer
                       products with each block read in place (a decode step, bound by
                       reading the weight: it is read in its packed size)
    otherwise          tiles of output rows written out by `blocks.dequantize_rows` and
                       multiplied by torch's matmul, one tile at a time (prefill, bound by
                       arithmetic): no dense copy of the whole weight is ever made

A tile is bfloat16 where the input is and the CPU multiplies bfloat16 (oneDNN with
AVX512-BF16 or AMX): the weights rounded to bfloat16 as a "none" model's are at load, and
multiplied by the same, faster product; else float32. A fused projection (q|k|v, gate|up) holds
one part per checkpoint tensor, each in its own format (a Q4_K_M file mixes Q4_K and Q6_K
within a layer). Either product sums in float32 (the few-row one in integers, scaled in
float32) and rounds a bfloat16 result once.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from pagedkv.ops import checks
from pagedkv.ops.cpu.arrays import as_numpy, sync_threads
from pagedkv.runtime.quant import blocks, dots
from pagedkv.runtime.quant.formats import BlockFormat
from pagedkv.runtime.threads import workers_spin

TILE_BYTES = 1 << 22
"""Bytes of a dequantized tile: a few MiB, so that a tile stays in the cache between its
dequantization and its matmul, and each matmul is long enough that its start is small."""


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
        return self.dequantize_into(row_ids, torch.empty(len(row_ids), in_features))

    def dequantize_into(self, row_ids: np.ndarray, out: Tensor) -> Tensor:
        """out[i] = row row_ids[i]; row_ids: int64 [n], out: float32 or bfloat16 [n,
        in_features], C-contiguous. Returns out."""
        f = self.format
        blocks.dequantize_rows(
            self.blocks, f.type_id, f.block_size, f.block_bytes, row_ids, as_numpy(out)
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
        return self.dequantize_span(0, torch.empty(self.out_features, self.in_features))

    def dequantize_span(self, first: int, out: Tensor) -> Tensor:
        """Rows first, first + 1, ... of the weight, across its parts, into out: float32 or
        bfloat16 [n, in_features], C-contiguous. Returns out."""
        start, end = 0, first + out.shape[0]
        for part in self.parts:
            low, high = max(first, start), min(end, start + part.rows)
            if low < high:
                ids = np.arange(low - start, high - start)
                part.dequantize_into(ids, out[low - first : high - first])
            start += part.rows
        return out

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
        """x: [num_tokens, in_features] -> x @ weight.T (+ bias), in x's dtype, a tile of
        output rows at a time (in `tile_dtype(x.dtype)`; a tile may span parts)."""
        dtype = tile_dtype(_checked(x, self.in_features).dtype)
        xt, bias = x.to(dtype), None if bias is None else bias.to(dtype)
        sync_threads()  # the tiles are written by as many threads as multiply them
        size = max(1, TILE_BYTES // (dtype.itemsize * self.in_features))
        tile = torch.empty(min(size, self.out_features), self.in_features, dtype=dtype)
        if size >= self.out_features:  # one tile: its product is the result
            return F.linear(xt, self.dequantize_span(0, tile), bias).to(x.dtype)
        out = torch.empty(x.shape[0], self.out_features, dtype=dtype)
        for first in range(0, self.out_features, size):
            rows = slice(first, min(first + size, self.out_features))
            weights = self.dequantize_span(first, tile[: rows.stop - first])
            out[:, rows] = F.linear(xt, weights, None if bias is None else bias[rows])
        return out.to(x.dtype)

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


def tile_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of `QuantWeight.matmul`'s tiles for an input of `dtype`: bfloat16 where
    the input is and oneDNN multiplies it on this CPU, else float32."""
    if dtype == torch.bfloat16 and _onednn_bf16():
        return dtype
    return torch.float32


@functools.cache
def _onednn_bf16() -> bool:
    return torch.backends.mkldnn.is_available() and bool(
        torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def _checked(x: Tensor, in_features: int) -> Tensor:
    if x.dim() != 2 or x.shape[1] != in_features:
        raise checks.fail("x", f"[num_tokens, {in_features}]", list(x.shape))
    return x


def _finish(out: Tensor, bias: Tensor | None, dtype: torch.dtype) -> Tensor:
    if bias is not None:
        out += bias.float()
    return out if dtype == torch.float32 else out.to(dtype)
