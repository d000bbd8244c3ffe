"""Integer products of packed weights with activations quantized to integers, as whole LLVM
vectors: a K-quant block (`idot_k_block`, with `k_mins_dot`), a whole row of Q8_0, Q4_0,
Q4_1, Q5_0 or Q5_1 blocks (`dot_row`), and a block's fp16 scale (`half`).

A block format's sub-block is 16 or 32 weights. Written as a loop, LLVM either unrolls it
into scalar code (it cannot prove that the two arrays do not overlap) or vectorizes it for
more elements per iteration than the loop has, and the block stays scalar. Here each line
of 32 weights is one vector load of the bytes, the field taken out of every byte (a shift
and a mask, or a sign extension) as 16-bit lanes, the sub-blocks' integer scales
multiplied in, and one multiply-add of pairs with the activations (`vpmaddwd` where the
CPU has AVX512-BW: 32 products summed into 16 int32 lanes). A K-quant block's lines are
added as vectors and summed across the lanes once. The activations are int16 lanes
(`dots.quantize_rows`, at most `dots.LEVELS` in magnitude, so that no sum overflows): the
float scales are applied once per block. Numba's extension API only (`numba.extending.intrinsic`,
llvmlite's IR builder).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils, codegen, config
from numba.extending import intrinsic

_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
_N = 32
_SHORTS, _INTS = ir.VectorType(_I16, _N), ir.VectorType(_I32, _N)
_PAIRS, _FLOATS = ir.VectorType(_I32, 16), ir.VectorType(ir.FloatType(), 16)

# The features Numba compiles for, as `pagedkv.ops.cpu.bf16.HAS_DOT` reads them.
_FEATURES = config.CPU_FEATURES or codegen.get_host_cpu_features()  # type: ignore[attr-defined]
HAS_MADD = "+avx512bw" in _FEATURES.split(",")
"""Whether the CPU has AVX512-BW's `vpmaddwd` on 512-bit vectors; elsewhere LLVM lowers the
same sum from 32-bit products."""


def _declare(module: ir.Module, name: str, ret: ir.Type, params: list[ir.Type]) -> ir.Function:
    return module.globals.get(name) or ir.Function(module, ir.FunctionType(ret, params), name)


def _madd(builder, weights, xs):  # type: ignore[no-untyped-def]
    """16 int32 lanes, lane j = weights[2j] * xs[2j] + weights[2j + 1] * xs[2j + 1], from 32
    int16 lanes (each product and pair sum fits an int32)."""
    if HAS_MADD:
        madd = _declare(builder.module, "llvm.x86.avx512.pmaddw.d.512", _PAIRS, [_SHORTS] * 2)
        return builder.call(madd, [weights, xs])
    products = builder.mul(builder.sext(weights, _INTS), builder.sext(xs, _INTS))
    even, odd = (builder.shuffle_vector(products, products, ir.Constant(
        ir.VectorType(_I32, 16), list(range(start, _N, 2)))) for start in (0, 1))  # fmt: skip
    return builder.add(even, odd)


def _int_sum(builder, pairs):  # type: ignore[no-untyped-def]
    reduce = _declare(builder.module, "llvm.vector.reduce.add.v16i32", _I32, [_PAIRS])
    return builder.call(reduce, [pairs])


def _is_row(arr, dtype) -> bool:  # type: ignore[no-untyped-def]
    return isinstance(arr, types.Array) and arr.dtype == dtype and arr.layout == "C"


# A K-quant block's lines of 32 weights, by format (GGML type id): (the low nibbles' byte
# offset, their shift, the high bits' byte offset, their shift, the lines' activations'
# offset, the scales' indices for the first and second 16). `blocks.py` has the layouts.
_Q45_LINES = [(32 * c, 4 * h, 0, 2 * c + h, 64 * c + 32 * h, 2 * c + h, 2 * c + h)
              for c in range(4) for h in range(2)]  # fmt: skip
_Q6_LINES = [(64 * p + low, low_shift, 128 + 32 * p, high_shift, 128 * p + x,
              8 * p + 2 * i, 8 * p + 2 * i + 1)
             for p in range(2)
             for i, (low, low_shift, high_shift, x) in enumerate(
                 ((0, 0, 0, 0), (32, 0, 2, 32), (0, 4, 4, 64), (32, 4, 6, 96)))]  # fmt: skip
# (the lines, the nibbles' and the high bits' offsets in a block, the high bits' mask (0:
# none), the weights' offset)
_K_BLOCKS = {
    12: (_Q45_LINES, 16, 0, 0, 0),
    13: (_Q45_LINES, 48, 16, 1, 0),
    14: (_Q6_LINES, 0, 0, 3, 32),
}


@intrinsic
def idot_k_block(typingctx, q, at, xq, x_at, type_id):  # pragma: no cover
    """The int32 sum over the 256 weights of a K-quant block at byte `at` of q of s_k *
    (w_k - offset) * xq[x_at + k]: w_k its 4-bit (Q4_K), 5-bit (Q5_K) or 6-bit (Q6_K)
    weights, offset 32 for Q6_K (0 else), s_k the integer scale of weight k's run of 32
    (Q4_K, Q5_K: 8 of 6 bits, `_six_bit_fields`) or 16 (Q6_K: 16 int8). type_id: a literal
    GGML type id. The scales are decoded as one vector, each line's pair of them spread
    over its lanes by a shuffle; the lines' products are summed as vectors and across the
    lanes once."""
    if not (_is_row(q, types.uint8) and _is_row(xq, types.int16)):
        return None
    if not (isinstance(type_id, types.IntegerLiteral) and type_id.literal_value in _K_BLOCKS):
        return None
    lines, nibbles, high_bits, mask, offset = _K_BLOCKS[type_id.literal_value]

    def codegen(context, builder, sig, args):
        base = context.cast(builder, args[1], sig.args[1], types.int64)
        x_base = context.cast(builder, args[3], sig.args[3], types.int64)
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        if offset:  # Q6_K: 16 signed bytes after the weights' bits
            scales = builder.sext(_load_vector(builder, data, base, 192, _I8, 16),
                                  ir.VectorType(_I16, 16))  # fmt: skip
        else:
            scales = _six_bit_fields(builder, data, base)[0]

        def field(at, shift, field_mask):
            raw = builder.zext(_load_bytes(context, builder, sig, args, base, at), _SHORTS)
            raw = builder.lshr(raw, ir.Constant(_SHORTS, [shift] * _N))
            return builder.and_(raw, ir.Constant(_SHORTS, [field_mask] * _N))

        total = None
        for low, low_shift, high, high_shift, x, first, second in lines:
            weights = field(nibbles + low, low_shift, 15)
            if mask:
                bits = field(high_bits + high, high_shift, mask)
                weights = builder.or_(weights, builder.shl(bits, ir.Constant(_SHORTS, [4] * _N)))
            weights = builder.sub(weights, ir.Constant(_SHORTS, [offset] * _N))
            spread = ir.Constant(_INTS, [first] * 16 + [second] * 16)
            scale = builder.shuffle_vector(scales, scales, spread)
            xs = _load_shorts(context, builder, sig, args, builder.add(x_base, _i64(x)))
            pairs = _madd(builder, builder.mul(weights, scale), xs)
            total = pairs if total is None else builder.add(total, pairs)
        return _int_sum(builder, total)

    return types.int32(q, at, xq, x_at, type_id), codegen


def _load_vector(builder, data, base, at, element, n):  # type: ignore[no-untyped-def]
    """n elements from byte base + at (an int64 and a constant) of the uint8 pointer data."""
    pointer = builder.gep(data, [builder.add(base, _i64(at))])
    return builder.load(builder.bitcast(pointer, ir.VectorType(element, n).as_pointer()), align=1)


def _six_bit_fields(builder, data, base):  # type: ignore[no-untyped-def]
    """(scales, mins), 8 int16 lanes each, of the Q4_K / Q5_K block at byte `base`: its 12
    bytes q at base + 4 hold scale j in q[j] & 63 and min j in q[j + 4] & 63 for j < 4,
    and for j >= 4 their low 4 bits in q[j + 4]'s nibbles, their top 2 in q[j - 4] and
    q[j]'s top bits (`blocks.scale_min`). As lanes: a = q[0..7], b = q[4..11]."""
    eight = ir.VectorType(_I16, 8)
    a = builder.zext(_load_vector(builder, data, base, 4, _I8, 8), eight)
    b = builder.zext(_load_vector(builder, data, base, 8, _I8, 8), eight)

    def splat(value):  # type: ignore[no-untyped-def]
        return ir.Constant(eight, [value] * 8)

    def top_bits(v):  # type: ignore[no-untyped-def]
        return builder.shl(builder.lshr(v, splat(6)), splat(4))

    a_first = builder.shuffle_vector(a, a, ir.Constant(ir.VectorType(_I32, 8), [0, 1, 2, 3] * 2))
    low_four = ir.Constant(ir.VectorType(_I32, 8), [0, 1, 2, 3, 12, 13, 14, 15])
    scales = builder.or_(builder.and_(b, splat(15)), top_bits(a_first))
    mins = builder.or_(builder.lshr(b, splat(4)), top_bits(a))
    return (builder.shuffle_vector(builder.and_(a, splat(63)), scales, low_four),
            builder.shuffle_vector(builder.and_(b, splat(63)), mins, low_four))  # fmt: skip


