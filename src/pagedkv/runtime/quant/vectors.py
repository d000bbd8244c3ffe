"""Integer products of packed weights with activations quantized to integers, as whole LLVM
vectors: a row of blocks in any format kept in blocks, with one to four input rows at once
(`dot_rows`), and a block's fp16 scale (`half`).

A block format's sub-block is 16 or 32 weights. Written as a loop, LLVM either unrolls it
into scalar code (it cannot prove that the two arrays do not overlap) or vectorizes it for
more elements per iteration than the loop has, and the block stays scalar. Here each line
of 32 weights is one vector load of the bytes, the field taken out of every byte (a shift
and a mask, or a sign extension) as 16-bit lanes, the sub-blocks' integer scales
multiplied in, and one multiply-add of pairs with each input row's activations
(`vpmaddwd` where the CPU has AVX512-BW: 32 products summed into 16 int32 lanes, which
LLVM fuses with the sum into `vpdpwssd` where it has AVX512-VNNI): a line is unpacked
once for every input row of the call. A block's lines are added as int32 vectors,
converted and scaled into float32 lanes once per block, and the lanes are summed once per
row. The activations are int16 lanes (`dots.quantize_rows`, at most `dots.LEVELS` in
magnitude, so that no sum overflows). Numba's extension API only
(`numba.extending.intrinsic`, llvmlite's IR builder).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils, codegen, config
from numba.extending import intrinsic

from pagedkv.ops.cpu.bf16 import declare, splat

_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
_N = 32
_SHORTS, _INTS = ir.VectorType(_I16, _N), ir.VectorType(_I32, _N)
_PAIRS, _FLOATS = ir.VectorType(_I32, 16), ir.VectorType(ir.FloatType(), 16)

# The features Numba compiles for, as `pagedkv.ops.cpu.bf16.HAS_DOT` reads them.
_FEATURES = config.CPU_FEATURES or codegen.get_host_cpu_features()  # type: ignore[attr-defined]
HAS_MADD = "+avx512bw" in _FEATURES.split(",")
"""Whether the CPU has AVX512-BW's `vpmaddwd` on 512-bit vectors; elsewhere LLVM lowers the
same sum from 32-bit products."""


def _madd(builder, weights, xs):  # type: ignore[no-untyped-def]
    """16 int32 lanes, lane j = weights[2j] * xs[2j] + weights[2j + 1] * xs[2j + 1], from 32
    int16 lanes (each product and pair sum fits an int32)."""
    if HAS_MADD:
        madd = declare(builder.module, "llvm.x86.avx512.pmaddw.d.512", _PAIRS, [_SHORTS] * 2)
        return builder.call(madd, [weights, xs])
    products = builder.mul(builder.sext(weights, _INTS), builder.sext(xs, _INTS))
    even, odd = (builder.shuffle_vector(products, products, ir.Constant(
        ir.VectorType(_I32, 16), list(range(start, _N, 2)))) for start in (0, 1))  # fmt: skip
    return builder.add(even, odd)


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
# (the lines, bytes per block, the nibbles' and the high bits' offsets in a block, the high
# bits' mask (0: none), the weights' offset, the byte offset of Q6_K's fp16 scale d)
K_BLOCKS = {
    12: (_Q45_LINES, 144, 16, 0, 0, 0, 0),
    13: (_Q45_LINES, 176, 48, 16, 1, 0, 0),
    14: (_Q6_LINES, 210, 0, 0, 3, 32, 208),
}
ROWS_AT_ONCE = (1, 2, 4)
"""The input rows `dot_rows` takes at once."""


@intrinsic
def dot_rows(typingctx, q, xq, xd, sums, first, type_id, count):  # pragma: no cover
    """The float32 products of a row q (uint8) of blocks with input rows first, ..., first +
    count - 1 of xq (int16 [rows, in_features]), quantized in groups of the format's block
    size (scales xd: float32 [rows, in_features // block size]; sums: float32 [rows,
    in_features // 32], each run of 32's sum), as a tuple of `count` floats. type_id: a
    literal GGML type id; count: a literal of `ROWS_AT_ONCE`. Each line of 32 weights is
    unpacked once for all `count` rows; its integer products stay in int32 lanes, are
    scaled into float32 lanes once per block, and the lanes are summed once per row.

    Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (`_small_rows`): block b adds d_b * xd[m, b] * sum_k (w_bk
    - offset) * xq[m, 32 b + k] (+ m_b * sums[m, b] for Q4_1 / Q5_1). w: Q8_0's int8
    weights, or the nibbles (weight j of a block in byte j's low nibble, j + 16 in its
    high; Q4_0's offset 8), with Q5_0 / Q5_1's fifth bit of weight j in bit j of a 32-bit
    word (Q5_0's offset 16).

    Q4_K, Q5_K, Q6_K (`_k_rows`): block b adds d_b * xd[m, b] * sum_k s_k (w_k - offset)
    xq[m, 256 b + k] (- dmin_b * sum_j m_j sums[m, 8 b + j] for Q4_K / Q5_K): w_k its 4-bit
    (Q4_K), 5-bit (Q5_K) or 6-bit (Q6_K) weights, offset 32 for Q6_K (0 else), s_k the
    integer scale of weight k's run of 32 (Q4_K, Q5_K: 8 of 6 bits, `six_bit_fields`, with
    the mins m_j) or 16 (Q6_K: 16 int8)."""
    if not (_is_row(q, types.uint8) and _is_rows(xq, types.int16)
            and _is_rows(xd, types.float32) and _is_rows(sums, types.float32)):  # fmt: skip
        return None
    if not (isinstance(type_id, types.IntegerLiteral) and isinstance(count, types.IntegerLiteral)
            and count.literal_value in ROWS_AT_ONCE):  # fmt: skip
        return None
    n, fmt = count.literal_value, type_id.literal_value
    if fmt in K_BLOCKS:
        rows = _k_rows(*K_BLOCKS[fmt], n)
    elif fmt in ROW_BLOCKS:
        rows = _small_rows(*ROW_BLOCKS[fmt], n)
    else:
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        first_row = context.cast(builder, args[4], sig.args[4], types.int64)
        xs_of, xd_of, sums_of = (
            [_row_pointer(context, builder, sig.args[i], args[i], first_row, m) for m in range(n)]
            for i in (1, 2, 3)
        )
        num_blocks = builder.extract_value(
            context.make_array(sig.args[2])(context, builder, args[2]).shape, 1
        )
        results = rows(builder, data, xs_of, xd_of, sums_of, num_blocks)
        return context.make_tuple(builder, sig.return_type, results)

    return types.UniTuple(types.float32, n)(q, xq, xd, sums, first, type_id, count), codegen


def _k_rows(lines, stride, nibbles, high_bits, mask, offset, d_at, n):  # type: ignore[no-untyped-def]
    """`dot_rows`' code for a K-quant format (one entry of `K_BLOCKS`) and n rows."""
    eight = ir.VectorType(ir.FloatType(), 8)
    layout = (nibbles, high_bits, mask, offset)

    def rows(builder, data, xs_of, xd_of, sums_of, num_blocks):  # type: ignore[no-untyped-def]
        totals = [cgutils.alloca_once_value(builder, ir.Constant(_FLOATS, 0.0)) for _ in range(n)]
        offsets = [cgutils.alloca_once_value(builder, ir.Constant(eight, 0.0)) for _ in range(n)]
        with cgutils.for_range(builder, num_blocks) as loop:
            b = loop.index
            base = builder.mul(b, i64(stride))
            d, scales, mins = _k_scales(builder, data, base, offset, d_at)
            ints = [ir.Constant(_PAIRS, 0)] * n
            for line in lines:
                weights = _k_line(builder, data, base, line, layout, scales)
                at = builder.add(builder.mul(b, i64(256)), i64(line[4]))
                ints = [builder.add(ints[m], _madd(builder, weights, _load_at(
                    builder, xs_of[m], at, _SHORTS))) for m in range(n)]  # fmt: skip
            for m in range(n):
                scale = builder.fmul(d, builder.load(builder.gep(xd_of[m], [b])))
                _add_scaled(builder, totals[m], ints[m], scale)
                if mins is not None:
                    sums = _load_at(builder, sums_of[m], builder.mul(b, i64(8)), eight)
                    builder.store(builder.fadd(builder.load(offsets[m]),
                                               builder.fmul(mins, sums)), offsets[m])  # fmt: skip
        results = [_float_sum(builder, builder.load(total)) for total in totals]
        if not offset:
            results = [builder.fsub(r, _float_sum(builder, builder.load(o)))
                       for r, o in zip(results, offsets, strict=True)]  # fmt: skip
        return results

    return rows


def _k_scales(builder, data, base, offset, d_at):  # type: ignore[no-untyped-def]
    """(d as a float, the integer scales as int16 lanes, the mins times dmin as 8 float lanes
    (None for Q6_K)) of the K-quant block at byte `base`."""
    if offset:  # Q6_K: 16 signed bytes after the weights' bits
        d = half_at(builder, data, builder.add(base, i64(d_at)))
        return d, builder.sext(load_vector(builder, data, base, 192, _I8, 16),
                               ir.VectorType(_I16, 16)), None  # fmt: skip
    d_dmin = _halves(builder, data, base)
    scales, mins = six_bit_fields(builder, data, base)
    eight = ir.VectorType(ir.FloatType(), 8)
    dmin = splat(builder, builder.extract_element(d_dmin, ir.Constant(_I32, 1)), 8)
    d = builder.extract_element(d_dmin, ir.Constant(_I32, 0))
    return d, scales, builder.fmul(builder.sitofp(mins, eight), dmin)


def _k_line(builder, data, base, line, layout, scales):  # type: ignore[no-untyped-def]
    """A K-quant block's line of 32 weights (an entry of `_Q45_LINES` / `_Q6_LINES`), less
    their offset and times their scales, as 32 int16 lanes."""
    _, _, _, _, _, first, second = line
    spread = ir.Constant(_INTS, [first] * 16 + [second] * 16)
    weights = k_line_weights(builder, data, base, line, layout)
    return builder.mul(weights, builder.shuffle_vector(scales, scales, spread))


def k_line_weights(builder, data, base, line, layout):  # type: ignore[no-untyped-def]
    """A K-quant block's line of 32 weights less their offset, as 32 int16 lanes. layout:
    (the nibbles' and the high bits' offsets in a block, the high bits' mask, the offset)."""
    low, low_shift, high, high_shift = line[:4]
    nibbles, high_bits, mask, offset = layout

    def field(at, shift, field_mask):  # type: ignore[no-untyped-def]
        raw = builder.zext(load_vector(builder, data, base, at, _I8, _N), _SHORTS)
        raw = builder.lshr(raw, ir.Constant(_SHORTS, [shift] * _N))
        return builder.and_(raw, ir.Constant(_SHORTS, [field_mask] * _N))

    weights = field(nibbles + low, low_shift, 15)
    if mask:
        bits = field(high_bits + high, high_shift, mask)
        weights = builder.or_(weights, builder.shl(bits, ir.Constant(_SHORTS, [4] * _N)))
    return builder.sub(weights, ir.Constant(_SHORTS, [offset] * _N))


def _add_scaled(builder, total, ints, scale):  # type: ignore[no-untyped-def]
    """*total (16 float lanes) += ints (16 int32 lanes) * scale."""
    scaled = builder.fmul(builder.sitofp(ints, _FLOATS), splat(builder, scale, 16))
    builder.store(builder.fadd(builder.load(total), scaled), total)


def _is_rows(arr, dtype) -> bool:  # type: ignore[no-untyped-def]
    return _is_row(arr, dtype) and arr.ndim == 2


def _row_pointer(context, builder, typ, value, first, m):  # type: ignore[no-untyped-def]
    """A pointer to row first + m of a C-contiguous 2-d array."""
    array = context.make_array(typ)(context, builder, value)
    width = builder.extract_value(array.shape, 1)
    return builder.gep(array.data, [builder.mul(builder.add(first, i64(m)), width)])


def _load_at(builder, pointer, index, vector):  # type: ignore[no-untyped-def]
    """A vector of `vector`'s type from element `index` (an int64) of `pointer`."""
    pointer = builder.bitcast(builder.gep(pointer, [index]), vector.as_pointer())
    return builder.load(pointer, align=2 if vector.element == _I16 else 4)


def _halves(builder, data, at):  # type: ignore[no-untyped-def]
    """The two IEEE half-precision numbers at byte `at` (an int64) of a uint8 pointer, as two
    float lanes (`vcvtph2ps`, exact), for a block that uses both (d and m, or d and dmin):
    where only one is used, LLVM loads it into a lane of whatever register it chooses, the
    running sum among them, which chains every block to the one before (`half_at`)."""
    word = builder.load(builder.bitcast(builder.gep(data, [at]), _I32.as_pointer()), align=1)
    four = ir.VectorType(_I32, 4)
    wide = builder.insert_element(ir.Constant(four, [0] * 4), word, ir.Constant(_I32, 0))
    halves = builder.bitcast(wide, ir.VectorType(ir.HalfType(), 8))
    pair = builder.shuffle_vector(halves, halves, ir.Constant(ir.VectorType(_I32, 2), [0, 1]))
    return builder.fpext(pair, ir.VectorType(ir.FloatType(), 2))


def load_vector(builder, data, base, at, element, n):  # type: ignore[no-untyped-def]
    """n elements from byte base + at (an int64 and a constant) of the uint8 pointer data."""
    pointer = builder.gep(data, [builder.add(base, i64(at))])
    return builder.load(builder.bitcast(pointer, ir.VectorType(element, n).as_pointer()), align=1)


def six_bit_fields(builder, data, base):  # type: ignore[no-untyped-def]
    """(scales, mins), 8 int16 lanes each, of the Q4_K / Q5_K block at byte `base`: its 12
    bytes q at base + 4 hold scale j in q[j] & 63 and min j in q[j + 4] & 63 for j < 4,
    and for j >= 4 their low 4 bits in q[j + 4]'s nibbles, their top 2 in q[j - 4] and
    q[j]'s top bits (the layouts: `blocks`). As lanes: a = q[0..7], b = q[4..11]."""
    eight = ir.VectorType(_I16, 8)
    a = builder.zext(load_vector(builder, data, base, 4, _I8, 8), eight)
    b = builder.zext(load_vector(builder, data, base, 8, _I8, 8), eight)

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


def i64(value: int) -> ir.Constant:
    return ir.Constant(ir.IntType(64), value)


# The formats of 32 weights a block that `dot_row` multiplies, by GGML type id: (bytes per
# block, the weights' byte offset, the weights' offset (Q4_0's 8, Q5_0's 16), whether a float
# offset m follows the scale (Q4_1, Q5_1), whether the weights are int8 bytes (Q8_0) or
# nibbles, the byte offset of the 32 fifth bits of Q5_0 / Q5_1 (0: none)).
ROW_BLOCKS = {
    8: (34, 2, 0, False, True, 0),
    2: (18, 2, 8, False, False, 0),
    3: (20, 4, 0, True, False, 0),
    6: (22, 6, 16, False, False, 2),
    7: (24, 8, 0, True, False, 4),
}


def _small_rows(stride, weights_at, offset, has_min, is_bytes, high_at, n):  # type: ignore[no-untyped-def]
    """`dot_rows`' code for a format of 32 weights a block (one entry of `ROW_BLOCKS`) and
    n rows."""

    def rows(builder, data, xs_of, xd_of, sums_of, num_blocks):  # type: ignore[no-untyped-def]
        totals = [cgutils.alloca_once_value(builder, ir.Constant(_FLOATS, 0.0)) for _ in range(n)]
        offsets = [cgutils.alloca_once_value(builder, ir.Constant(ir.FloatType(), 0.0))
                   for _ in range(n)]  # fmt: skip
        with cgutils.for_range(builder, num_blocks) as loop:
            b = loop.index
            at = builder.mul(b, i64(stride))
            if has_min:
                d_m = _halves(builder, data, at)
                d = builder.extract_element(d_m, ir.Constant(_I32, 0))
            else:
                d = half_at(builder, data, at)
            if is_bytes:
                weights = load_vector(builder, data, at, weights_at, _I8, _N)
                weights = builder.sext(weights, _SHORTS)
            else:
                weights = nibbles(builder, load_vector(builder, data, at, weights_at, _I8, 16))
                if high_at:
                    weights = builder.or_(weights, fifth_bits(builder, data, at, high_at))
                weights = builder.sub(weights, ir.Constant(_SHORTS, [offset] * _N))
            for m in range(n):
                xs = _load_at(builder, xs_of[m], builder.mul(b, i64(_N)), _SHORTS)
                scale = builder.fmul(d, builder.load(builder.gep(xd_of[m], [b])))
                _add_scaled(builder, totals[m], _madd(builder, weights, xs), scale)
                if has_min:
                    shift = builder.fmul(builder.extract_element(d_m, ir.Constant(_I32, 1)),
                                         builder.load(builder.gep(sums_of[m], [b])))  # fmt: skip
                    builder.store(builder.fadd(builder.load(offsets[m]), shift), offsets[m])
        return [builder.fadd(_float_sum(builder, builder.load(total)), builder.load(shift))
                for total, shift in zip(totals, offsets, strict=True)]  # fmt: skip

    return rows


def nibbles(builder, packed):  # type: ignore[no-untyped-def]
    """32 int16 lanes from 16 bytes: byte j's low nibble in lane j, its high in j + 16."""
    half_type = ir.VectorType(_I16, 16)
    wide = builder.zext(packed, half_type)
    low = builder.and_(wide, ir.Constant(half_type, [15] * 16))
    high = builder.lshr(wide, ir.Constant(half_type, [4] * 16))
    return builder.shuffle_vector(low, high, ir.Constant(_INTS, list(range(_N))))


def fifth_bits(builder, data, base, at):  # type: ignore[no-untyped-def]
    """32 int16 lanes, lane j 16 where bit j of the little-endian 32-bit word at byte base +
    at of a uint8 pointer is set, else 0: the word in every lane, tested against 1 << j."""
    pointer = builder.bitcast(builder.gep(data, [builder.add(base, i64(at))]), _I32.as_pointer())
    word = builder.load(pointer, align=1)
    one = builder.insert_element(ir.Constant(_INTS, None), word, ir.Constant(_I32, 0))
    spread = builder.shuffle_vector(one, one, ir.Constant(_INTS, [0] * _N))
    bits = builder.and_(spread, ir.Constant(_INTS, [1 << j for j in range(_N)]))
    is_set = builder.icmp_unsigned("!=", bits, ir.Constant(_INTS, [0] * _N))
    return builder.select(is_set, ir.Constant(_SHORTS, [16] * _N), ir.Constant(_SHORTS, [0] * _N))


def half_at(builder, data, at):  # type: ignore[no-untyped-def]
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


def _float_sum(builder, vector):  # type: ignore[no-untyped-def]
    """The sum of a vector's float lanes, in any order (LLVM adds halves)."""
    name = f"llvm.vector.reduce.fadd.v{vector.type.count}f32"
    reduce = declare(builder.module, name, ir.FloatType(), [ir.FloatType(), vector.type])
    return builder.call(reduce, [ir.Constant(ir.FloatType(), 0.0), vector], fastmath=("reassoc",))


@intrinsic
def half(typingctx, q, at):  # pragma: no cover
    """The IEEE half-precision number in bytes at, at + 1 of q (uint8, little-endian) as
    float32, without branches."""
    if not _is_row(q, types.uint8):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        return half_at(builder, data, context.cast(builder, args[1], sig.args[1], types.int64))

    return types.float32(q, at), codegen
