"""Vector code for an int8 cache's accumulate step, written as LLVM IR (Numba's `intrinsic`).

`accumulate_rows` adds a span's weighted V rows into the output rows of a KV head's group
with the sums in registers for the whole span: per token, each V vector is converted to
float32 once for every head, and each head's weight (times the token's V scale) broadcast
once. A Numba loop keeps one output row per pass (what LLVM vectorizes well): it converts
each V vector once per head and loads and stores the sums at every token.

Rows are read in vectors of `LANES` elements, masked: lanes past the row are neither read
nor written, and a pass's vectors past it (a row of 72 in passes of 64) read nothing.
Numba's extension API only, as `bf16.py`.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from pagedkv.ops.cpu.bf16 import declare, splat

LANES = 16
_F32, _I1, _I8, _I32, _I64 = (ir.FloatType(), ir.IntType(1), ir.IntType(8), ir.IntType(32),
                              ir.IntType(64))  # fmt: skip
_FAST = ("fast",)
_SMALLEST_NORMAL = 1.1754943508222875e-38
"""float32's smallest normal number, 2^-126."""


def _vec(t: ir.Type, n: int = LANES) -> ir.VectorType:
    return ir.VectorType(t, n)


def _lane_mask(builder: ir.IRBuilder, first: ir.Value, length: ir.Value) -> ir.Value:
    """<LANES x i1>: lane i is on where first + i < length (int64 scalars)."""
    lanes = ir.Constant(_vec(_I32), list(range(LANES)))
    room = builder.trunc(builder.sub(length, first), _I32)  # head_dim fits an int32
    return builder.icmp_signed("<", lanes, splat(builder, room, LANES))


def _masked_load(builder: ir.IRBuilder, ptr: ir.Value, elem: ir.Type, mask: ir.Value) -> ir.Value:
    """<LANES x elem> from `ptr`, zero where `mask` is off (nothing read there)."""
    vec = _vec(elem)
    name = f"llvm.masked.load.v{LANES}{_suffix(elem)}.p0"
    fn = declare(builder.module, name, vec, [elem.as_pointer(), _I32, _vec(_I1), vec])
    return builder.call(fn, [ptr, ir.Constant(_I32, 1), mask, ir.Constant(vec, None)])


def _masked_store(builder: ir.IRBuilder, value: ir.Value, ptr: ir.Value, mask: ir.Value) -> None:
    vec = value.type
    name = f"llvm.masked.store.v{LANES}{_suffix(vec.element)}.p0"
    fn = declare(builder.module, name, ir.VoidType(), [vec, vec.element.as_pointer(), _I32,
                                                        _vec(_I1)])  # fmt: skip
    builder.call(fn, [value, ptr, ir.Constant(_I32, 4), mask])


def _suffix(elem: ir.Type) -> str:
    return "f32" if elem == _F32 else f"i{elem.width}"


def _is_row_array(t: types.Type, dtypes: tuple[types.Type, ...]) -> bool:
    return isinstance(t, types.Array) and t.layout == "C" and t.dtype in dtypes


HEADS = 4
"""Output rows (heads of a group) that one pass of `accumulate_rows` holds in registers."""
CHUNKS = 4
"""Vectors of each such row a pass holds: HEADS x CHUNKS sums, the V vectors and a weight
fit AVX-512's 32 registers."""


