"""Building blocks of the Llama family: RMSNorm, rotary position embeddings, linear layers.

Both follow Hugging Face transformers' numerics exactly (float32 statistics, `rotate_half`
layout), so a float32 model here reproduces HF logits to rounding error.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """`weight * x / sqrt(mean(x^2) + eps)` over the last dimension.

    The statistic is computed in float32 and the normalized value cast back to the input
    dtype before the weight multiplies it, as HF Llama does (this order matters in bf16).
    """

    def __init__(
        self,
        size: int,
        eps: float,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))

    def forward(self, x: Tensor) -> Tensor:
        """x: [..., size] -> same shape and dtype."""
        if x.dtype == torch.float32:
            # One fused call; in float32 it is the same arithmetic as HF's steps.
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # HF's order: normalize in float32, cast, then the weight (three calls, not seven).
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * normed.to(x.dtype)


def compute_inv_freq(
    head_dim: int,
    rope_theta: float,
    rope_scaling: dict[str, Any] | None = None,
    max_position_embeddings: int = 4096,
) -> Tensor:
    """Inverse rotary frequencies, one per pair of dimensions.

    Args:
        head_dim: rotary dimension (the full head dimension in this family).
        rope_theta: the base.
        rope_scaling: None (plain RoPE), or a dict with `rope_type` "linear" (`factor`) or
            "llama3" (`factor`, `low_freq_factor`, `high_freq_factor`,
            `original_max_position_embeddings`).
        max_position_embeddings: fallback for a llama3 dict without the original length.

    Returns:
        [head_dim // 2] float32 on the CPU.

    Raises:
        ValueError: an unknown rope type or a missing scaling field.
    """
    # On the CPU even inside a meta-device context: meta arithmetic goes through torch._refs,
    # which imports torch._dynamo.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope_theta**exponents)
    if not rope_scaling:
        return inv_freq
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    try:
        if rope_type == "default":
            return inv_freq
        if rope_type == "linear":
            return inv_freq / float(rope_scaling["factor"])
        if rope_type == "llama3":
            return _llama3_inv_freq(inv_freq, rope_scaling, max_position_embeddings)
    except KeyError as exc:
        raise ValueError(
            f"rope_scaling {rope_type!r}: expected field {exc}, got {sorted(rope_scaling)}"
        ) from None
    raise ValueError(
        f"rope_scaling: expected rope_type 'default', 'linear' or 'llama3', got {rope_type!r}"
    )


def _llama3_inv_freq(inv_freq: Tensor, scaling: dict[str, Any], max_positions: int) -> Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band in
    # between interpolated smoothly (same arithmetic as HF, so logits match bit for bit).
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling.get("original_max_position_embeddings") or max_positions)
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Computes per-token cos/sin once per forward; every layer reuses them."""

    inv_freq: Tensor

    def __init__(self, inv_freq: Tensor, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        # Non-persistent: rebuilt from the config, never read from a checkpoint.
        self.register_buffer(
            "inv_freq", inv_freq.to(device=device, dtype=torch.float32), persistent=False
        )

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions: [num_tokens] int64 -> (cos, sin), each [num_tokens, head_dim // 2] in dtype.

        Only half of HF's `cat(freqs, freqs)` is kept: both halves are equal, and
        `apply_rotary_` uses the half form (the same products as `rotate_half`).
        """
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rotary_(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate `x` in place by position, neox style (HF `rotate_half`), and return it.

    In place, so the q and k heads can be rotated together inside the fused QKV output
    (one pass instead of HF's seven elementwise ops and two new tensors per q and k).

    Args:
        x: [num_tokens, num_heads, head_dim]; may be a strided view (unit last stride).
        cos, sin: [num_tokens, head_dim // 2], the dtype of `x`.
    """
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, D/2) broadcasts over heads
    x1_orig = x1.clone()
    x1.mul_(cos).addcmul_(x2, sin, value=-1)  # x1 cos - x2 sin
    x2.mul_(cos).addcmul_(x1_orig, sin)  # x2 cos + x1 sin
    return x


def can_pack_linear(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `pack_linear_` applies: float32 weights, or bfloat16 ones where oneDNN runs
    bfloat16, on a CPU with oneDNN."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linear_(linear: nn.Linear) -> None:
    """Send `linear`'s products through oneDNN (see `linear`), in place.

    The same kernels Inductor calls for a frozen CPU model. In bfloat16, for a batch of a
    few rows, torch's plain matmul streams the weight at about half the speed, while the
    packed one gives the same bits: the bias-free weight becomes a buffer in oneDNN's
    blocked layout (`torch._mkldnn`), which only `linear` (and oneDNN) reads, and the plain
    copy is released. In float32, torch's matmul is MKL's, which runs a generic code path
    on non-Intel CPUs; oneDNN multiplies a plain float32 weight as fast as a blocked one,
    so the weight stays as it is (no copy) and is only marked. Its sums run in another
    order than MKL's: logits move by float32 rounding.
    """
    weight = linear.weight
    if weight.dtype == torch.float32:
        linear.__dict__["onednn"] = True  # a plain attribute, read by `linear()`
        return
    # With a bias, oneDNN adds it before rounding and torch's bfloat16 matmul may not: the
    # bits could differ, so biased layers (Qwen2's QKV) stay plain.
    if weight.is_mkldnn or linear.bias is not None:
        return
    # The batch-size hint picks the blocking; decode-sized batches are the ones that are
    # bound by reading the weight, and every other size gives the same bits.
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
    del linear.weight
    linear.register_buffer("weight", packed)


MATVEC_ROWS = {torch.float32: 8, torch.bfloat16: 4}
"""Products of at most this many rows go to a layer's matrix-vector kernel (`use_matvec_`):
past it the kernel is bound by arithmetic (bfloat16 widens each weight element once per
four rows), not by reading the weight, and oneDNN's matmul is as fast (an LM head of 8-16
rows) or faster."""
FUSED_DECODE_ROWS = 16
"""Decode steps of at most this many rows go through the compiled decoder stack
(`use_fused_decode`), in either dtype: there every product of the step shares one parallel
region, which up to about 16 rows outruns oneDNN's matmuls plus a wake per product
(benchmarks.md)."""


def use_matvec_(
    linear: nn.Linear, kernel: Callable[[Tensor, Tensor | None], Callable[[Tensor], Tensor]]
) -> None:
    """Give `linear` a product for a few rows, `kernel(weight, bias)` on its weight as it
    is now (plain, float32 or bfloat16), which `linear()` calls for at most
    `MATVEC_ROWS[dtype]` rows.

    The product keeps that weight: a later `pack_linear_` then holds the layer twice.
    """
    weight = linear.weight.detach()
    # A plain attribute (not a submodule, buffer or parameter): `linear()` reads it directly.
    linear.__dict__["matvec"] = (MATVEC_ROWS[weight.dtype], kernel(weight, linear.bias))


def linear(x: Tensor, layer: nn.Linear) -> Tensor:
    """`x @ layer.weight.T (+ bias)`: the layer's matrix-vector kernel for a few rows
    (`use_matvec_`), else oneDNN (`pack_linear_`) or torch's matmul.

    x: [num_tokens, in_features] in the weight's dtype -> [num_tokens, out_features].

    `F.linear` on the weights directly: `nn.Module.__call__`'s hook dispatch is paid on each
    of a step's ~100 linear calls, and a decode step's small matmuls do not hide it.
    """
    matvec = layer.__dict__.get("matvec")
    if matvec is not None and x.shape[0] <= matvec[0]:
        return matvec[1](x)
    weight = layer.weight
    if weight.is_mkldnn or "onednn" in layer.__dict__:
        return onednn_linear(x, weight, layer.bias)
    return F.linear(x, weight, layer.bias)


def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`x @ weight.T (+ bias)` through oneDNN; `weight` plain float32 or packed bfloat16."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
