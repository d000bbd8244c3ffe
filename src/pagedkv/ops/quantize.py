"""int8 KV rows: symmetric, one scale per token and KV head, computed as the row is written.

    s = float16(min(max|x| / 127, FLOAT16_MAX))      per token and head
    q = clamp(round_half_even(x / s), -127, 127)     0 where s == 0 (an all-zero row)
    x ~ q * s

Every step is an IEEE float32 operation in a fixed order, so the CPU decoder stack's
compiled copy (`pagedkv.ops.cpu.int8`) writes the same bytes as `quantize`. Attention
reads q and applies s once per token and head: K's to the dot product, V's to the softmax
weight.
"""

from __future__ import annotations

import torch

QMAX = 127
FLOAT16_MAX = 65504.0

KVScales = tuple[torch.Tensor, torch.Tensor]
"""(key_scales, value_scales) of one layer: [num_blocks, block_size, num_kv_heads] float16."""


def quantize(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize rows to int8 with a scale per row.

    Args:
        rows: [..., head_dim], float32 | bfloat16 | float16 | float64 (taken as float32).

    Returns:
        (int8 [..., head_dim], float16 scales [...]).
    """
    x = rows.float()
    amax = x.abs().amax(dim=-1)
    scales = (amax / QMAX).clamp(max=FLOAT16_MAX).to(torch.float16)
    s = scales.float().unsqueeze(-1)
    q = torch.where(s > 0, x / s, torch.zeros_like(x)).round().clamp(-QMAX, QMAX)
    return q.to(torch.int8), scales


def dequantize(data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """data [..., head_dim] int8 times scales [...] float16, in `dtype`."""
    return data.to(dtype) * scales.to(dtype).unsqueeze(-1)
