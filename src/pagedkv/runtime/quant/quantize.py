"""Float weights into GGML blocks (`formats.py`): Q8_0 and Q4_0, for checkpoints without
blocks of their own (`quantization="q8_0"` or `"q4_0"` at load). NumPy only.

Both keep one fp16 scale per 32 weights. Q8_0: d = max|w| / 127, q = round(w / d) in
int8. Q4_0: d = m / -8 where m is the weight of largest magnitude (sign kept, so that
weight lands exactly on -8), q = clamp(floor(w / d + 8.5), 0, 15), stored as nibbles.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedkv.runtime.quant.formats import FORMATS, QUANTIZABLE, BlockFormat
from pagedkv.runtime.quant.weight import QuantPart


def quantize(weight: torch.Tensor, name: str) -> QuantPart:
    """weight: [rows, in_features], any float dtype -> its rows in format `name`.

    Raises:
        ValueError: `name` is not one of `QUANTIZABLE`, or in_features is not a multiple
            of 32 (named, expected and given).
    """
    if name not in QUANTIZABLE:
        raise ValueError(f"quantization: expected one of {QUANTIZABLE}, got {name!r}")
    fmt = FORMATS[name.upper()]
    fmt.row_bytes(weight.shape[1])
    groups = weight.detach().float().numpy().reshape(weight.shape[0], -1, 32)  # (R, G, 32)
    body = _q8_0(groups) if fmt.name == "Q8_0" else _q4_0(groups)
    return _part(fmt, body, weight.shape[0])


def _inverse(d: np.ndarray) -> np.ndarray:
    safe = np.where(d == 0, 1, d)
    return np.where(d == 0, 0, 1 / safe).astype(np.float32)


def _q8_0(groups: np.ndarray) -> np.ndarray:
    d = np.abs(groups).max(axis=-1) / 127  # (R, G)
    q = np.rint(groups * _inverse(d)[..., None]).astype(np.int8)
    return np.concatenate([_half_bytes(d), q.view(np.uint8)], axis=-1)


def _q4_0(groups: np.ndarray) -> np.ndarray:
    at = np.abs(groups).argmax(axis=-1)[..., None]
    d = np.take_along_axis(groups, at, axis=-1)[..., 0] / -8  # (R, G)
    q = np.floor(groups * _inverse(d)[..., None] + 8.5).clip(0, 15).astype(np.uint8)
    nibbles = q[..., :16] | (q[..., 16:] << 4)  # weight j low, j + 16 high
    return np.concatenate([_half_bytes(d), nibbles], axis=-1)


def _half_bytes(d: np.ndarray) -> np.ndarray:
    """(R, G) scales -> (R, G, 2) bytes of their fp16 values."""
    return d.astype(np.float16)[..., None].view(np.uint8)


def _part(fmt: BlockFormat, body: np.ndarray, rows: int) -> QuantPart:
    blocks = np.ascontiguousarray(body).reshape(rows, -1)
    blocks.flags.writeable = False  # as a mapped file's bytes: one compiled variant
    return QuantPart(fmt, blocks)
