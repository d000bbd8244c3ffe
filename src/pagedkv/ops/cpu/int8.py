"""int8 caches in the CPU kernels: a token's scale as float32, and a row quantized as it is
written (the float16 scales reach Numba as their uint16 bits).

`token_scale(scales, slot, g)` is the scale of KV head g at `slot`, and 1 where `scales` is
None (a float cache: the kernels compile the multiply away). `store_row` writes a row into
a cache, quantized as `pagedkv.ops.quantize.quantize` does (same float32 steps, without
fastmath, so both write the same bytes) where `scales` is an array. `prefetch_scales` asks
for a span's scale lines ahead of the loops that read them. Numba's extension API only, as
`bf16.py`.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from pagedkv.ops.cpu.bf16 import as_float32, bits_as_float32, magnitude_bits, prefetch_line
from pagedkv.runtime import kernel_cache

kernel_cache.use_shared_cache()  # before the first `cache=True` decorator

QMAX = 127
FLOAT16_MAX = 65504.0


@intrinsic
def half_bits_as_float32(typingctx, bits):  # pragma: no cover
    """float16 bits (uint16) widened to float32 (exact)."""
    if bits != types.uint16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def float32_to_half_bits(typingctx, x):  # pragma: no cover
    """A float32 rounded to float16 (to nearest even), as its bits (uint16)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


def token_scale(scales, slot, g):  # pragma: no cover
    """The scale of KV head g at `slot` as float32; 1 for a float cache (scales None)."""
    raise NotImplementedError("compiled only")


@overload(token_scale, inline="always")
def _token_scale_impl(scales, slot, g):  # pragma: no cover
    if isinstance(scales, types.NoneType):
        return lambda scales, slot, g: np.float32(1.0)
    if isinstance(scales, types.Array) and scales.dtype == types.uint16:
        return lambda scales, slot, g: half_bits_as_float32(scales[slot, g])
    return None


def prefetch_scales(key_scales, value_scales, slots, first, end):  # pragma: no cover
    """Prefetch the K and V scales of the tokens at slots[first:end] (a line once, as
    consecutive slots share it); nothing where the scales are None. Blocks are scattered,
    so the hardware prefetcher does not find them, and a scale read that misses stalls the
    loop that needs it."""
    raise NotImplementedError("compiled only")


@overload(prefetch_scales, inline="always")
def _prefetch_scales_impl(key_scales, value_scales, slots, first, end):  # pragma: no cover
    if isinstance(key_scales, types.NoneType):
        return lambda key_scales, value_scales, slots, first, end: None
    if isinstance(key_scales, types.Array) and key_scales.dtype == types.uint16:
        return lambda key_scales, value_scales, slots, first, end: _prefetch_scale_lines(
            key_scales, value_scales, slots, first, end
        )
    return None


@njit(inline="always")
def _prefetch_scale_lines(key_scales, value_scales, slots, first, end):  # pragma: no cover
    row = key_scales.shape[1]
    per_line = 64 // key_scales.itemsize
    line = -1
    for i in range(first, end):
        at = slots[i] * row
        if at // per_line != line:
            line = at // per_line
            prefetch_line(key_scales, at)
            prefetch_line(value_scales, at)


def layer_of(pool, layer):  # pragma: no cover
    """pool[layer], or None where `pool` is None."""
    raise NotImplementedError("compiled only")


@overload(layer_of, inline="always")
def _layer_of_impl(pool, layer):  # pragma: no cover
    if isinstance(pool, types.NoneType):
        return lambda pool, layer: None
    if isinstance(pool, types.Array):
        return lambda pool, layer: pool[layer]
    return None


def store_row(cache, scales, slot, g, row):  # pragma: no cover
    """cache[slot, g, :] = row, quantized with its scale into scales[slot, g] where `scales`
    is an array (cache int8); as it is where `scales` is None."""
    raise NotImplementedError("compiled only")


@overload(store_row)
def _store_row_impl(cache, scales, slot, g, row):  # pragma: no cover
    if isinstance(scales, types.NoneType):

        def store(cache, scales, slot, g, row):
            cache[slot, g, :] = row

        return store
    if isinstance(scales, types.Array) and scales.dtype == types.uint16:
        return lambda cache, scales, slot, g, row: _quantize_row(
            cache[slot, g], scales, slot, g, row
        )
    return None


@njit(cache=True)
def store_rows(keys, values, key_cache, value_cache, key_scales, value_scales,
               slots):  # fmt: skip  # pragma: no cover
    """Quantize token t's K and V rows (keys, values: [n, KV, D] float32 or bfloat16 bits)
    into slot slots[t] of the int8 caches ([num_blocks, block_size, KV, D]) and their
    scales ([num_blocks, block_size, KV] float16 bits); tokens whose slot is negative are
    skipped. Returns the first t whose slot lies past the caches, having written nothing,
    else -1."""
    block_size = key_cache.shape[1]
    for t in range(slots.shape[0]):
        if slots[t] >= key_cache.shape[0] * block_size:
            return t
    for t in range(slots.shape[0]):
        if slots[t] < 0:
            continue
        b, at = slots[t] // block_size, slots[t] % block_size
        for g in range(keys.shape[1]):
            _quantize_row(key_cache[b, at, g], key_scales[b], at, g, keys[t, g])
            _quantize_row(value_cache[b, at, g], value_scales[b], at, g, values[t, g])
    return -1


@njit(cache=True)
def _quantize_row(out, scales, slot, g, row):  # pragma: no cover
    """out (int8 [D]) = row quantized; scales[slot, g] = its float16 scale. IEEE float32
    throughout (no fastmath): the bytes match `pagedkv.ops.quantize.quantize`'s."""
    bits = float32_to_half_bits(min(_abs_max(row) / np.float32(QMAX), np.float32(FLOAT16_MAX)))
    scales[slot, g] = bits
    s = half_bits_as_float32(bits)
    if not s > 0:  # an all-zero row (or one with a NaN)
        out[:] = 0
        return
    for d in range(row.shape[0]):
        q = np.rint(as_float32(row[d]) / s)
        out[d] = np.int8(min(max(q, np.float32(-QMAX)), np.float32(QMAX)))


@njit(cache=True)
def _abs_max(row):  # pragma: no cover
    """max |row[d]| as float32 (exact): the largest magnitude's bits, found as integers,
    which LLVM vectorizes (a float maximum it leaves scalar); a NaN's bits win."""
    top = np.uint32(0)
    for d in range(row.shape[0]):
        top = max(top, magnitude_bits(row[d]))
    return bits_as_float32(top)