@intrinsic
def k_mins_dot(typingctx, q, at, sums, s_at):  # pragma: no cover
    """The float32 sum over j < 8 of m_j * sums[s_at + j]: the 6-bit mins m_j of the Q4_K /
    Q5_K block at byte `at` of q (`_six_bit_fields`) by float32 sums of its runs of 32
    activations, as 8 lanes summed once."""
    if not (_is_row(q, types.uint8) and _is_row(sums, types.float32)):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        base = context.cast(builder, args[1], sig.args[1], types.int64)
        mins = _six_bit_fields(builder, data, base)[1]
        eight = ir.VectorType(ir.FloatType(), 8)
        floats = context.make_array(sig.args[2])(context, builder, args[2]).data
        index = context.cast(builder, args[3], sig.args[3], types.int64)
        pointer = builder.bitcast(builder.gep(floats, [index]), eight.as_pointer())
        products = builder.fmul(builder.sitofp(mins, eight), builder.load(pointer, align=4))
        name = "llvm.vector.reduce.fadd.v8f32"
        reduce = _declare(builder.module, name, ir.FloatType(), [ir.FloatType(), eight])
        return builder.call(reduce, [ir.Constant(ir.FloatType(), 0.0), products],
                            fastmath=("reassoc",))  # fmt: skip

    return types.float32(q, at, sums, s_at), codegen


