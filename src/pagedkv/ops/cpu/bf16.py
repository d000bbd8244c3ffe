"""bfloat16 for the CPU kernels (widening a value, rounding one) and the cache prefetch.

NumPy has no bfloat16, so bfloat16 tensors reach Numba as their uint16 bits. A bfloat16 is
the high half of a float32, so widening is a shift and a bit cast (`as_float32`), which
LLVM vectorizes like any other load; `round_to_bf16` is the inverse, rounding to nearest
even. `prefetch_head` asks for K and V rows ahead of the loops that read them (both dtypes),
`prefetch_once` for weight lines that a step reads once; `dot32` multiplies two bfloat16
rows with the CPU's own instruction where it has one.
Numba's extension API only: `numba.extending` (intrinsic, overload), `llvmlite`'s IR builder
and `numba.core`'s loop helpers and CPU settings.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils, codegen, config
from numba.extending import intrinsic, overload

_F32, _I32 = ir.FloatType(), ir.IntType(32)


def as_float32(x):  # pragma: no cover
    """A cache element as float32: bfloat16 bits (uint16) widened, float32 unchanged, int8
    converted (the caller applies its scale)."""
    raise NotImplementedError("compiled only")


@intrinsic
def _widen_bits(typingctx, bits):  # pragma: no cover
    """bfloat16 bits (uint16) as the float32 they are the high half of."""
    if bits != types.uint16:
        return None

    def codegen(context, builder, sig, args):
        wide = builder.shl(builder.zext(args[0], _I32), ir.Constant(_I32, 16))
        return builder.bitcast(wide, _F32)

    return types.float32(types.uint16), codegen


@intrinsic
def _int8_as_float32(typingctx, x):  # pragma: no cover
    """An int8 converted to float32 in one instruction (no detour through a wider int)."""
    if x != types.int8:
        return None

    def codegen(context, builder, sig, args):
        return builder.sitofp(args[0], _F32)

    return types.float32(types.int8), codegen


@overload(as_float32)
def _as_float32_impl(x):  # pragma: no cover
    if x == types.uint16:
        return lambda x: _widen_bits(x)
    if x == types.float32:
        return lambda x: x
    if x == types.int8:
        return lambda x: _int8_as_float32(x)
    return None


def declare(module: ir.Module, name: str, ret: ir.Type, params: list[ir.Type]) -> ir.Function:
    """The LLVM intrinsic `name` in `module`, declared on first use."""
    return module.globals.get(name) or ir.Function(module, ir.FunctionType(ret, params), name)


def splat(builder: ir.IRBuilder, value: ir.Value, lanes: int) -> ir.Value:
    """`value` in every lane of a <lanes x value's type> vector."""
    i32 = ir.IntType(32)
    one = builder.insert_element(
        ir.Constant(ir.VectorType(value.type, lanes), None), value, ir.Constant(i32, 0)
    )
    return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(i32, lanes), [0] * lanes))


def pointer(context, builder, arr_type, arr, offset, offset_type, to):  # type: ignore[no-untyped-def]
    """Address of element `offset` of a C-contiguous array, cast to a pointer to `to`."""
    data = context.make_array(arr_type)(context, builder, arr).data
    index = context.cast(builder, offset, offset_type, types.int64)
    return builder.bitcast(builder.gep(data, [index]), to.as_pointer())


@intrinsic
def _float32_to_bits(typingctx, x):  # pragma: no cover
    """The bits of a float32 as uint32 (a bit cast, no conversion)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], _I32)

    return types.uint32(types.float32), codegen


@intrinsic
def bits_as_float32(typingctx, bits):  # pragma: no cover
    """The low 32 bits of an integer read as the float32 they are the bits of (a bit cast,
    no conversion; Numba widens uint32 arithmetic to 64 bits)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], _F32)

    return types.float32(types.uint32), codegen


@intrinsic
def magnitude_bits(typingctx, x):  # pragma: no cover
    """The float32 bits of |x| as uint32, for x float32 or bfloat16 bits (uint16): for
    magnitudes the integer order is the float order, and an integer maximum LLVM takes in
    vector lanes where it keeps a float maximum scalar."""
    if x not in (types.float32, types.uint16):
        return None

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        if sig.args[0] == types.float32:
            bits = builder.bitcast(args[0], i32)
        else:
            bits = builder.shl(builder.zext(args[0], i32), ir.Constant(i32, 16))
        return builder.and_(bits, ir.Constant(i32, 0x7FFFFFFF))

    return types.uint32(x), codegen


class BFloat16(ir.Type):
    """LLVM's `bfloat`, which llvmlite's IR builder does not name."""

    def _to_string(self) -> str:
        return "bfloat"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BFloat16)

    def __hash__(self) -> int:
        return hash("bfloat")


def _cpu_features() -> str:
    """The CPU features Numba compiles for: ``NUMBA_CPU_FEATURES`` where set, else the
    host's (as Numba's own code generator chooses them)."""
    return config.CPU_FEATURES or codegen.get_host_cpu_features()  # type: ignore[attr-defined]


HAS_DOT = "+avx512bf16" in _cpu_features().split(",")
"""Whether the CPU has AVX512-BF16's dot product (`dot32`). Numba's cache is keyed by the
CPU name and features too, so code built with or without it is never loaded on the other."""

_LANES = 16
_SUMS = 4
"""Independent vector sums in `dot32`'s loop: one would wait on each instruction's latency."""


