"""bfloat16 for the CPU kernels (widening a value, rounding one) and the cache prefetch.

NumPy has no bfloat16, so bfloat16 tensors reach Numba as their uint16 bits. A bfloat16 is
the high half of a float32, so widening is a shift and a bit cast (`as_float32`), which
LLVM vectorizes like any other load; `round_to_bf16` is the inverse, rounding to nearest
even. `prefetch_head` asks for K and V rows ahead of the loops that read them (both dtypes),
`prefetch_once` for weight lines that a step reads once.
Standard Numba extension API only: `numba.extending` (intrinsic, overload) and `llvmlite`.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

_F32, _I32 = ir.FloatType(), ir.IntType(32)


def as_float32(x):  # pragma: no cover
    """A cache element as float32: bfloat16 bits (uint16) widened, float32 unchanged."""
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


@overload(as_float32)
def _as_float32_impl(x):  # pragma: no cover
    if x == types.uint16:
        return lambda x: _widen_bits(x)
    if x == types.float32:
        return lambda x: x
    return None


def _declare(module: ir.Module, name: str, ret: ir.Type, params: list[ir.Type]) -> ir.Function:
    """The LLVM intrinsic `name` in `module`, declared on first use."""
    return module.globals.get(name) or ir.Function(module, ir.FunctionType(ret, params), name)


def _pointer(context, builder, arr_type, arr, offset, offset_type, to):  # type: ignore[no-untyped-def]
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
def pair_bits(typingctx, bits, at):  # pragma: no cover
    """The bfloat16 elements at flat offsets `at` and `at + 1` of a C-contiguous array of
    their bits (uint16) as one uint32 word, the first in its low half (little-endian): a
    load, not an array view (a view made per weight row costs reference counting)."""
    if not (isinstance(bits, types.Array) and bits.dtype == types.uint16 and bits.layout == "C"):
        return None

    def codegen(context, builder, sig, args):
        word = _pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1], _I32)
        return builder.load(word, align=2)

    return types.uint32(bits, at), codegen


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
            at = _pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1], byte)
            fn = _declare(builder.module, "llvm.prefetch.p0", ir.VoidType(),
                          [byte.as_pointer()] + [_I32] * 3)  # fmt: skip
            builder.call(fn, [at] + [ir.Constant(_I32, x) for x in (0, locality, 1)])  # read, data
            return context.get_dummy_value()

        return types.none(array, offset), codegen

    return prefetch


_prefetch = _prefetcher(2)
"""Load a line into L2, for K and V rows read soon and maybe again."""
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
            _prefetch(cache, at + c)
