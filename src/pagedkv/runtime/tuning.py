"""The CPU runtime's knobs in one frozen object, `CpuTuning`: safe defaults, or this
machine's values, which `pagedkv tune` measures and writes to `tuning_path()`
(``$PAGEDKV_CACHE_DIR/cpu-tuning.json``); an engine reads them when it starts
(`CpuTuning.load`). What the knobs change, and by how much on one machine:
docs/benchmarks.md.

Compiled code takes the values as arguments (a module constant read inside a jitted function
would be frozen into the cached machine code). Standard library only.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

from pagedkv.runtime.kernel_cache import cache_root, write_whole


@dataclass(frozen=True)
class CpuTuning:
    """How the CPU runtime splits a decode step's work.

    Attributes:
        matvec_rows_float32, matvec_rows_bfloat16: products of at most this many rows go to
            the matrix-vector kernel (`products.linear_rows`); past them it is bound by
            arithmetic, not by reading the weight, and oneDNN's matmul is as fast.
        tile_rows_bfloat16: bfloat16 products of more rows than the matrix-vector kernel's
            and at most this many go to the tiled kernel (`products.tiled_rows`) on the
            plain weight; past them to oneDNN, whose reorder of the weight on every call
            is then a small part of the product.
        block_rows: products of at most this many rows on a weight held in GGML blocks take
            the integer block products (`QuantWeight.few_rows`), inside the compiled
            decoder stack (its LM head) and out of it; past them the dequantized tiles
            (`QuantWeight.matmul`): the integer products decode each weight once per four
            input rows, the tiles once per product.
        fused_decode_rows: decode steps of at most this many rows run the compiled decoder
            stack (`decode.decode_layers`), where every product of the step shares one
            parallel region.
        block_decode_rows: `fused_decode_rows` for a model whose weights are in GGML
            blocks: the layer path dequantizes every weight into tiles each step, which
            the stack's integer products never do.
        parallel_work: multiply-adds (rows x weight elements) from which a few rows' product
            is split over every thread where the OpenMP workers sleep between parallel
            calls (waking one costs more than a small product gains).
        prefetch_bytes: how far ahead of the weight row being multiplied its lines are asked
            for, as data read once, in products of several input rows (one row asks for
            each line as it is read: `matvec.products`).
        spin_ticks: cycles a thread of the decoder stack spins waiting for the others
            before it yields its core.
        long_wait_ticks: cycles of waiting after which another thread is taken to be off
            its core (a few such waits in one step: the step finishes on one thread).
    """

    matvec_rows_float32: int = 8
    matvec_rows_bfloat16: int = 4
    tile_rows_bfloat16: int = 128
    block_rows: int = 16
    fused_decode_rows: int = 16
    block_decode_rows: int = 32
    parallel_work: int = 2_000_000
    prefetch_bytes: int = 2048
    spin_ticks: int = 50_000
    long_wait_ticks: int = 3_000_000

    def __post_init__(self) -> None:
        for spec in dataclasses.fields(self):
            value = getattr(self, spec.name)
            if type(value) is not int or value < 0:
                raise ValueError(f"{spec.name}: expected an int >= 0, got {value!r}")

    def matvec_rows(self, dtype_name: str) -> int:
        """The matrix-vector kernel's row limit for weights of `dtype_name` ("float32")."""
        return self.matvec_rows_bfloat16 if dtype_name == "bfloat16" else self.matvec_rows_float32

    def few_rows(self, dtype_name: str, in_blocks: bool) -> int:
        """The row limit of a few-row product: `block_rows` for a weight in GGML blocks,
        else the matrix-vector kernel's for weights of `dtype_name`."""
        return self.block_rows if in_blocks else self.matvec_rows(dtype_name)

    def kernel_knobs(self) -> tuple[int, int, int]:
        """(prefetch_bytes, spin_ticks, long_wait_ticks), as the compiled kernels take them."""
        return self.prefetch_bytes, self.spin_ticks, self.long_wait_ticks

    @classmethod
    def load(cls, path: Path | None = None) -> CpuTuning:
        """The values in `path` (default `tuning_path()`), defaults for those it lacks; all
        defaults where there is no file. An unknown field is ignored with a warning (a file
        from another version).

        Raises:
            ValueError: the file is not a JSON object, or a value is not an int >= 0 (the
                file and the field named).
        """
        path = path or tuning_path()
        try:
            text = path.read_text()
        except FileNotFoundError:
            return cls()
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: expected a JSON object of CPU tuning, got {exc}") from None
        if not isinstance(values, dict):
            raise ValueError(f"{path}: expected a JSON object, got {type(values).__name__}")
        known = {spec.name for spec in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            message = f"{path}: ignoring unknown fields {unknown}"
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        try:
            return cls(**{k: v for k, v in values.items() if k in known})
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None

    def save(self, path: Path | None = None) -> Path:
        """Write these values to `path` (default `tuning_path()`) whole; returns the path."""
        path = path or tuning_path()
        write_whole(path, (json.dumps(dataclasses.asdict(self), indent=2) + "\n").encode())
        return path


def tuning_path() -> Path:
    """Where this machine's tuning lives: the user-wide cache directory."""
    return cache_root() / "cpu-tuning.json"
