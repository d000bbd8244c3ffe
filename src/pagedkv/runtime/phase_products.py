"""The products of the decoder stack's phases (`stack.py`) from either kind of weight it
reads: a plain matrix (`matvec.products`), or GGML blocks read in place
(`dots.block_products`). The kind is the weights' Numba type: the stack compiles once for
each, and a model's executor picks it once, when the model is built.

A weight in blocks is a tuple of `MAX_PARTS` parts, each (blocks: uint8 [rows,
row_bytes], read-only; GGML type id; block size; block bytes): consecutive output rows in
one format (`QuantWeight.parts`: a Q4_K_M file's q|k|v mixes Q4_K and Q6_K), the unused
ones without rows, so that every projection of a model is one type.

Before its first chunk of a phase each thread quantizes the phase's input rows into its
own buffers (`phase_input`), with the functions `QuantWeight.few_rows` calls, in the groups
of the formats that the phase's weight holds; a chunk's outputs are then summed into float32
(`dots.block_products`), the bias added and the sum rounded to the rows' dtype as the
layer-by-layer path does.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from pagedkv.ops.cpu.bf16 import as_float32
from pagedkv.runtime import kernel_cache
from pagedkv.runtime.matvec import narrow, products
from pagedkv.runtime.quant import dots
from pagedkv.runtime.quant.weight import QuantWeight

kernel_cache.use_shared_cache()  # before the first `cache=True` decorator

MAX_PARTS = 3
"""Parts of a weight in blocks: q|k|v's three."""
_LEVELS_32, _LEVELS_256 = dots.LEVELS[32], dots.LEVELS[256]

BlockParts = tuple[tuple[np.ndarray, int, int, int], ...]
"""A weight in blocks as the stack reads it (see the module's docstring)."""


def block_parts(weight: QuantWeight, name: str) -> BlockParts:
    """`weight`'s parts as the stack reads them, padded to `MAX_PARTS` with parts of no rows.

    Raises:
        ValueError: `weight` has more than `MAX_PARTS` parts.
    """
    if len(weight.parts) > MAX_PARTS:
        raise ValueError(f"{name}: expected at most {MAX_PARTS} parts, got {len(weight.parts)}")
    parts = []
    for part in weight.parts:
        blocks = part.blocks.view()
        blocks.flags.writeable = False  # one Numba type: a mapped file's bytes are read-only
        f = part.format
        parts.append((blocks, f.type_id, f.block_size, f.block_bytes))
    first = parts[0]
    parts += [(first[0][:0], *first[1:])] * (MAX_PARTS - len(parts))
    return tuple(parts)


def without_rows(weight: np.ndarray | BlockParts) -> np.ndarray | BlockParts:
    """The weight with no output rows (an LM head left to the caller)."""
    if isinstance(weight, np.ndarray):
        return weight[:0]
    return tuple((part[0][:0], *part[1:]) for part in weight)


def num_rows(weight: np.ndarray | BlockParts) -> int:
    """The weight's output rows (`out_features` outside compiled code)."""
    if isinstance(weight, np.ndarray):
        return int(weight.shape[0])
    return sum(int(part[0].shape[0]) for part in weight)


def out_features(weight):  # pragma: no cover
    """A weight's output rows (compiled only)."""
    raise NotImplementedError("compiled only")


def in_features(weight):  # pragma: no cover
    """A weight's input features (compiled only)."""
    raise NotImplementedError("compiled only")


@overload(out_features)
def _out_features_impl(weight):  # pragma: no cover
    if isinstance(weight, types.Array):
        return lambda weight: weight.shape[0]

    def total_rows(weight):
        rows = 0
        for part in weight:
            rows += part[0].shape[0]
        return rows

    return total_rows


@overload(in_features)
def _in_features_impl(weight):  # pragma: no cover
    if isinstance(weight, types.Array):
        return lambda weight: weight.shape[1]
    return lambda weight: weight[0][0].shape[1] // weight[0][3] * weight[0][2]


BLOCK_CHUNK_SCALE = 4
"""How many times a plain weight's multiply-adds a chunk of blocks holds: a block weight is
a quarter to a half of float32's bytes, and a chunk's fixed costs (its claim, the parts
looked up, the format branched on) stay those of a chunk of the same bytes."""


def chunk_work(weight, work):  # pragma: no cover
    """Multiply-adds per input row in a claimed chunk of `weight`'s product, for plain
    weights `work` (compiled only)."""
    raise NotImplementedError("compiled only")


@overload(chunk_work)
def _chunk_work_impl(weight, work):  # pragma: no cover
    if isinstance(weight, types.Array):
        return lambda weight, work: work
    return lambda weight, work: work * BLOCK_CHUNK_SCALE