def _i64(value: int) -> ir.Constant:
    return ir.Constant(ir.IntType(64), value)


def _load_bytes(context, builder, sig, args, base, at):  # type: ignore[no-untyped-def]
    """32 bytes of the uint8 array args[0] from offset base + at (an int64 and a constant)."""
    data = context.make_array(sig.args[0])(context, builder, args[0]).data
    pointer = builder.gep(data, [builder.add(base, _i64(at))])
    return builder.load(builder.bitcast(pointer, ir.VectorType(_I8, _N).as_pointer()), align=1)


def _load_shorts(context, builder, sig, args, index):  # type: ignore[no-untyped-def]
    """32 int16 of args[2] from the int64 offset `index`."""
    data = context.make_array(sig.args[2])(context, builder, args[2]).data
    pointer = builder.bitcast(builder.gep(data, [index]), _SHORTS.as_pointer())
    return builder.load(pointer, align=2)


# The formats of 32 weights a block that `dot_row` multiplies, by GGML type id: (bytes per
# block, the weights' byte offset, the weights' offset (Q4_0's 8, Q5_0's 16), whether a float
# offset m follows the scale (Q4_1, Q5_1), whether the weights are int8 bytes (Q8_0) or
# nibbles, the byte offset of the 32 fifth bits of Q5_0 / Q5_1 (0: none)).
_ROW_BLOCKS = {
    8: (34, 2, 0, False, True, 0),
    2: (18, 2, 8, False, False, 0),
    3: (20, 4, 0, True, False, 0),
    6: (22, 6, 16, False, False, 2),
    7: (24, 8, 0, True, False, 4),
}


