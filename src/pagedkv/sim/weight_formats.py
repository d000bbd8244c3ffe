"""Bytes of a model's weights in each storage format, GGML's block formats included.

Standard library only. A block format stores `block_elems` consecutive elements of a row in
`block_bytes` (scales and quantized values together):

    format   elements  bytes  bits/weight      format   elements  bytes  bits/weight
    f32             1      4  32               q5_0           32     22  5.5
    f16, bf16       1      2  16               q5_1           32     24  6.0
    q8_0           32     34   8.5             q4_k          256    144  4.5
    q4_0           32     18   4.5             q5_k          256    176  5.5
    q4_1           32     20   5.0             q6_k          256    210  6.5625

A quantization names what `llama-quantize` writes; its mixes follow llama.cpp's
`llama_tensor_get_type` for Llama-family models (`src/llama-quant.cpp`):

    every matrix         the quantization's base format (q4_k for q4_k_s and q4_k_m,
                         q5_k for q5_k_m)
    output               q6_k, or q8_0 where its rows do not split into 256-element blocks
                         (the LM head; a tied embedding table is the LM head), except q8_0
                         and the float formats, which keep theirs
    attn_v, ffn_down     q4_k_m, q5_k_m: q6_k in `more_bits` layers: the first and last
                         eighth, and every third layer between (about half of them)
                         q4_k_s: q5_k in the first four attn_v and the first eighth of
                         ffn_down
    a row that does not split into the format's blocks
                         q4_k -> q5_0, q5_k -> q5_1, q6_k -> q8_0

Vectors (norms, biases) stay in the engine's dtype, as few bytes as a rounding error.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from pagedkv.config import DTYPE_BYTES, ModelConfig


@dataclass(frozen=True)
class BlockFormat:
    """`block_elems` consecutive elements of a row stored in `block_bytes`."""

    block_elems: int
    block_bytes: int

    def row_bytes(self, num_elems: int) -> int:
        """Bytes of a row of `num_elems` elements (a whole number of blocks)."""
        return num_elems // self.block_elems * self.block_bytes


FORMATS = {
    "f32": BlockFormat(1, 4),
    "f16": BlockFormat(1, 2),
    "bf16": BlockFormat(1, 2),
    "q8_0": BlockFormat(32, 34),
    "q4_0": BlockFormat(32, 18),
    "q4_1": BlockFormat(32, 20),
    "q5_0": BlockFormat(32, 22),
    "q5_1": BlockFormat(32, 24),
    "q4_k": BlockFormat(256, 144),
    "q5_k": BlockFormat(256, 176),
    "q6_k": BlockFormat(256, 210),
}
"""GGML's block sizes (`ggml_type_traits`: blck_size, type_size)."""

QUANTIZATIONS = ("none", "f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q4_k_s", "q4_k_m",
                 "q5_k_m", "q6_k")  # fmt: skip
"""What `--quantization` takes; "none": every weight in the engine's dtype."""

_BASE = {"q4_k_s": "q4_k", "q4_k_m": "q4_k", "q5_k_m": "q5_k"}
_FALLBACK = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}
_FLOATS = ("f32", "f16", "bf16")


@dataclass(frozen=True)
class Matrix:
    """One weight matrix: its role in llama.cpp's terms, its layer (-1: none), its shape."""

    role: str
    layer: int
    rows: int
    cols: int


def check_quantization(quantization: str) -> str:
    """`quantization` lowercased.

    Raises:
        ValueError: not one of `QUANTIZATIONS` (named, with the choices).
    """
    name = quantization.lower()
    if name not in QUANTIZATIONS:
        raise ValueError(
            f"quantization: expected one of {', '.join(QUANTIZATIONS)}, got {quantization!r}"
        )
    return name


def matrices(model: ModelConfig) -> Iterator[Matrix]:
    """Every weight matrix of `model`, [rows = out_features, cols = in_features]."""
    h, d = model.hidden_size, model.head_dim
    q_dim, kv_dim = model.num_heads * d, model.num_kv_heads * d
    yield Matrix("output" if model.tie_word_embeddings else "token_embd", -1, model.vocab_size, h)
    for layer in range(model.num_layers):
        for role, rows, cols in (
            ("attn_q", q_dim, h),
            ("attn_k", kv_dim, h),
            ("attn_v", kv_dim, h),
            ("attn_output", h, q_dim),
            ("ffn_gate", model.intermediate_size, h),
            ("ffn_up", model.intermediate_size, h),
            ("ffn_down", h, model.intermediate_size),
        ):
            yield Matrix(role, layer, rows, cols)
    if not model.tie_word_embeddings:
        yield Matrix("output", -1, model.vocab_size, h)


def _more_bits(layer: int, num_layers: int) -> bool:
    eighth = num_layers // 8
    return layer < eighth or layer >= 7 * num_layers // 8 or (layer - eighth) % 3 == 2


def matrix_format(quantization: str, matrix: Matrix, num_layers: int) -> str:
    """The format `quantization` stores `matrix` in (one of `FORMATS`)."""
    base = _BASE.get(quantization, quantization)
    if matrix.role == "output" and base not in ("q8_0", *_FLOATS):
        return "q6_k" if matrix.cols % 256 == 0 else "q8_0"
    chosen = base
    more_bits = _more_bits(matrix.layer, num_layers)
    if quantization in ("q4_k_m", "q5_k_m") and matrix.role in ("attn_v", "ffn_down"):
        chosen = "q6_k" if more_bits else base
    elif quantization == "q4_k_s" and matrix.role == "attn_v" and matrix.layer < 4:
        chosen = "q5_k"
    elif quantization == "q4_k_s" and matrix.role == "ffn_down":
        chosen = "q5_k" if matrix.layer < num_layers // 8 else base
    if matrix.cols % FORMATS[chosen].block_elems:
        chosen = _FALLBACK.get(chosen, chosen)
    return chosen


def weight_bytes_by_format(model: ModelConfig, quantization: str, dtype: str) -> dict[str, int]:
    """Bytes of `model`'s weights per storage format under `quantization`; "none" keeps
    every weight in `dtype` (a `config.DTYPE_BYTES` name), as do the vectors elsewhere.

    Raises:
        ValueError: an unknown quantization, or a row that no fallback splits into blocks.
    """
    quantization = check_quantization(quantization)
    vector_bytes = DTYPE_BYTES[dtype.lower()]
    if quantization == "none":
        return {dtype: model.num_parameters() * vector_bytes}
    totals: dict[str, int] = {}
    matrix_elems = 0
    for matrix in matrices(model):
        name = matrix_format(quantization, matrix, model.num_layers)
        block = FORMATS[name]
        if matrix.cols % block.block_elems:
            raise ValueError(
                f"quantization: {quantization} needs rows of whole {block.block_elems}-element "
                f"blocks, got a {matrix.role} row of {matrix.cols}"
            )
        totals[name] = totals.get(name, 0) + matrix.rows * block.row_bytes(matrix.cols)
        matrix_elems += matrix.rows * matrix.cols
    vectors = model.num_parameters() - matrix_elems
    totals[dtype] = totals.get(dtype, 0) + vectors * vector_bytes
    return totals
