"""Sixteen-lane float32 vectors for Numba kernels: a value type and the few operations the
CPU decode kernel needs, each one LLVM instruction or a short fixed sequence.

Why not let LLVM vectorize plain loops: a decode kernel's loops are short (head_dim 128 is
eight 16-lane vectors) and index several rows at once, so the loop vectorizer adds alias
checks and remainder loops around every few FMAs, keeps one accumulator chain per loop and
reduces each dot product horizontally on its own. Written with explicit vectors the kernel
holds a 4 x 4 tile of dot products in registers, reduces all sixteen with one transposing
tree and runs the softmax 16 lanes at a time: about 2x fewer nanoseconds per token on the
development machine (see benchmarks/dev_cpu_attention.py).

Arrays are 1-D and C-contiguous (flat views of the caches and of scratch buffers) and
offsets are element indices, unchecked: the caller keeps `offset + 16 <= len(arr)` (or uses
`vload_n` at a row's end). A cache of bfloat16 arrives as its uint16 bits; loads widen it
(bfloat16 is the high half of a float32). Where the CPU lacks AVX-512, LLVM splits each
vector into narrower ones: slower, still correct.
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit
from numba.core import cgutils, types
from numba.core.datamodel import models, register_default
from numba.extending import intrinsic

LANES = 16
_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_I8 = ir.IntType(8)
_VEC = ir.VectorType(_F32, LANES)


class F32x16(types.Type):
    """Numba type of a <16 x float> register value."""

    def __init__(self) -> None:
        super().__init__(name="f32x16")


f32x16 = F32x16()


@register_default(F32x16)
class _F32x16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):  # type: ignore[no-untyped-def]
        super().__init__(dmm, fe_type, _VEC)


def _is_flat(arr: types.Type, dtypes: tuple = (types.float32, types.uint16)) -> bool:
    return isinstance(arr, types.Array) and arr.ndim == 1 and arr.dtype in dtypes


def _element_pointer(context, builder, sig, args):  # type: ignore[no-untyped-def]
    """Pointer to arr[offset] for the (arr, offset, ...) arguments of an intrinsic."""
    data = context.make_array(sig.args[0])(context, builder, args[0]).data
    return builder.gep(data, [context.cast(builder, args[1], sig.args[1], types.intp)])


def _constant_indices(indices: list[int]) -> ir.Constant:
    return ir.Constant(ir.VectorType(_I32, len(indices)), indices)


@intrinsic
def vload(typingctx, arr, offset):  # pragma: no cover
    """arr[offset : offset + 16] as a vector (bfloat16 bits widened to float32)."""
    if not _is_flat(arr) or not isinstance(offset, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        ptr = _element_pointer(context, builder, sig, args)
        if sig.args[0].dtype == types.float32:
            return builder.load(builder.bitcast(ptr, _VEC.as_pointer()), align=4)
        bits_type = ir.VectorType(ir.IntType(16), LANES)
        bits = builder.load(builder.bitcast(ptr, bits_type.as_pointer()), align=2)
        wide = builder.zext(bits, ir.VectorType(_I32, LANES))
        wide = builder.shl(wide, _constant_indices([16] * LANES))
        return builder.bitcast(wide, _VEC)

    return f32x16(arr, offset), codegen


@intrinsic
def velem(typingctx, arr, offset):  # pragma: no cover
    """arr[offset] as a float32 scalar, without NumPy's negative-index wraparound (which
    costs a shift, a mask and an add per access in an inner loop)."""
    if not _is_flat(arr) or not isinstance(offset, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        ptr = _element_pointer(context, builder, sig, args)
        if sig.args[0].dtype == types.float32:
            return builder.load(ptr)
        wide = builder.zext(builder.load(ptr), _I32)
        return builder.bitcast(builder.shl(wide, ir.Constant(_I32, 16)), _F32)

    return types.float32(arr, offset), codegen


@intrinsic
def vstore(typingctx, arr, offset, vec):  # pragma: no cover
    """arr[offset : offset + 16] = vec (float32 arrays)."""
    if not _is_flat(arr, (types.float32,)) or vec != f32x16:
        return None

    def codegen(context, builder, sig, args):
        ptr = _element_pointer(context, builder, sig, args)
        builder.store(args[2], builder.bitcast(ptr, _VEC.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.none(arr, offset, vec), codegen


@intrinsic
def vstore_quarter(typingctx, arr, offset, vec, quarter):  # pragma: no cover
    """arr[offset : offset + 4] = lanes 4q .. 4q + 3 of vec; q must be a literal 0..3."""
    if not _is_flat(arr, (types.float32,)) or vec != f32x16:
        return None
    if not isinstance(quarter, types.IntegerLiteral) or not 0 <= quarter.literal_value < 4:
        return None
    first = 4 * quarter.literal_value

    def codegen(context, builder, sig, args):
        ptr = _element_pointer(context, builder, sig, args)
        lanes = _constant_indices([first, first + 1, first + 2, first + 3])
        part = builder.shuffle_vector(args[2], ir.Constant(_VEC, ir.Undefined), lanes)
        builder.store(part, builder.bitcast(ptr, ir.VectorType(_F32, 4).as_pointer()), align=4)
        return context.get_dummy_value()

    return types.none(arr, offset, vec, quarter), codegen


@intrinsic
def vprefetch(typingctx, arr, offset):  # pragma: no cover
    """Ask for the cache line holding arr[offset] to be brought into L2 (a hint: it never
    faults, so the offset may point anywhere in or past the array)."""
    if not _is_flat(arr) or not isinstance(offset, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        ptr = builder.bitcast(_element_pointer(context, builder, sig, args), _I8.as_pointer())
        hint = ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32])
        prefetch = cgutils.get_or_insert_function(builder.module, hint, "llvm.prefetch.p0")
        # read (0), locality 2 (prefetcht1: L2 and up), data cache (1)
        builder.call(
            prefetch, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 2), ir.Constant(_I32, 1)]
        )
        return context.get_dummy_value()

    return types.none(arr, offset), codegen


@intrinsic
def vzero(typingctx):  # pragma: no cover
    """A vector of zeros."""

    def codegen(context, builder, sig, args):
        return ir.Constant(_VEC, [0.0] * LANES)

    return f32x16(), codegen


@intrinsic
def vsplat(typingctx, x):  # pragma: no cover
    """A vector with x in every lane."""
    if not isinstance(x, types.Float):
        return None

    def codegen(context, builder, sig, args):
        x32 = context.cast(builder, args[0], sig.args[0], types.float32)
        first = builder.insert_element(ir.Constant(_VEC, ir.Undefined), x32, ir.Constant(_I32, 0))
        return builder.shuffle_vector(
            first, ir.Constant(_VEC, ir.Undefined), _constant_indices([0] * LANES)
        )

    return f32x16(x), codegen


@intrinsic
def vinsert(typingctx, vec, lane, x):  # pragma: no cover
    """vec with lane `lane` set to x."""
    if vec != f32x16 or not isinstance(lane, types.Integer) or x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        index = context.cast(builder, args[1], sig.args[1], types.int32)
        return builder.insert_element(args[0], args[2], index)

    return f32x16(vec, lane, x), codegen


@intrinsic
def vfma(typingctx, a, b, c):  # pragma: no cover
    """a * b + c in every lane, fused (one rounding)."""
    if not a == b == c == f32x16:
        return None

    def codegen(context, builder, sig, args):
        fn_type = ir.FunctionType(_VEC, [_VEC] * 3)
        fma = cgutils.get_or_insert_function(builder.module, fn_type, "llvm.fma.v16f32")
        return builder.call(fma, args)

    return f32x16(a, b, c), codegen


@intrinsic
def vadd(typingctx, a, b):  # pragma: no cover
    """a + b in every lane."""
    if not a == b == f32x16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fadd(args[0], args[1])

    return f32x16(a, b), codegen


@intrinsic
def vmul(typingctx, a, b):  # pragma: no cover
    """a * b in every lane."""
    if not a == b == f32x16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fmul(args[0], args[1])

    return f32x16(a, b), codegen


def _pair_sums(builder: ir.IRBuilder, x: ir.Value, y: ir.Value, width: int) -> ir.Value:
    """One level of the transposing tree: x and y each hold groups of 2 x `width` partial
    sums; the result holds groups of `width`, x's groups first, each the sum of a group's
    two halves."""
    low: list[int] = []
    high: list[int] = []
    for source in (0, LANES):
        for group in range(0, LANES, 2 * width):
            low += [source + group + i for i in range(width)]
            high += [source + group + width + i for i in range(width)]
    return builder.fadd(
        builder.shuffle_vector(x, y, _constant_indices(low)),
        builder.shuffle_vector(x, y, _constant_indices(high)),
    )


@intrinsic
def vsum16(
    typingctx, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15
):  # pragma: no cover  # noqa: E501
    """Lane j of the result is the sum of the 16 lanes of a_j.

    Sixteen horizontal sums in 30 shuffles and 15 adds (a tree that halves the partial
    sums per vector at each level while pairing vectors), against ~8 instructions for each
    sum reduced on its own.
    """
    vectors = (a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15)
    if any(v != f32x16 for v in vectors):
        return None

    def codegen(context, builder, sig, args):
        level, width = list(args), LANES // 2
        while len(level) > 1:
            level = [
                _pair_sums(builder, level[i], level[i + 1], width) for i in range(0, len(level), 2)
            ]
            width //= 2
        return level[0]

    return f32x16(*vectors), codegen


@njit(inline="always", fastmath=True, error_model="numpy")
def vload_n(arr, offset, n):  # pragma: no cover
    """arr[offset : offset + min(n, 16)], zeros past n: a row's last, partial vector never
    reads past the row (which could be past the end of the cache)."""
    if n >= LANES:
        return vload(arr, offset)
    vec = vzero()
    for i in range(n):
        vec = vinsert(vec, i, velem(arr, offset + i))
    return vec


def _splat_constant(value: float) -> ir.Constant:
    return ir.Constant(_VEC, [value] * LANES)


def _lane_max(builder: ir.IRBuilder, a: ir.Value, b: ir.Value) -> ir.Value:
    return builder.select(builder.fcmp_ordered(">", a, b), a, b)


def _reduce(builder: ir.IRBuilder, vec: ir.Value, combine) -> ir.Value:  # type: ignore[no-untyped-def]
    """Combine the 16 lanes pairwise down to one (4 shuffles), as a float32 scalar."""
    width = LANES // 2
    while width:
        upper = builder.shuffle_vector(
            vec,
            ir.Constant(_VEC, ir.Undefined),
            _constant_indices([width + i if i < width else i for i in range(LANES)]),
        )
        vec = combine(builder, vec, upper)
        width //= 2
    return builder.extract_element(vec, ir.Constant(_I32, 0))


@intrinsic
def vmax(typingctx, a, b):  # pragma: no cover
    """The larger of a and b in every lane."""
    if not a == b == f32x16:
        return None

    def codegen(context, builder, sig, args):
        return _lane_max(builder, args[0], args[1])

    return f32x16(a, b), codegen


@intrinsic
def vsub(typingctx, a, b):  # pragma: no cover
    """a - b in every lane."""
    if not a == b == f32x16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fsub(args[0], args[1])

    return f32x16(a, b), codegen


@intrinsic
def vhmax(typingctx, vec):  # pragma: no cover
    """The largest lane of vec."""
    if vec != f32x16:
        return None

    def codegen(context, builder, sig, args):
        return _reduce(builder, args[0], _lane_max)

    return types.float32(vec), codegen


@intrinsic
def vhsum(typingctx, vec):  # pragma: no cover
    """The sum of the lanes of vec."""
    if vec != f32x16:
        return None

    def codegen(context, builder, sig, args):
        return _reduce(builder, args[0], lambda b, x, y: b.fadd(x, y))

    return types.float32(vec), codegen


@intrinsic
def vkeep(typingctx, vec, n, fill):  # pragma: no cover
    """vec with lanes n .. 15 replaced by `fill` (a row's tail past its last valid lane)."""
    if vec != f32x16 or not isinstance(n, types.Integer) or not isinstance(fill, types.Float):
        return None

    def codegen(context, builder, sig, args):
        count = context.cast(builder, args[1], sig.args[1], types.int32)
        count = builder.insert_element(
            ir.Constant(ir.VectorType(_I32, LANES), ir.Undefined), count, ir.Constant(_I32, 0)
        )
        count = builder.shuffle_vector(
            count, ir.Constant(ir.VectorType(_I32, LANES), ir.Undefined),
            _constant_indices([0] * LANES),
        )  # fmt: skip
        keep = builder.icmp_signed("<", _constant_indices(list(range(LANES))), count)
        value = context.cast(builder, args[2], sig.args[2], types.float32)
        value = builder.insert_element(ir.Constant(_VEC, ir.Undefined), value, ir.Constant(_I32, 0))
        value = builder.shuffle_vector(
            value, ir.Constant(_VEC, ir.Undefined), _constant_indices([0] * LANES)
        )
        return builder.select(keep, args[0], value)

    return f32x16(vec, n, fill), codegen


LN2_POWERS = (0.6931471805599453, 0.2402265069591007, 0.05550410866482158,
              0.009618129107628477, 0.0013333558146428443, 0.0001540353039338161)  # fmt: skip
"""ln(2)^k / k! for k = 1..6: Taylor coefficients of 2^f = exp(f ln 2)."""
EXP_FLOOR = -87.0
"""exp inputs are clamped here: exp(-87) ~ 1.6e-38, still a normal float32."""


@intrinsic
def vexp_neg(typingctx, x):  # pragma: no cover
    """exp(x) in every lane, for x <= 0 (the same arithmetic as `exp_neg` in cpu_kernels:
    2^n from exponent bits times a degree-6 polynomial; relative error as stated there)."""
    if x != f32x16:
        return None

    def codegen(context, builder, sig, args):
        t = builder.fmul(_lane_max(builder, args[0], _splat_constant(EXP_FLOOR)),
                         _splat_constant(1.4426950408889634))  # fmt: skip
        floor = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_VEC, [_VEC]), "llvm.floor.v16f32"
        )
        n = builder.call(floor, [builder.fadd(t, _splat_constant(0.5))])
        f = builder.fsub(t, n)
        fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_VEC, [_VEC] * 3), "llvm.fma.v16f32"
        )
        p = _splat_constant(LN2_POWERS[5])
        for coefficient in (*LN2_POWERS[4::-1], 1.0):
            p = builder.call(fma, [p, f, _splat_constant(coefficient)])
        ints = ir.VectorType(_I32, LANES)
        exponent = builder.add(builder.fptosi(n, ints), _constant_indices([127] * LANES))
        scale = builder.bitcast(builder.shl(exponent, _constant_indices([23] * LANES)), _VEC)
        return builder.fmul(p, scale)

    return f32x16(x), codegen