@intrinsic
def dot_row(typingctx, q, xq, xd, sums, type_id):  # pragma: no cover
    """The float32 sum over the blocks b of a Q8_0, Q4_0, Q4_1, Q5_0 or Q5_1 row q (uint8)
    of d_b * xd[b] * sum_k (w_bk - offset) * xq[32 b + k] (+ m_b * sums[b] for Q4_1 /
    Q5_1): the row's product with activations quantized in groups of 32 (xq: int16 [blocks *
    32], xd: float32 [blocks]; sums: float32 [blocks], each group's sum). w: Q8_0's int8
    weights, or the nibbles (weight j of a block in byte j's low nibble, j + 16 in its high;
    Q4_0's offset 8), with Q5_0 / Q5_1's fifth bit of weight j in bit j of a 32-bit word
    (Q5_0's offset 16). type_id: a literal GGML type id. Each block's 16 lanes of pair sums
    are converted and multiplied by the block's two scales into float32 lanes, summed
    across the lanes once (no sum across the lanes per block)."""
    if not (_is_row(q, types.uint8) and _is_row(xq, types.int16) and _is_row(xd, types.float32)):
        return None
    if not (isinstance(type_id, types.IntegerLiteral) and type_id.literal_value in _ROW_BLOCKS):
        return None
    stride, weights_at, offset, has_min, is_bytes, high_at = _ROW_BLOCKS[type_id.literal_value]

    def codegen(context, builder, sig, args):
        data = [context.make_array(t)(context, builder, a).data for t, a in
                zip(sig.args[:4], args[:4], strict=True)]  # fmt: skip
        count = builder.extract_value(
            context.make_array(sig.args[2])(context, builder, args[2]).shape, 0
        )
        total = cgutils.alloca_once_value(builder, ir.Constant(_FLOATS, None))
        offsets = cgutils.alloca_once_value(builder, ir.Constant(ir.FloatType(), 0.0))
        with cgutils.for_range(builder, count) as loop:
            at = builder.mul(loop.index, _i64(stride))
            scale = builder.fmul(_half(builder, data[0], at), builder.load(builder.gep(
                data[2], [loop.index])))  # fmt: skip
            if is_bytes:
                weights = builder.sext(_load_vector(builder, data[0], at, weights_at, _I8, _N),
                                       _SHORTS)  # fmt: skip
            else:
                weights = _nibbles(builder, _load_vector(builder, data[0], at, weights_at, _I8, 16))
                if high_at:
                    weights = builder.or_(weights, _fifth_bits(builder, data[0], at, high_at))
                weights = builder.sub(weights, ir.Constant(_SHORTS, [offset] * _N))
            pointer = builder.gep(data[1], [builder.mul(loop.index, _i64(_N))])
            xs = builder.load(builder.bitcast(pointer, _SHORTS.as_pointer()), align=2)
            pairs = builder.sitofp(_madd(builder, weights, xs), _FLOATS)
            scaled = builder.fmul(pairs, _splat_float(builder, scale))
            builder.store(builder.fadd(builder.load(total), scaled), total)
            if has_min:
                shift = builder.fmul(_half(builder, data[0], builder.add(at, _i64(2))),
                                     builder.load(builder.gep(data[3], [loop.index])))  # fmt: skip
                builder.store(builder.fadd(builder.load(offsets), shift), offsets)
        return builder.fadd(_float_sum(builder, builder.load(total)), builder.load(offsets))

    return types.float32(q, xq, xd, sums, type_id), codegen