@intrinsic
def accumulate_rows(typingctx, v, k, scales, slots, n, known, g, w, acc, h0,
                    num_heads):  # fmt: skip  # pragma: no cover
    """acc[h0 + i] += sum over t < n of w[h0 + i, t] * s_t * v[slots[t], g], for i <
    num_heads, s_t the V scale scales[slots[t], g]; and prefetch the K rows k[slots[t], g]
    of n <= t < known (the next span's).

    v, k: int8 [num_slots, num_kv_heads, D], C-contiguous (a cache's rows); scales:
    [num_slots, num_kv_heads] float16 bits (uint16); slots: int64; w: float32 [H, span];
    acc: float32 [H, D]. The sums stay in registers over all n tokens, a pass at a time of
    up to `HEADS` heads by `CHUNKS` vectors; each V vector is converted once per pass, for
    every head of it, and each scale once per pass."""
    ok = (_is_row_array(v, (types.int8,)) and v.ndim == 3 and k == v
          and _is_row_array(scales, (types.uint16,)) and scales.ndim == 2
          and _is_row_array(slots, (types.int64,)) and slots.ndim == 1
          and _is_row_array(w, (types.float32,)) and w.ndim == 2
          and _is_row_array(acc, (types.float32,)) and acc.ndim == 2)  # fmt: skip
    if not ok:
        return None

    def codegen(context, builder, sig, args):
        n_, known_, g_, h0_, heads_ = (
            context.cast(builder, args[i], sig.args[i], types.int64) for i in (4, 5, 6, 9, 10)
        )
        arrays = {i: context.make_array(sig.args[i])(context, builder, args[i])
                  for i in (0, 1, 2, 3, 7, 8)}  # fmt: skip
        shape = cgutils.unpack_tuple(builder, arrays[0].shape, 3)
        d, w_stride = shape[2], cgutils.unpack_tuple(builder, arrays[7].shape, 2)[1]
        rows = _Rows(arrays, shape[1], g_, d, w_stride)
        passes = builder.sdiv(builder.add(d, ir.Constant(_I64, LANES * CHUNKS - 1)),
                              ir.Constant(_I64, LANES * CHUNKS))  # fmt: skip
        blocks = builder.sdiv(builder.add(heads_, ir.Constant(_I64, HEADS - 1)),
                              ir.Constant(_I64, HEADS))  # fmt: skip
        sums = [cgutils.alloca_once(builder, _vec(_F32)) for _ in range(HEADS * CHUNKS)]
        with cgutils.for_range(builder, passes) as p, cgutils.for_range(builder, blocks) as b:
            first = builder.mul(p.index, ir.Constant(_I64, LANES * CHUNKS))
            head = builder.add(h0_, builder.mul(b.index, ir.Constant(_I64, HEADS)))
            left = builder.sub(builder.add(h0_, heads_), head)
            lead = builder.icmp_signed("==", builder.or_(p.index, b.index), ir.Constant(_I64, 0))
            tile = _Tile(rows, sums, first, head, n_, known_, lead)
            _per_count(builder, left, tile.run)
        return context.get_dummy_value()

    return types.none(v, k, scales, slots, n, known, g, w, acc, h0, num_heads), codegen


class _Rows:
    """`accumulate_rows`' data pointers (v, k, scales, slots, w, acc) and sizes, in IR."""

    def __init__(self, arrays, kv_heads, g, d, w_stride):  # type: ignore[no-untyped-def]
        self.v, self.k, self.scales, self.slots, self.w, self.acc = (
            arrays[i].data for i in (0, 1, 2, 3, 7, 8)
        )
        self.kv_heads, self.g, self.d, self.w_stride = kv_heads, g, d, w_stride

    def row_at(self, builder: ir.IRBuilder, slot: ir.Value) -> ir.Value:
        """The flat offset of head g's row of `slot` in v (and k)."""
        return builder.mul(builder.add(builder.mul(slot, self.kv_heads), self.g), self.d)

    def scale(self, builder: ir.IRBuilder, slot: ir.Value) -> ir.Value:
        """Head g's V scale of `slot`, as float32."""
        at = builder.add(builder.mul(slot, self.kv_heads), self.g)
        bits = builder.load(builder.gep(self.scales, [at]))
        return builder.fpext(builder.bitcast(bits, ir.HalfType()), _F32)