@intrinsic
def dot32(typingctx, a, a_at, b, b_at, groups):  # pragma: no cover
    """The float32 sum of a.flat[a_at + k] * b.flat[b_at + k] for k < 32 * groups, a and b
    C-contiguous arrays of bfloat16 bits (uint16); where `HAS_DOT` only.

    One `vdpbf16ps` per 32 elements (a 64-byte line of each): it widens 16 pairs, multiplies
    (exactly: products of bfloat16 values fit a float32) and adds each pair into a float32
    lane. Widening by hand costs a shift and a mask per pair of elements and two FMAs, and
    that many instructions per line kept a decode step's products short of the memory's
    speed."""
    if not all(isinstance(t, types.Array) and t.dtype == types.uint16 and t.layout == "C"
               for t in (a, b)):  # fmt: skip
        return None

    def codegen(context, builder, sig, args):
        f32x16 = ir.VectorType(_F32, _LANES)
        bf16x32 = ir.VectorType(BFloat16(), 2 * _LANES)
        i64 = ir.IntType(64)
        dot = declare(builder.module, "llvm.x86.avx512bf16.dpbf16ps.512", f32x16,
                       [f32x16, bf16x32, bf16x32])  # fmt: skip
        lines = [pointer(context, builder, sig.args[i], args[i], args[i + 1], sig.args[i + 1],
                          bf16x32) for i in (0, 2)]  # fmt: skip
        total = context.cast(builder, args[4], sig.args[4], types.int64)
        sums = [cgutils.alloca_once_value(builder, ir.Constant(f32x16, None)) for _ in range(_SUMS)]

        def add_line(index, into):
            a_line, b_line = (builder.load(builder.gep(p, [index]), align=2) for p in lines)
            builder.store(builder.call(dot, [builder.load(into), a_line, b_line]), into)

        rounds = builder.sdiv(total, ir.Constant(i64, _SUMS))
        with cgutils.for_range(builder, rounds) as loop:
            first = builder.mul(loop.index, ir.Constant(i64, _SUMS))
            for j, into in enumerate(sums):
                add_line(builder.add(first, ir.Constant(i64, j)), into)
        rest = builder.mul(rounds, ir.Constant(i64, _SUMS))
        with cgutils.for_range_slice(builder, rest, total, ir.Constant(i64, 1)) as (index, _):
            add_line(index, sums[0])
        vector = builder.load(sums[0])
        for into in sums[1:]:
            vector = builder.fadd(vector, builder.load(into))
        width = _LANES
        while width > 1:  # halves added: 16 lanes to one
            width //= 2
            halves = [builder.shuffle_vector(vector, vector, ir.Constant(
                ir.VectorType(_I32, width), list(range(start, start + width))))
                for start in (0, width)]  # fmt: skip
            vector = builder.fadd(*halves)
        return builder.extract_element(vector, ir.Constant(_I32, 0))

    return types.float32(a, a_at, b, b_at, groups), codegen


@njit(inline="always")
def round_to_bf16(x):  # pragma: no cover
    """A finite float32 rounded to the nearest bfloat16 (ties to even), as its bits in the
    low half of a uint32."""
    bits = _float32_to_bits(x)
    return (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)


TOKENS = 4
"""Tokens the kernels' loops take at once (they are written out for four); the prefetch
runs one such group ahead."""


def _prefetcher(locality: int):  # type: ignore[no-untyped-def]
    """An intrinsic (array, offset) that asks for the line of array.flat[offset]
    (C-contiguous) with LLVM's `locality` hint: a hint, it never faults."""

    @intrinsic
    def prefetch(typingctx, array, offset):  # pragma: no cover
        if not (isinstance(array, types.Array) and array.layout == "C"):
            return None

        def codegen(context, builder, sig, args):
            byte = ir.IntType(8)
            at = pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1], byte)
            fn = declare(builder.module, "llvm.prefetch.p0", ir.VoidType(),
                          [byte.as_pointer()] + [_I32] * 3)  # fmt: skip
            builder.call(fn, [at] + [ir.Constant(_I32, x) for x in (0, locality, 1)])  # read, data
            return context.get_dummy_value()

        return types.none(array, offset), codegen

    return prefetch


prefetch_line = _prefetcher(2)
"""Load a line into L2, for K and V rows (and an int8 cache's scales) read soon and maybe
again."""
prefetch_once = _prefetcher(0)
"""Load a line for one use (x86: `prefetchnta`): a weight row that a decode step reads once.
The line does not stay in the outer caches, so what the step reads next (the KV cache, the
interpreter's own code and objects after the call) is still there, not pushed out by
hundreds of megabytes of weights."""


@njit(inline="always")
def prefetch_head(cache, slots, g):  # pragma: no cover
    """Prefetch KV head g's rows of the tokens at `slots` (a tuple) of a cache [slots, kv
    heads, D], C-contiguous. Blocks are scattered, so the hardware prefetcher does not run
    across them; and one head at a time, not whole token rows, spreads the requests over the
    loop that asks for them instead of queueing a burst that stalls it."""
    head_dim = cache.shape[2]
    row = cache.shape[1] * head_dim
    line = 64 // cache.itemsize
    for i in range(len(slots)):
        at = slots[i] * row + g * head_dim
        for c in range(0, head_dim, line):
            prefetch_line(cache, at + c)