def _nibbles(builder, packed):  # type: ignore[no-untyped-def]
    """32 int16 lanes from 16 bytes: byte j's low nibble in lane j, its high in j + 16."""
    half_type = ir.VectorType(_I16, 16)
    wide = builder.zext(packed, half_type)
    low = builder.and_(wide, ir.Constant(half_type, [15] * 16))
    high = builder.lshr(wide, ir.Constant(half_type, [4] * 16))
    return builder.shuffle_vector(low, high, ir.Constant(_INTS, list(range(_N))))


def _fifth_bits(builder, data, base, at):  # type: ignore[no-untyped-def]
    """32 int16 lanes, lane j 16 where bit j of the little-endian 32-bit word at byte base +
    at of a uint8 pointer is set, else 0: the word in every lane, tested against 1 << j."""
    pointer = builder.bitcast(builder.gep(data, [builder.add(base, _i64(at))]), _I32.as_pointer())
    word = builder.load(pointer, align=1)
    one = builder.insert_element(ir.Constant(_INTS, None), word, ir.Constant(_I32, 0))
    spread = builder.shuffle_vector(one, one, ir.Constant(_INTS, [0] * _N))
    bits = builder.and_(spread, ir.Constant(_INTS, [1 << j for j in range(_N)]))
    is_set = builder.icmp_unsigned("!=", bits, ir.Constant(_INTS, [0] * _N))
    return builder.select(is_set, ir.Constant(_SHORTS, [16] * _N), ir.Constant(_SHORTS, [0] * _N))


def _half(builder, data, at):  # type: ignore[no-untyped-def]
    """The IEEE half-precision number at byte `at` of a uint8 pointer, as a float: its
    magnitude's bits moved into a float's and scaled by 2^112 (exact for subnormals too),
    infinities and NaNs kept, the sign put back. In integer registers: the conversion
    instruction merges into a vector register and chained each Q8_0 block to the sum of the
    one before."""
    bits = builder.load(builder.bitcast(builder.gep(data, [at]), _I16.as_pointer()), align=1)
    wide = builder.zext(bits, _I32)
    magnitude = builder.shl(builder.and_(wide, ir.Constant(_I32, 0x7FFF)), ir.Constant(_I32, 13))
    top = builder.icmp_unsigned(">=", magnitude, ir.Constant(_I32, 0x0F800000))
    magnitude = builder.select(top, builder.or_(magnitude, ir.Constant(_I32, 0x7F800000)),
                               magnitude)  # fmt: skip
    scaled = builder.fmul(builder.bitcast(magnitude, ir.FloatType()),
                          ir.Constant(ir.FloatType(), 2.0**112))  # fmt: skip
    sign = builder.shl(builder.and_(wide, ir.Constant(_I32, 0x8000)), ir.Constant(_I32, 16))
    return builder.bitcast(builder.or_(builder.bitcast(scaled, _I32), sign), ir.FloatType())


def _splat_float(builder, value):  # type: ignore[no-untyped-def]
    one = builder.insert_element(ir.Constant(_FLOATS, None), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(_I32, 16), [0] * 16))


def _float_sum(builder, vector):  # type: ignore[no-untyped-def]
    """The sum of 16 float lanes, in any order (LLVM adds halves)."""
    name = "llvm.vector.reduce.fadd.v16f32"
    reduce = _declare(builder.module, name, ir.FloatType(), [ir.FloatType(), _FLOATS])
    return builder.call(reduce, [ir.Constant(ir.FloatType(), 0.0), vector], fastmath=("reassoc",))


@intrinsic
def half(typingctx, q, at):  # pragma: no cover
    """The IEEE half-precision number in bytes at, at + 1 of q (uint8, little-endian) as
    float32, without branches."""
    if not _is_row(q, types.uint8):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        return _half(builder, data, context.cast(builder, args[1], sig.args[1], types.int64))

    return types.float32(q, at), codegen