def input_buffers(weight, threads, rows, size, width):  # pragma: no cover
    """Each thread's buffers for `phase_input` and `phase_products` (compiled only):
    (xq32, xd32, xq256, xd256, sums, chunk), each [threads, n] for inputs of up to `rows`
    rows of `size` features and chunks of up to `width` outputs; empty for plain weights."""
    raise NotImplementedError("compiled only")


@overload(input_buffers)
def _input_buffers_impl(weight, threads, rows, size, width):  # pragma: no cover
    blocks = not isinstance(weight, types.Array)

    def make(weight, threads, rows, size, width):
        n = rows * size if blocks else 0
        return (
            np.empty((threads, n), dtype=np.int16),
            np.empty((threads, n // 32), dtype=np.float32),
            np.empty((threads, n), dtype=np.int16),
            np.empty((threads, n // 256), dtype=np.float32),
            np.empty((threads, n // 32), dtype=np.float32),
            np.empty((threads, rows * width if blocks else 0), dtype=np.float32),
        )

    return make


def phase_input(x, weight, buffers, active):  # pragma: no cover
    """A phase's input as its products take it (compiled only): x itself for a plain
    weight; for blocks, x quantized (where `active`) into this thread's `buffers` (one row
    of each of `input_buffers`), as (xq32, xd32, xq256, xd256, sums) for `block_products`.

    x: [rows, in_features] in the model's dtype (float32, or bfloat16 bits).
    """
    raise NotImplementedError("compiled only")


@overload(phase_input)
def _phase_input_impl(x, weight, buffers, active):  # pragma: no cover
    if isinstance(weight, types.Array):
        return lambda x, weight, buffers, active: x
    return lambda x, weight, buffers, active: _quantize_input(x, weight, buffers, active)


@njit(cache=True)
def _quantize_input(x, parts, buffers, active):  # pragma: no cover
    rows, size = x.shape
    xq32 = buffers[0][: rows * size].reshape(rows, size)
    xd32 = buffers[1][: rows * (size // 32)].reshape(rows, size // 32)
    xq256 = buffers[2][: rows * size].reshape(rows, size)
    xd256 = buffers[3][: rows * (size // 256)].reshape(rows, size // 256)
    sums = buffers[4][: rows * (size // 32)].reshape(rows, size // 32)
    if active:
        by_32 = by_256 = False
        for part in parts:
            if part[0].shape[0]:
                by_32 = by_32 or part[2] == 32
                by_256 = by_256 or part[2] == 256
        if by_32:
            dots.quantize_into(x, 32, _LEVELS_32, xq32, xd32)
        if by_256:
            dots.quantize_into(x, 256, _LEVELS_256, xq256, xd256)
        dots.sums_into(x, sums)
    return xq32, xd32, xq256, xd256, sums


def phase_products(source, weight, bias, out, first, end, prefetch, chunk):  # pragma: no cover
    """out[:, n] = source . weight[n] (+ bias[n]) for first <= n < end (compiled only).

    source: `phase_input`'s; bias: [out_features] or empty; out: [rows, >= end] in the
    model's dtype; prefetch: `matvec.products`'; chunk: float32 [>= rows * (end - first)],
    this thread's (blocks only).
    """
    raise NotImplementedError("compiled only")


@overload(phase_products)
def _phase_products_impl(
    source, weight, bias, out, first, end, prefetch, chunk
):  # pragma: no cover
    if isinstance(weight, types.Array):
        return lambda source, weight, bias, out, first, end, prefetch, chunk: products(
            source, weight, bias, out, first, end, prefetch)  # fmt: skip
    return lambda source, weight, bias, out, first, end, prefetch, chunk: _block_rows(
        source, weight, bias, out, first, end, chunk)  # fmt: skip


@njit(cache=True, fastmath=True)
def _block_rows(source, parts, bias, out, first, end, chunk):  # pragma: no cover
    xq32, xd32, xq256, xd256, sums = source
    rows, width = out.shape[0], end - first
    sums_of = chunk[: rows * width].reshape(rows, width)
    start = 0  # the part's first row in the weight
    for part in parts:
        blocks, type_id, block_size, block_bytes = part
        lo, hi = max(first, start), min(end, start + blocks.shape[0])
        if lo < hi:
            xq, xd = (xq32, xd32) if block_size == 32 else (xq256, xd256)
            # the part's row n lands in column (start - first) + n >= 0 of sums_of
            dots.block_products(xq, xd, sums, blocks, type_id, block_size, block_bytes,
                                sums_of, start - first, lo - start, hi - start)  # fmt: skip
        start += blocks.shape[0]
    for r in range(rows):
        for n in range(first, end):
            total = sums_of[r, n - first]
            if bias.shape[0]:
                total += as_float32(bias[n])
            out[r, n] = narrow(total, out)
