"""pagedkv's linear layer: one product chosen per layer when the model is set up for the
machine (`Linear.use_products`), one call per product on the step path.

    rows <= few_rows   the matrix-vector kernel (`products.linear_rows`): each weight
                       row read once, on the calling thread or on every one
    rows <= tile_rows  bfloat16 with the kernels on (`tuning.tile_rows_bfloat16`): the
                       tiled kernel (`products.tiled_rows`), four weight rows by four
                       input rows at a time
    otherwise          oneDNN (`onednn=True`) on the plain float32 or bfloat16 weight;
                       else torch's `F.linear`

Every weight is held once, plain, where the loader put it: the matrix-vector kernel, the
compiled decoder stack and oneDNN all read that one tensor. oneDNN reorders a plain
bfloat16 weight into its blocked layout on each call (a buffer freed after the call),
which at a few dozen rows costs as much as the product; the tiled kernel takes those rows
on the plain weight. A packed copy kept for oneDNN would sit beside the plain one, since
the kernels read the plain one and the loader's single mapping of every weight keeps a
replaced weight's pages.

A weight held in GGML blocks (`use_blocks`, `pagedkv.runtime.quant`) has no plain copy:
its few-row and many-row products are `QuantWeight`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pagedkv.runtime.quant.weight import QuantWeight, few_rows_product
from pagedkv.runtime.tuning import CpuTuning


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN multiplies weights of `dtype` here: float32, or bfloat16 where oneDNN
    runs bfloat16, on a CPU with oneDNN."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`x @ weight.T (+ bias)` through oneDNN; `weight` [out, in], float32 or bfloat16."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class Linear(nn.Module):
    """`x @ weight.T (+ bias)` with HF's parameter names; call `forward` directly (no
    `nn.Module.__call__` hooks: a step makes ~100 of these calls)."""

    weight: Tensor
    bias: Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        weight: Tensor | None = None,
    ) -> None:
        """A layer of uninitialized parameters, or one sharing `weight` (a tied LM head)."""
        super().__init__()
        factory: dict[str, Any] = {"dtype": dtype, "device": device}
        self.in_features, self.out_features = in_features, out_features
        self.weight = weight if weight is not None else nn.Parameter(
            torch.empty(out_features, in_features, **factory)
        )  # fmt: skip
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.few_rows = 0  # products of at most this many rows go to `matvec`
        self.matvec: Callable[[Tensor], Tensor] | None = None
        self.tile_rows = 0  # products of at most this many rows (past few_rows) to `tiled`
        self.tiled: Callable[[Tensor], Tensor] | None = None
        self.onednn = False
        self.blocks: QuantWeight | None = None

    def use_blocks(self, weight: QuantWeight) -> None:
        """Hold the weight as `weight`'s blocks; the plain parameter is dropped (`weight`
        stays as a shape on the meta device).

        Raises:
            ValueError: `weight`'s shape is not [out_features, in_features].
        """
        expected = (self.out_features, self.in_features)
        if tuple(weight.shape) != expected:
            raise ValueError(f"weight: expected shape {expected}, got {tuple(weight.shape)}")
        dtype = self.weight.dtype
        del self.weight
        self.weight = torch.empty(expected, dtype=dtype, device="meta")
        self.blocks = weight

    @property
    def held(self) -> Tensor | QuantWeight:
        """The weight as this layer holds it: its blocks, or its plain tensor."""
        return self.blocks if self.blocks is not None else self.weight

    def use_products(self, few_rows: int, onednn: bool, tuning: CpuTuning | None = None) -> None:
        """Choose this layer's products: the matrix-vector kernel up to `few_rows` rows (0:
        never; its knobs from `tuning`), then the tiled kernel up to
        `tuning.tile_rows_bfloat16` where `products.tiles_apply` and `few_rows` > 0, oneDNN
        past them (else torch); all read `weight`. A weight in blocks takes its integer
        products up to `tuning.block_rows` rows instead (where `few_rows` > 0)."""
        if self.blocks is not None:
            tuning = tuning or CpuTuning()
            self.few_rows = tuning.block_rows if few_rows else 0
            self.matvec = few_rows_product(self.blocks, self.bias, tuning.parallel_work)
            return
        weight = self.weight.detach()
        if few_rows:
            from pagedkv.runtime.products import linear_rows  # Numba: loaded where it runs

            self.few_rows, self.matvec = few_rows, linear_rows(weight, self.bias, tuning)
            self._use_tiles(weight, tuning or CpuTuning())
        # With a bias, oneDNN adds it before rounding and torch's bfloat16 matmul may not:
        # the bits could differ, so biased bfloat16 layers stay with torch.
        self.onednn = onednn and can_pack(weight.dtype, weight.device)
        self.onednn &= not (weight.dtype == torch.bfloat16 and self.bias is not None)

    def _use_tiles(self, weight: Tensor, tuning: CpuTuning) -> None:
        """The tiled kernel past `few_rows`, where it multiplies `weight`."""
        from pagedkv.runtime.products import tiled_rows, tiles_apply

        if tiles_apply(weight, self.bias) and tuning.tile_rows_bfloat16 > self.few_rows:
            self.tile_rows, self.tiled = tuning.tile_rows_bfloat16, tiled_rows(weight, tuning)

    def forward(self, x: Tensor) -> Tensor:
        """x: [num_tokens, in_features] in the weight's dtype -> [num_tokens, out_features]."""
        rows = x.shape[0]
        if rows <= self.few_rows:
            return self.matvec(x)  # type: ignore[misc]
        if rows <= self.tile_rows:
            return self.tiled(x)  # type: ignore[misc]
        if self.blocks is not None:
            return self.blocks.matmul(x, self.bias)
        if self.onednn:
            return onednn_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)
