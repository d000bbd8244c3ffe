"""Dot products of a few packed weights with float32 activations, as whole LLVM vectors.

A block format's sub-block is 16 or 32 weights. Written as a loop, LLVM either unrolls it
into scalar code (it cannot prove that the two arrays do not overlap) or vectorizes it for
more elements per iteration than the loop has, and the block stays scalar. Here each call
is one vector load of the bytes, the field taken out of every byte (a shift and a mask, or
a sign extension), a conversion, a multiply with the activations and a sum across the
lanes. Numba's extension API only (`numba.extending.intrinsic`, llvmlite's IR builder).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_F32, _I8, _I32, _I64 = ir.FloatType(), ir.IntType(8), ir.IntType(32), ir.IntType(64)


def _element_pointer(context, builder, arr_type, arr, offset, offset_type, to):  # type: ignore[no-untyped-def]
    """Address of element `offset` of a C-contiguous array, as a pointer to `to`."""
    data = context.make_array(arr_type)(context, builder, arr).data
    index = context.cast(builder, offset, offset_type, types.int64)
    return builder.bitcast(builder.gep(data, [index]), to.as_pointer())


def _lane_sum(builder, vector, width):  # type: ignore[no-untyped-def]
    """The float sum of a vector's lanes, halves added (log2(width) steps)."""
    while width > 1:
        width //= 2
        halves = [builder.shuffle_vector(vector, vector, ir.Constant(
            ir.VectorType(_I32, width), list(range(start, start + width))))
            for start in (0, width)]  # fmt: skip
        vector = builder.fadd(*halves)
    return builder.extract_element(vector, ir.Constant(_I32, 0))


def _is_row(arr, dtype) -> bool:  # type: ignore[no-untyped-def]
    return isinstance(arr, types.Array) and arr.dtype == dtype and arr.layout == "C"


@intrinsic
def dot_field(typingctx, q, q_at, x, x_at, width, shift, mask):  # pragma: no cover
    """The float32 sum over k < width of ((q[q_at + k] >> shift) & mask) * x[x_at + k].

    q: uint8, x: float32, both C-contiguous; width (16 or 32) and mask: literals; shift: a
    literal where it can be (a constant vector; a run-time shift costs about twice)."""
    if not (_is_row(q, types.uint8) and _is_row(x, types.float32)):
        return None
    if not (isinstance(width, types.IntegerLiteral) and isinstance(mask, types.IntegerLiteral)):
        return None
    if width.literal_value not in (16, 32) or not isinstance(shift, types.Integer):
        return None
    n, fixed = width.literal_value, getattr(shift, "literal_value", None)

    def codegen(context, builder, sig, args):
        ints = ir.VectorType(_I32, n)
        raw = builder.load(
            _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1],
                             ir.VectorType(_I8, n)), align=1)  # fmt: skip
        if fixed is None:
            amount = builder.trunc(context.cast(builder, args[5], sig.args[5], types.int64), _I32)
            one = builder.insert_element(ir.Constant(ints, None), amount, ir.Constant(_I32, 0))
            shift_v = builder.shuffle_vector(one, one, ir.Constant(ints, [0] * n))
        else:
            shift_v = ir.Constant(ints, [fixed] * n)
        field = builder.and_(
            builder.lshr(builder.zext(raw, ints), shift_v),
            ir.Constant(ints, [mask.literal_value] * n),
        )
        return _times_x(
            context, builder, sig, args, builder.sitofp(field, ir.VectorType(_F32, n)), n
        )

    return types.float32(q, q_at, x, x_at, width, shift, mask), codegen


@intrinsic
def dot_int8(typingctx, q, q_at, x, x_at, width):  # pragma: no cover
    """The float32 sum over k < width of int8(q[q_at + k]) * x[x_at + k] (q: uint8 bytes
    read as int8; width a literal 32)."""
    if not (_is_row(q, types.uint8) and _is_row(x, types.float32)):
        return None
    if not isinstance(width, types.IntegerLiteral) or width.literal_value != 32:
        return None
    n = 32

    def codegen(context, builder, sig, args):
        raw = builder.load(
            _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1],
                             ir.VectorType(_I8, n)), align=1)  # fmt: skip
        values = builder.sitofp(raw, ir.VectorType(_F32, n))
        return _times_x(context, builder, sig, args, values, n)

    return types.float32(q, q_at, x, x_at, width), codegen