class _Tile:
    """One pass of `accumulate_rows`: `count` heads from `head`, vectors from `first`."""

    def __init__(self, rows, sums, first, head, n, known, lead):  # type: ignore[no-untyped-def]
        self.rows, self.sums, self.first, self.head = rows, sums, first, head
        self.n, self.known, self.lead = n, known, lead

    def run(self, builder: ir.IRBuilder, count: int) -> None:
        r = self.rows
        masks = [_lane_mask(builder, builder.add(self.first, ir.Constant(_I64, LANES * c)), r.d)
                 for c in range(CHUNKS)]  # fmt: skip
        outs = [[builder.gep(r.acc, [builder.add(builder.mul(builder.add(self.head, ir.Constant(
            _I64, i)), r.d), builder.add(self.first, ir.Constant(_I64, LANES * c)))])
            for c in range(CHUNKS)] for i in range(count)]  # fmt: skip
        for i in range(count):
            for c in range(CHUNKS):
                builder.store(_masked_load(builder, outs[i][c], _F32, masks[c]),
                              self.sums[i * CHUNKS + c])  # fmt: skip
        with cgutils.for_range(builder, self.n) as t:
            slot = builder.load(builder.gep(r.slots, [t.index]))
            base = builder.add(r.row_at(builder, slot), self.first)
            scale = r.scale(builder, slot)
            values = [builder.sitofp(_masked_load(builder, builder.gep(r.v, [builder.add(
                base, ir.Constant(_I64, LANES * c))]), _I8, masks[c]), _vec(_F32))
                for c in range(CHUNKS)]  # fmt: skip
            for i in range(count):
                at = builder.add(builder.mul(builder.add(self.head, ir.Constant(_I64, i)),
                                             r.w_stride), t.index)  # fmt: skip
                weight = builder.fmul(builder.load(builder.gep(r.w, [at])), scale, flags=_FAST)
                weight = splat(builder, _flushed(builder, weight), LANES)
                for c in range(CHUNKS):
                    total = self.sums[i * CHUNKS + c]
                    product = builder.fmul(weight, values[c], flags=_FAST)
                    builder.store(builder.fadd(builder.load(total), product, flags=_FAST), total)
            self._prefetch(builder, t.index)
        for i in range(count):
            for c in range(CHUNKS):
                _masked_store(builder, builder.load(self.sums[i * CHUNKS + c]), outs[i][c],
                              masks[c])  # fmt: skip

    def _prefetch(self, builder: ir.IRBuilder, t: ir.Value) -> None:
        """In the first pass: the lines of K row slots[n + t], head g, while n + t < known."""
        r = self.rows
        ahead = builder.add(self.n, t)
        wanted = builder.and_(self.lead, builder.icmp_signed("<", ahead, self.known))
        with builder.if_then(wanted, likely=False):
            base = r.row_at(builder, builder.load(builder.gep(r.slots, [ahead])))
            lines = builder.sdiv(builder.add(r.d, ir.Constant(_I64, 63)), ir.Constant(_I64, 64))
            fn = declare(builder.module, "llvm.prefetch.p0", ir.VoidType(),
                         [_I8.as_pointer()] + [_I32] * 3)  # fmt: skip
            with cgutils.for_range(builder, lines) as line:
                at = builder.add(base, builder.mul(line.index, ir.Constant(_I64, 64)))
                builder.call(fn, [builder.gep(r.k, [at])] + [ir.Constant(_I32, x)
                                                             for x in (0, 2, 1)])  # fmt: skip


def _flushed(builder: ir.IRBuilder, weight: ir.Value) -> ir.Value:
    """A weight smaller in magnitude than float32's smallest normal as 0. A softmax weight
    far below the largest times a V scale under 1 lands there, and every product and sum
    with such a subnormal operand takes the CPU's slow path (a model's attention, unlike
    random data, has many such tokens)."""
    fabs = declare(builder.module, "llvm.fabs.f32", _F32, [_F32])
    size = builder.call(fabs, [weight])
    tiny = builder.fcmp_ordered("<", size, ir.Constant(_F32, _SMALLEST_NORMAL))
    return builder.select(tiny, ir.Constant(_F32, 0.0), weight)


def _per_count(builder: ir.IRBuilder, left: ir.Value, body) -> None:  # type: ignore[no-untyped-def]
    """body(builder, count) for count = min(left, HEADS) (1..HEADS), each its own code."""
    merge = builder.append_basic_block("heads.done")
    cases = [builder.append_basic_block(f"heads.{count}") for count in range(1, HEADS + 1)]
    few = builder.select(builder.icmp_signed("<", left, ir.Constant(_I64, HEADS)), left,
                         ir.Constant(_I64, HEADS))  # fmt: skip
    switch = builder.switch(few, cases[-1])
    for count, block in enumerate(cases, start=1):
        switch.add_case(ir.Constant(_I64, count), block)
        builder.position_at_end(block)
        body(builder, count)
        builder.branch(merge)
    builder.position_at_end(merge)
