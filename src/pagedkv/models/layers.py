"""Building blocks of the Llama family: RMSNorm and rotary position embeddings (the linear
layer is `pagedkv.runtime.linear.Linear`, whose product is chosen for the machine).

Both follow Hugging Face transformers' numerics exactly (float32 statistics, `rotate_half`
layout), so a float32 model here reproduces HF logits to rounding error.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """`(offset + weight) * x / sqrt(mean(x^2) + eps)` over the last dimension.

    The statistic is computed in float32. With offset 0 (Llama) the normalized value is cast
    back to the input dtype before the weight multiplies it, as HF Llama does; with an offset
    (Gemma's `1 + weight`) the product is taken in float32 and then cast, as HF Gemma does
    (the orders differ in bf16).
    """

    def __init__(
        self,
        size: int,
        eps: float,
        *,
        offset: float = 0.0,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))

    def forward(self, x: Tensor) -> Tensor:
        """x: [..., size] -> same shape and dtype."""
        if self.offset:
            weight = self.weight.float() + self.offset
            return F.rms_norm(x.float(), (x.shape[-1],), weight, self.eps).to(x.dtype)
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
        rope_scaling: None (plain RoPE), or a dict with `rope_type` "linear" (`factor`),
            "llama3" (`factor`, `low_freq_factor`, `high_freq_factor`,
            `original_max_position_embeddings`) or "longrope" (`short_factor`: these are
            the short-sequence frequencies; see `create_rotary` for the long ones).
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
        if rope_type == "longrope":
            return _longrope_inv_freq(head_dim, rope_theta, rope_scaling["short_factor"])
    except KeyError as exc:
        raise ValueError(
            f"rope_scaling {rope_type!r}: expected field {exc}, got {sorted(rope_scaling)}"
        ) from None
    raise ValueError(
        f"rope_scaling: expected rope_type 'default', 'linear', 'llama3' or 'longrope', "
        f"got {rope_type!r}"
    )


def _longrope_inv_freq(rotary_dim: int, rope_theta: float, factors: list[float]) -> Tensor:
    # LongRoPE: each frequency divided by its own factor (HF's order of operations).
    if len(factors) != rotary_dim // 2:
        raise ValueError(
            f"rope_scaling: expected {rotary_dim // 2} longrope factors, got {len(factors)}"
        )
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float()
    ext = torch.tensor(factors, dtype=torch.float32, device="cpu")
    return 1.0 / (ext * rope_theta ** (exponents / rotary_dim))


def longrope_attention_factor(scaling: dict[str, Any], max_position_embeddings: int) -> float:
    """The factor LongRoPE multiplies cos and sin by: `attention_factor`, or
    sqrt(1 + ln(s) / ln(original)) with s = `factor` or max / original positions."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = int(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or max_position_embeddings / original)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


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
    """Computes per-token cos/sin once per forward; every layer of its kind reuses them.

    With `long_inv_freq` (LongRoPE) a sequence whose length at the end of the step exceeds
    `original_max_positions` rotates this step's tokens with the long frequencies, the
    others with `inv_freq`: transformers' choice for a forward of one sequence. Keys cached
    before a sequence crosses keep the short rotation (transformers instead recomputes the
    whole sequence once, at the crossing), and a prompt that crosses in a later prefill
    chunk has its earlier chunks rotated short.
    """

    inv_freq: Tensor
    long_inv_freq: Tensor | None

    def __init__(
        self,
        inv_freq: Tensor,
        *,
        long_inv_freq: Tensor | None = None,
        attention_factor: float = 1.0,
        original_max_positions: int = 0,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        # Non-persistent: rebuilt from the config, never read from a checkpoint.
        self.register_buffer(
            "inv_freq", inv_freq.to(device=device, dtype=torch.float32), persistent=False
        )
        long = None if long_inv_freq is None else long_inv_freq.to(device, torch.float32)
        self.register_buffer("long_inv_freq", long, persistent=False)
        self.attention_factor = attention_factor
        self.original_max_positions = original_max_positions

    @property
    def needs_seq_lens(self) -> bool:
        return self.long_inv_freq is not None

    def forward(
        self, positions: Tensor, dtype: torch.dtype, seq_lens: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """positions: [num_tokens] int64; seq_lens: [num_tokens], each token's sequence
        length at the end of the step (only with `long_inv_freq`) -> (cos, sin), each
        [num_tokens, rotary_dim // 2] in dtype.

        Only half of HF's `cat(freqs, freqs)` is kept: both halves are equal, and
        `apply_rotary_` uses the half form (the same products as `rotate_half`).
        """
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        if self.long_inv_freq is not None:
            assert seq_lens is not None, "LongRoPE needs each token's sequence length"
            long = positions.float()[:, None] * self.long_inv_freq[None, :]
            freqs = torch.where((seq_lens > self.original_max_positions)[:, None], long, freqs)
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def create_rotary(
    rotary_dim: int,
    rope_theta: float,
    rope_scaling: dict[str, Any] | None,
    max_position_embeddings: int,
    *,
    device: torch.device | str | None = None,
) -> RotaryEmbedding:
    """The rotary embedding of `rotary_dim` leading dimensions per head (see
    `compute_inv_freq`); for LongRoPE with its long frequencies and attention factor."""
    inv_freq = compute_inv_freq(rotary_dim, rope_theta, rope_scaling, max_position_embeddings)
    if not rope_scaling or rope_scaling.get("rope_type") != "longrope":
        return RotaryEmbedding(inv_freq, device=device)
    try:
        return RotaryEmbedding(
            inv_freq,
            long_inv_freq=_longrope_inv_freq(rotary_dim, rope_theta, rope_scaling["long_factor"]),
            attention_factor=longrope_attention_factor(rope_scaling, max_position_embeddings),
            original_max_positions=int(rope_scaling["original_max_position_embeddings"]),
            device=device,
        )
    except (KeyError, TypeError) as exc:
        raise ValueError(
            f"rope_scaling 'longrope': expected long_factor and "
            f"original_max_position_embeddings, got {sorted(rope_scaling)} ({exc})"
        ) from None


def apply_rotary_(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate `x` in place by position, neox style (HF `rotate_half`), and return it.

    In place, so the q and k heads can be rotated together inside the fused QKV output
    (one pass instead of HF's seven elementwise ops and two new tensors per q and k).

    Args:
        x: [num_tokens, num_heads, rotary_dim]; may be a strided view (unit last stride),
            such as the leading dimensions of each head under partial rotary.
        cos, sin: [num_tokens, rotary_dim // 2], the dtype of `x`.
    """
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, D/2) broadcasts over heads
    x1_orig = x1.clone()
    x1.mul_(cos).addcmul_(x2, sin, value=-1)  # x1 cos - x2 sin
    x2.mul_(cos).addcmul_(x1_orig, sin)  # x2 cos + x1 sin
    return x
