"""The GGML block formats pagedkv multiplies in place, as data (llama.cpp's
`ggml-common.h` block structs): how many weights a block holds and in how many bytes.

Each row of a weight `[out_features, in_features]` is `in_features // block_size` blocks
back to back, as a GGUF file stores it; a row's bytes are read where they lie. How a block
turns into numbers is `blocks.py`'s `unpack_block`, keyed by `type_id`. Standard library
only.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockFormat:
    """One block format.

    Attributes:
        name: GGML's name ("Q4_K").
        type_id: the GGML type id, as a GGUF tensor table gives it (and the kernels' key).
        block_size: weights per block.
        block_bytes: bytes per block.
    """

    name: str
    type_id: int
    block_size: int
    block_bytes: int

    def row_bytes(self, in_features: int) -> int:
        """Bytes of one row of `in_features` weights.

        Raises:
            ValueError: `in_features` is not a whole number of blocks.
        """
        if in_features % self.block_size:
            raise ValueError(
                f"in_features: expected a multiple of {self.block_size} for {self.name}, "
                f"got {in_features}"
            )
        return in_features // self.block_size * self.block_bytes


# fp16 scales: 2 bytes each. Q8_0: d, 32 int8.  Q4_0: d, 16 bytes of nibbles.  Q4_1: d, m,
# 16 bytes.  Q5_0: d, 4 bytes of fifth bits, 16 bytes of nibbles.  Q5_1: d, m, the same.
# Q4_K: d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles.  Q5_K: as Q4_K
# plus 32 bytes of fifth bits.  Q6_K: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16
# int8 scales, d.
FORMATS = {
    f.name: f
    for f in (
        BlockFormat("Q4_0", 2, 32, 18),
        BlockFormat("Q4_1", 3, 32, 20),
        BlockFormat("Q5_0", 6, 32, 22),
        BlockFormat("Q5_1", 7, 32, 24),
        BlockFormat("Q8_0", 8, 32, 34),
        BlockFormat("Q4_K", 12, 256, 144),
        BlockFormat("Q5_K", 13, 256, 176),
        BlockFormat("Q6_K", 14, 256, 210),
    )
}
"""The formats kept in blocks, by name."""
FORMATS_BY_TYPE = {f.type_id: f for f in FORMATS.values()}
"""The same, by GGML type id."""
QUANTIZABLE = ("q8_0", "q4_0")
"""The formats a float checkpoint can be quantized to at load (`quantize.py`)."""
QUANTIZATIONS = ("auto", "none", *QUANTIZABLE)
"""The values of `EngineArgs.quantization` (`pagedkv.models.quantized` says what each does)."""
