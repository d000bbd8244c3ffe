"""GGML blocks (`formats.py`) written out as numbers, read in place: rows of them as
float32 or as bfloat16 (`dequantize_rows`: the reference, an embedding lookup, and the
tiles of a many-row product). NumPy, Numba and its extension API; compiled code cached as
`pagedkv.runtime.kernel_cache` says.

The layouts, by GGML type id (every scale an fp16 `d`; `w` the stored integer):

    Q8_0   d, 32 int8                              d * w
    Q4_0   d, 16 bytes of nibbles                  d * (w - 8)
    Q4_1   d, m, 16 bytes of nibbles               d * w + m
    Q5_0   d, 4 bytes of fifth bits, 16 bytes      d * (w - 16)
    Q5_1   d, m, 4 bytes of fifth bits, 16 bytes   d * w + m
    Q4_K   d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
    Q5_K   as Q4_K, 32 bytes of fifth bits before the nibbles
    Q6_K   128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, d

Weight j of a 32-weight block sits in byte j's low nibble, j + 16 in its high; its fifth
bit is bit j of the little-endian word. A Q4_K / Q5_K block is four runs of 64 weights,
each two sub-blocks of 32 (scale d * s, offset dmin * m) sharing 32 bytes of nibbles (low:
the first, high: the second), Q5_K's fifth bits being bits 2c, 2c + 1 of the 32 bytes. A
Q6_K block is two halves of 128 weights, each 64 bytes of low nibbles, 32 of 2-bit high
pairs and 8 scales (d * s per 16 weights), w - 32. `vectors.py` reads the same lines.

Each line of 32 weights is one vector load of the bytes, its fields taken out as 16-bit
lanes (as `vectors.py` takes them for the integer products), converted to float32 lanes,
scaled (and offset) by its sub-block's floats in the order gguf's own Python dequantizer
multiplies them, so the float32 numbers are the same bits, and stored as one vector:
float32, or rounded to the nearest bfloat16 (ties to even, as torch rounds). Written as a
loop over a block's weights, Numba's code stayed scalar.
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from pagedkv.ops.cpu.bf16 import splat
from pagedkv.runtime import kernel_cache
from pagedkv.runtime.quant.literal import format_switch
from pagedkv.runtime.quant.vectors import (
    K_BLOCKS,
    ROW_BLOCKS,
    fifth_bits,
    half_at,
    i64,
    k_line_weights,
    load_vector,
    nibbles,
    six_bit_fields,
)

kernel_cache.use_shared_cache()  # before the first `cache=True` decorator

_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
_F32 = ir.FloatType()
_N = 32
_SHORTS, _INTS, _WIDE = (ir.VectorType(t, _N) for t in (_I16, _I32, _F32))


def _spread(builder, floats, first, second):  # type: ignore[no-untyped-def]
    """32 lanes of a small float vector: element `first` in the first 16, `second` after."""
    return builder.shuffle_vector(floats, floats, ir.Constant(_INTS, [first] * 16 + [second] * 16))


def _row_block_lines(builder, data, at, type_id):  # type: ignore[no-untyped-def]
    """[(32 float32 lanes, their first weight)] of a Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 block."""
    _, weights_at, offset, has_min, is_bytes, high_at = ROW_BLOCKS[type_id]
    if is_bytes:
        ints = builder.sext(load_vector(builder, data, at, weights_at, _I8, _N), _SHORTS)
    else:
        ints = nibbles(builder, load_vector(builder, data, at, weights_at, _I8, 16))
        if high_at:
            ints = builder.or_(ints, fifth_bits(builder, data, at, high_at))
        ints = builder.sub(ints, ir.Constant(_SHORTS, [offset] * _N))
    d = half_at(builder, data, at)
    floats = builder.fmul(builder.sitofp(ints, _WIDE), splat(builder, d, _N))
    if has_min:
        m = half_at(builder, data, builder.add(at, i64(2)))
        floats = builder.fadd(floats, splat(builder, m, _N))
    return [(floats, 0)]


def _k_block_lines(builder, data, at, type_id):  # type: ignore[no-untyped-def]
    """[(32 float32 lanes, their first weight)] of a Q4_K / Q5_K / Q6_K block."""
    lines, _, nibbles, high_bits, mask, offset, d_at = K_BLOCKS[type_id]
    if offset:  # Q6_K: d * s per 16 weights
        ints = builder.sext(load_vector(builder, data, at, 192, _I8, 16), ir.VectorType(_I16, 16))
        d = half_at(builder, data, builder.add(at, i64(d_at)))
        scales = builder.fmul(builder.sitofp(ints, ir.VectorType(_F32, 16)), splat(builder, d, 16))
        mins = None
    else:  # Q4_K, Q5_K: d * s and dmin * m per 32 weights
        fields = six_bit_fields(builder, data, at)
        d, dmin = (half_at(builder, data, builder.add(at, i64(k))) for k in (0, 2))
        eight = ir.VectorType(_F32, 8)
        scales, mins = (builder.fmul(builder.sitofp(f, eight), splat(builder, s, 8))
                        for f, s in zip(fields, (d, dmin), strict=True))  # fmt: skip

    out = []
    for line in lines:
        first_weight, first, second = line[4:]
        ints = k_line_weights(builder, data, at, line, (nibbles, high_bits, mask, offset))
        floats = builder.fmul(builder.sitofp(ints, _WIDE), _spread(builder, scales, first, second))
        if mins is not None:
            floats = builder.fsub(floats, _spread(builder, mins, first, second))
        out.append((floats, first_weight))
    return out


def _store(builder, pointer, floats, as_bf16):  # type: ignore[no-untyped-def]
    """Store 32 float32 lanes at `pointer`: as they are, or as bfloat16 bits rounded to
    nearest even (finite values: the weights are)."""
    if not as_bf16:
        builder.store(floats, builder.bitcast(pointer, _WIDE.as_pointer()), align=4)
        return
    bits = builder.bitcast(floats, _INTS)
    sixteen = ir.Constant(_INTS, [16] * _N)
    odd = builder.and_(builder.lshr(bits, sixteen), ir.Constant(_INTS, [1] * _N))
    rounded = builder.add(builder.add(bits, ir.Constant(_INTS, [0x7FFF] * _N)), odd)
    halves = builder.trunc(builder.lshr(rounded, sixteen), _SHORTS)
    builder.store(halves, builder.bitcast(pointer, _SHORTS.as_pointer()), align=2)


@intrinsic
def unpack_block(typingctx, q, at, out, out_at, type_id):  # pragma: no cover
    """Write the weights of the block at byte `at` of q (uint8, C-contiguous) into
    out[out_at : out_at + block size]: float32, or bfloat16 bits (uint16). type_id: a
    literal GGML type id."""
    if not (isinstance(q, types.Array) and q.dtype == types.uint8 and q.layout == "C"):
        return None
    if not (isinstance(out, types.Array) and out.layout == "C"
            and out.dtype in (types.float32, types.uint16)):  # fmt: skip
        return None
    if not isinstance(type_id, types.IntegerLiteral):
        return None
    kind = type_id.literal_value
    if kind not in ROW_BLOCKS and kind not in K_BLOCKS:
        return None
    as_bf16 = out.dtype == types.uint16

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        at = context.cast(builder, args[1], sig.args[1], types.int64)
        target = context.make_array(sig.args[2])(context, builder, args[2]).data
        out_at = context.cast(builder, args[3], sig.args[3], types.int64)
        lines = (_row_block_lines if kind in ROW_BLOCKS else _k_block_lines)(
            builder, data, at, kind
        )
        for floats, first_weight in lines:
            pointer = builder.gep(target, [builder.add(out_at, i64(first_weight))])
            _store(builder, pointer, floats, as_bf16)
        return context.get_dummy_value()

    return types.none(q, at, out, out_at, type_id), codegen


@njit(inline="always")
def _unpack_blocks(type_id, args):  # pragma: no cover
    """Every block of a row into out; args: (row, block_size, block_bytes, out)."""
    row, block_size, block_bytes, out = args
    for b in range(out.shape[0] // block_size):
        unpack_block(row, b * block_bytes, out, b * block_size, type_id)


_unpack_row = format_switch(_unpack_blocks)


@njit(cache=True, parallel=True)
def dequantize_rows(blocks, type_id, block_size, block_bytes, row_ids, out):  # pragma: no cover
    """out[i] = row `row_ids[i]` of `blocks`, split over the threads by rows.

    blocks: uint8 [rows, row_bytes]; row_ids: int64 [n]; out: [n, in_features], float32,
    or bfloat16 bits (uint16), C-contiguous.
    """
    for i in prange(row_ids.shape[0]):
        _unpack_row(type_id, (blocks[row_ids[i]], block_size, block_bytes, out[i]))
