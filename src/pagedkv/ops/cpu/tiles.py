"""Vector code for an int8 cache's accumulate step, written as LLVM IR (Numba's `intrinsic`).

`accumulate_tile` converts four V rows to float32 once for every head of a KV head's group
and adds them, weighted, into each head's output row. A Numba loop with one output row (what
LLVM vectorizes well) converts them once per head: two instructions per 16 elements and
head beside one multiply-add, most of the loop's work.

Rows are read in vectors of `LANES` elements; the last one of a row whose length is not a
multiple is read masked, so no vector reaches past the row.
Numba's extension API only, as `bf16.py`.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from pagedkv.ops.cpu.bf16 import declare, pointer

LANES = 16
TOKENS = 4
"""V rows per tile (the span loops take four tokens at once)."""
_F32, _I1, _I8, _I32, _I64 = (ir.FloatType(), ir.IntType(1), ir.IntType(8), ir.IntType(32),
                              ir.IntType(64))  # fmt: skip
_FAST = ("fast",)


def _vec(t: ir.Type, n: int = LANES) -> ir.VectorType:
    return ir.VectorType(t, n)


def _lane_mask(builder: ir.IRBuilder, first: ir.Value, length: ir.Value) -> ir.Value:
    """<LANES x i1>: lane i is on where first + i < length (int64 scalars)."""
    lanes = ir.Constant(_vec(_I32), list(range(LANES)))
    room = builder.trunc(builder.sub(length, first), _I32)  # head_dim fits an int32
    return builder.icmp_signed("<", lanes, _splat(builder, room, _I32))


def _splat(builder: ir.IRBuilder, x: ir.Value, t: ir.Type) -> ir.Value:
    """x in every lane of a <LANES x t>."""
    one = builder.insert_element(ir.Constant(_vec(t), None), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, one, ir.Constant(_vec(_I32), [0] * LANES))


def _masked_load(builder: ir.IRBuilder, ptr: ir.Value, elem: ir.Type, mask: ir.Value) -> ir.Value:
    """<LANES x elem> from `ptr`, zero where `mask` is off (nothing read there)."""
    vec = _vec(elem)
    name = f"llvm.masked.load.v{LANES}{_suffix(elem)}.p0"
    fn = declare(builder.module, name, vec, [elem.as_pointer(), _I32, _vec(_I1), vec])
    return builder.call(fn, [ptr, ir.Constant(_I32, 1), mask, ir.Constant(vec, None)])


def _load(builder: ir.IRBuilder, ptr: ir.Value, elem: ir.Type, mask: ir.Value | None) -> ir.Value:
    """<LANES x elem> from `ptr`: all lanes where `mask` is None, else `_masked_load`."""
    if mask is not None:
        return _masked_load(builder, ptr, elem, mask)
    return builder.load(builder.bitcast(ptr, _vec(elem).as_pointer()), align=1)


def _store(builder: ir.IRBuilder, value: ir.Value, ptr: ir.Value, mask: ir.Value | None) -> None:
    """`value` to `ptr`: all lanes where `mask` is None, else `_masked_store`."""
    if mask is not None:
        _masked_store(builder, value, ptr, mask)
    else:
        builder.store(value, builder.bitcast(ptr, value.type.as_pointer()), align=4)


def _chunks(builder: ir.IRBuilder, length: ir.Value, body) -> None:  # type: ignore[no-untyped-def]
    """body(first, mask) for each vector of a row of `length` (int64) elements: whole
    vectors with mask None (plain loads and stores), then the rest, if any, with its lane
    mask."""
    lanes = ir.Constant(_I64, LANES)
    whole = builder.sdiv(length, lanes)
    with cgutils.for_range(builder, whole) as loop:
        body(builder.mul(loop.index, lanes), None)
    first = builder.mul(whole, lanes)
    with builder.if_then(builder.icmp_signed("<", first, length), likely=False):
        body(first, _lane_mask(builder, first, length))


def _masked_store(builder: ir.IRBuilder, value: ir.Value, ptr: ir.Value, mask: ir.Value) -> None:
    vec = value.type
    name = f"llvm.masked.store.v{LANES}{_suffix(vec.element)}.p0"
    fn = declare(builder.module, name, ir.VoidType(), [vec, vec.element.as_pointer(), _I32,
                                                        _vec(_I1)])  # fmt: skip
    builder.call(fn, [value, ptr, ir.Constant(_I32, 4), mask])


def _suffix(elem: ir.Type) -> str:
    return "f32" if elem == _F32 else f"i{elem.width}"


def _row(context, builder, arr_type, arr, at, at_type, first, elem):  # type: ignore[no-untyped-def]
    """Pointer to arr.flat[at + first] as `elem`*."""
    offset = builder.add(context.cast(builder, at, at_type, types.int64), first)
    return pointer(context, builder, arr_type, arr, offset, types.int64, elem)


def _is_row_array(t: types.Type, dtypes: tuple[types.Type, ...]) -> bool:
    return isinstance(t, types.Array) and t.layout == "C" and t.dtype in dtypes


@intrinsic
def accumulate_tile(typingctx, v, v_at, head_dim, w, w_at, w_stride, num_heads, acc,
                    acc_at):  # fmt: skip  # pragma: no cover
    """For i < num_heads: acc.flat[acc_at + i * head_dim:][:head_dim] += sum over t < 4 of
    w.flat[w_at + i * w_stride + t] * v.flat[v_at[t]:][:head_dim].

    v: int8, C-contiguous (the rows of a cache); w, acc: float32, C-contiguous; v_at: 4
    int64 row offsets. Each V vector is converted once for all the heads."""
    ok = (_is_row_array(v, (types.int8,)) and _is_row_array(w, (types.float32,))
          and _is_row_array(acc, (types.float32,)) and isinstance(v_at, types.UniTuple)
          and v_at.count == TOKENS)  # fmt: skip
    if not ok:
        return None

    def codegen(context, builder, sig, args):
        v_arr, v_offsets, d_arg, w_arr, w_first, w_step, heads_arg, acc_arr, acc_first = args
        d = context.cast(builder, d_arg, sig.args[2], types.int64)
        w_at = context.cast(builder, w_first, sig.args[4], types.int64)
        w_stride = context.cast(builder, w_step, sig.args[5], types.int64)
        heads = context.cast(builder, heads_arg, sig.args[6], types.int64)
        a_at = context.cast(builder, acc_first, sig.args[8], types.int64)
        v_rows = [builder.extract_value(v_offsets, t) for t in range(TOKENS)]

        def chunk(first, mask):
            values = [builder.sitofp(_load(builder, _row(
                context, builder, v, v_arr, at, types.int64, first, _I8), _I8, mask),
                _vec(_F32)) for at in v_rows]  # fmt: skip
            with cgutils.for_range(builder, heads) as head:
                w_row = builder.add(w_at, builder.mul(head.index, w_stride))
                total = None
                for t in range(TOKENS):
                    ptr = pointer(context, builder, w, w_arr, builder.add(
                        w_row, ir.Constant(_I64, t)), types.int64, _F32)  # fmt: skip
                    prod = builder.fmul(_splat(builder, builder.load(ptr), _F32), values[t],
                                        flags=_FAST)  # fmt: skip
                    total = prod if total is None else builder.fadd(total, prod, flags=_FAST)
                row = builder.add(a_at, builder.add(builder.mul(head.index, d), first))
                ptr = pointer(context, builder, acc, acc_arr, row, types.int64, _F32)
                old = _load(builder, ptr, _F32, mask)
                _store(builder, builder.fadd(old, total, flags=_FAST), ptr, mask)

        _chunks(builder, d, chunk)
        return context.get_dummy_value()

    return types.none(v, v_at, head_dim, w, w_at, w_stride, num_heads, acc, acc_at), codegen