def _times_x(context, builder, sig, args, values, n, at=2):  # type: ignore[no-untyped-def]
    """sum(values * x[x_at : x_at + n]) for the intrinsics' args (x at `at`, x_at next)."""
    floats = ir.VectorType(_F32, n)
    xs = builder.load(
        _element_pointer(
            context, builder, sig.args[at], args[at], args[at + 1], sig.args[at + 1], floats
        ),
        align=4,
    )
    return _lane_sum(builder, builder.fmul(values, xs), n)


@intrinsic
def dot_nibbles(typingctx, q, q_at, x, x_at):  # pragma: no cover
    """The float32 sum over k < 16 of (q[q_at + k] & 15) * x[x_at + k] +
    (q[q_at + k] >> 4) * x[x_at + 16 + k]: 16 bytes of Q4_0 / Q4_1 nibbles, 32 weights."""
    if not (_is_row(q, types.uint8) and _is_row(x, types.float32)):
        return None

    def codegen(context, builder, sig, args):
        raw = builder.load(
            _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1],
                             ir.VectorType(_I8, 16)), align=1)  # fmt: skip
        wide = builder.zext(raw, ir.VectorType(_I32, 16))
        low = builder.and_(wide, ir.Constant(ir.VectorType(_I32, 16), [15] * 16))
        high = builder.lshr(wide, ir.Constant(ir.VectorType(_I32, 16), [4] * 16))
        both = builder.shuffle_vector(
            low, high, ir.Constant(ir.VectorType(_I32, 32), list(range(32)))
        )
        return _times_x(
            context, builder, sig, args, builder.sitofp(both, ir.VectorType(_F32, 32)), 32
        )

    return types.float32(q, q_at, x, x_at), codegen


@intrinsic
def dot_six_bits(
    typingctx, q, low_at, high_at, x, x_at, low_shift, high_shift, first, second
):  # pragma: no cover
    """Q6_K's 6-bit weights w_k = ((q[low_at + k] >> low_shift) & 15) |
    (((q[high_at + k] >> high_shift) & 3) << 4) for k < 32: the float32 sum of s_k * w_k *
    x[x_at + k], s_k = `first` for k < 16 and `second` past it (each run of 16 has its own
    scale). Shifts are literals; the scales float32."""
    if not (_is_row(q, types.uint8) and _is_row(x, types.float32)):
        return None
    if not all(isinstance(s, types.IntegerLiteral) for s in (low_shift, high_shift)):
        return None
    shifts = (low_shift.literal_value, high_shift.literal_value)
    n = 32

    def codegen(context, builder, sig, args):
        ints, floats = ir.VectorType(_I32, n), ir.VectorType(_F32, n)

        def field(at_index, shift, mask):
            raw = builder.load(
                _element_pointer(context, builder, sig.args[0], args[0], args[at_index],
                                 sig.args[at_index], ir.VectorType(_I8, n)), align=1)  # fmt: skip
            wide = builder.lshr(builder.zext(raw, ints), ir.Constant(ints, [shift] * n))
            return builder.and_(wide, ir.Constant(ints, [mask] * n))

        high = builder.shl(field(2, shifts[1], 3), ir.Constant(ints, [4] * n))
        values = builder.sitofp(builder.or_(field(1, shifts[0], 15), high), floats)
        pair = builder.insert_element(
            ir.Constant(ir.VectorType(_F32, 2), None), args[7], ir.Constant(_I32, 0)
        )
        pair = builder.insert_element(pair, args[8], ir.Constant(_I32, 1))
        scales = builder.shuffle_vector(pair, pair, ir.Constant(ints, [0] * 16 + [1] * 16))
        return _times_x(context, builder, sig, args, builder.fmul(values, scales), n, at=3)

    signature = types.float32(q, low_at, high_at, x, x_at, low_shift, high_shift, first, second)
    return signature, codegen
