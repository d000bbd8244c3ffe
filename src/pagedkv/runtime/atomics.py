"""Atomic counters and a polite wait for compiled code that shares work between threads.

Numba has no atomics on the CPU, so these are LLVM instructions emitted directly
(`numba.extending.intrinsic`): a fetch-and-add and an acquire load on an int64 array
element, the spin-loop hint, the cycle counter and `sched_yield`. `layers.py` uses them
to let the threads of one parallel region claim a step's work from shared counters.
NumPy, Numba and llvmlite only.
"""

from __future__ import annotations

import platform

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
_I64 = ir.IntType(64)


def _element(context, builder, signature, args):
    array_type, (array, index) = signature.args[0], args
    array = context.make_array(array_type)(context, builder, array)
    return cgutils.get_item_pointer(context, builder, array_type, array, [index])


@intrinsic
def fetch_add(typingctx, array, index, value):
    """array[index] += value (an int64) atomically (sequentially consistent); the value
    before."""

    def codegen(context, builder, signature, args):
        pointer = _element(context, builder, signature, args[:2])
        return builder.atomic_rmw("add", pointer, args[2], "seq_cst")

    return types.int64(array, index, types.int64), codegen


@intrinsic
def load(typingctx, array, index):
    """array[index] read with acquire order: writes made before a `fetch_add` that this
    value reflects are visible after it."""

    def codegen(context, builder, signature, args):
        return builder.load_atomic(_element(context, builder, signature, args), "acquire", 8)

    return types.int64(array, index), codegen


@intrinsic
def pause(typingctx):
    """The spin-wait hint (x86 `pause`): the waiting core yields its pipeline to its
    sibling and does not flood the memory system with loads; a no-op elsewhere."""

    def codegen(context, builder, signature, args):
        if _X86:
            hint = ir.FunctionType(ir.VoidType(), [])
            fn = cgutils.get_or_insert_function(builder.module, hint, "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.none(), codegen


@intrinsic
def ticks(typingctx):
    """A cycle counter (x86 time stamp counter); elsewhere 0, so that waits count turns."""

    def codegen(context, builder, signature, args):
        if not _X86:
            return ir.Constant(_I64, 0)
        counter = ir.FunctionType(_I64, [])
        fn = cgutils.get_or_insert_function(builder.module, counter, "llvm.readcyclecounter")
        return builder.call(fn, [])

    return types.int64(), codegen


@intrinsic
def yield_cpu(typingctx):
    """`sched_yield()`: let another runnable thread have this core."""

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield"
        )
        builder.call(fn, [])
        return context.get_dummy_value()

    return types.none(), codegen
