"""bfloat16 arithmetic for the CPU kernels: widening one value, and the decode spans of a
bfloat16 cache on the CPU's bfloat16 dot instruction.

NumPy has no bfloat16, so bfloat16 tensors reach Numba as their uint16 bits. A bfloat16 is
the high half of a float32, so widening is a shift and a bit cast (`as_float32`), which
LLVM vectorizes like any other load (the generic path of `kernels.py`).

CPUs with AVX512_BF16 multiply pairs of bfloat16 and add both products into a float32 lane
in one instruction (vdpbf16ps, which torch's own bfloat16 attention uses): 32 products per
instruction and no widening. LLVM never emits it from plain loops (its rounding differs
from two FMAs), so two loops are written here in LLVM IR with it as inline assembly:
`dot_bf16` (query rows . key rows, pairs along head_dim) and `accumulate_bf16` (weights x
V rows, pairs along tokens: two tokens' V values interleaved, their weights rounded to
bfloat16 as torch rounds them). `score_span` and `accumulate_span` walk a span with them;
`prefetch_rows` (both dtypes) asks for the rows ahead of the score loops.

Whether the target has the instruction is decided when the kernels compile
(`HAS_DOT_INSTRUCTION`, for the CPU Numba compiles for, which is in Numba's cache key);
without it the same loops do two FMAs per pair on widened values, and the plan keeps
bfloat16 rows on the generic path anyway (`pagedkv.ops.cpu.uses_dot`). Standard Numba
extension API only: `numba.extending` (intrinsic, overload) and `llvmlite`.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import binding, ir
from numba import njit, types
from numba.extending import intrinsic, overload

LANES = 16
"""float32 lanes of one accumulator (a 512-bit register); one step reads 2 x LANES values."""
STEP = 2 * LANES
"""bfloat16 values per step: rows passed to `dot_bf16` are a multiple of this long."""

_F32, _I32, _I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
_F32X16, _I32X16 = ir.VectorType(_F32, LANES), ir.VectorType(_I32, LANES)


def _target_has_dot() -> bool:
    """Whether the CPU Numba compiles for has AVX512_BF16 (Numba's NUMBA_CPU_NAME and
    NUMBA_CPU_FEATURES settings, else this machine)."""
    features = numba.config.CPU_FEATURES
    if features:
        return "+avx512bf16" in features.split(",")
    if numba.config.CPU_NAME not in (None, "host"):
        return False  # a named generic target: assume the oldest CPU of its kind
    return bool(binding.get_host_cpu_features().get("avx512bf16", False))


HAS_DOT_INSTRUCTION = _target_has_dot()
if HAS_DOT_INSTRUCTION:
    binding.initialize_native_asmparser()  # LLVM assembles inline assembly with it


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


def _pairs_dot(builder: ir.IRBuilder, acc: ir.Value, a: ir.Value, b: ir.Value) -> ir.Value:
    """acc[i] + a[2i] * b[2i] + a[2i + 1] * b[2i + 1]: a and b hold 32 bfloat16 each, two
    per int32 lane (element 2i in the low half)."""
    if HAS_DOT_INSTRUCTION:
        # AT&T operand order: $0 is the result, tied to $1 (acc); $2, $3 the pairs.
        fn = ir.FunctionType(_F32X16, [_F32X16, _I32X16, _I32X16])
        return builder.asm(fn, "vdpbf16ps $3, $2, $0", "=v,0,v,v", [acc, a, b], False)
    fma = _declare(builder.module, "llvm.fma.v16f32", _F32X16, [_F32X16] * 3)
    high = ir.Constant(_I32X16, [-65536] * LANES)  # 0xFFFF0000: the odd element in place
    sixteen = ir.Constant(_I32X16, [16] * LANES)
    for part in (lambda x: builder.shl(x, sixteen), lambda x: builder.and_(x, high)):
        wide_a, wide_b = (builder.bitcast(part(x), _F32X16) for x in (a, b))
        acc = builder.call(fma, [wide_a, wide_b, acc])
    return acc


def _declare(module: ir.Module, name: str, ret: ir.Type, params: list[ir.Type]) -> ir.Function:
    """The LLVM intrinsic `name` in `module`, declared on first use."""
    return module.globals.get(name) or ir.Function(module, ir.FunctionType(ret, params), name)


def _lane_sums(builder: ir.IRBuilder, accs: list[ir.Value]) -> list[ir.Value]:
    """The lane sum of each of up to 8 accumulators, reduced together: each level halves
    the partial sums per accumulator and packs two accumulators into one vector (a
    transposing tree: fewer shuffles than reducing each on its own)."""
    size = 4 if len(accs) <= 4 else 8
    level = accs + [ir.Constant(_F32X16, [0.0] * LANES)] * (size - len(accs))
    width = LANES // 2
    while len(level) > 1:
        nxt = []
        for x, y in zip(level[0::2], level[1::2], strict=True):
            low = [s + g + i for s in (0, LANES) for g in range(0, LANES, 2 * width)
                   for i in range(width)]  # fmt: skip
            high = [j + width for j in low]
            shuffles = (builder.shuffle_vector(x, y, ir.Constant(_I32X16, idx))
                        for idx in (low, high))  # fmt: skip
            nxt.append(builder.fadd(*shuffles))
        level, width = nxt, width // 2
    vec, group = level[0], LANES // size  # lanes group * j ...: partial sums of accs[j]
    shift = group // 2
    while shift:
        moved = builder.shuffle_vector(
            vec, vec, ir.Constant(_I32X16, [(i + shift) % LANES for i in range(LANES)])
        )
        vec, shift = builder.fadd(vec, moved), shift // 2
    return [builder.extract_element(vec, ir.Constant(_I32, group * j)) for j in range(len(accs))]


def _pointer(context, builder, arr_type, arr, offset, offset_type, to):  # type: ignore[no-untyped-def]
    """Address of element `offset` of a C-contiguous array, cast to a pointer to `to`."""
    data = context.make_array(arr_type)(context, builder, arr).data
    index = context.cast(builder, offset, offset_type, types.int64)
    return builder.bitcast(builder.gep(data, [index]), to.as_pointer())


class _Loop:
    """`with _Loop(builder, count) as loop:` emits a loop over loop.index = 0 .. count - 1
    (count >= 1, int64) around the body; `entry` and `latch` are the blocks that enter and
    repeat it, for values carried from one iteration to the next (phi nodes)."""

    def __init__(self, builder: ir.IRBuilder, count: ir.Value) -> None:
        self.builder, self.count = builder, count

    def __enter__(self) -> _Loop:
        b = self.builder
        self.entry = b.block
        self.body, self.done = b.append_basic_block("loop"), b.append_basic_block("loop.end")
        b.branch(self.body)
        b.position_at_end(self.body)
        self.index = b.phi(_I64)
        self.index.add_incoming(ir.Constant(_I64, 0), self.entry)
        return self

    def __exit__(self, *exc: object) -> None:
        b = self.builder
        self.latch = b.block
        following = b.add(self.index, ir.Constant(_I64, 1))
        self.index.add_incoming(following, self.latch)
        b.cbranch(b.icmp_unsigned("<", following, self.count), self.body, self.done)
        b.position_at_end(self.done)


def _row_pointers(context, builder, sig, args, i, to):  # type: ignore[no-untyped-def]
    """Pointers to `to` at each offset of the tuple args[i + 1] into the array args[i]."""
    offsets, offset_type = args[i + 1], sig.args[i + 1]
    return [
        _pointer(context, builder, sig.args[i], args[i], builder.extract_value(offsets, j),
                 offset_type.dtype, to)
        for j in range(offset_type.count)
    ]  # fmt: skip


def _int64(context, builder, sig, args, i):  # type: ignore[no-untyped-def]
    return context.cast(builder, args[i], sig.args[i], types.int64)


def _is_array(a: types.Type, dtype: types.Type) -> bool:
    return isinstance(a, types.Array) and a.dtype == dtype and a.layout == "C"


@intrinsic
def dot_bf16(typingctx, q, q_offset, k, k_offsets, length, count):  # pragma: no cover
    """Dot products of four query rows with each of two key rows, bfloat16 bits (uint16).

    Query row j is q.flat[q_offset + j * length :][:length] for j < `count` (1..4; rows
    past it repeat the last, whose sums are not meant to be read), key row i
    k.flat[k_offsets[i]:][:length]; both arrays C-contiguous; `length` a positive multiple
    of `STEP`. Returns 8 float32 sums, key row 0's first (products exact, sums in float32,
    as torch's bfloat16 matmuls on such CPUs). Each key load feeds four dot instructions
    and each query load two; the eight sums reduce together (`_lane_sums`).
    """
    if not (_is_array(q, types.uint16) and _is_array(k, types.uint16)):
        return None
    if not (isinstance(k_offsets, types.UniTuple) and k_offsets.count == 2):
        return None

    def codegen(context, builder, sig, args):
        q_ptr = _pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1], _I32X16)
        k_ptrs = _row_pointers(context, builder, sig, args, 2, _I32X16)
        steps = builder.udiv(_int64(context, builder, sig, args, 4), ir.Constant(_I64, STEP))
        last = builder.sub(_int64(context, builder, sig, args, 5), ir.Constant(_I64, 1))
        starts = []  # where query row j starts, in steps
        for j in range(4):
            row = ir.Constant(_I64, j)
            row = builder.select(builder.icmp_signed("<", row, last), row, last)
            starts.append(builder.mul(steps, row))
        with _Loop(builder, steps) as loop:
            accs = [builder.phi(_F32X16) for _ in range(8)]
            keys = [builder.load(builder.gep(p, [loop.index]), align=2) for p in k_ptrs]
            queries = [builder.load(builder.gep(q_ptr, [builder.add(loop.index, start)]),
                                    align=2) for start in starts]  # fmt: skip
            sums = [_pairs_dot(builder, accs[4 * i + j], queries[j], keys[i])
                    for i in range(2) for j in range(4)]  # fmt: skip
        for phi, value in zip(accs, sums, strict=True):
            phi.add_incoming(ir.Constant(_F32X16, [0.0] * LANES), loop.entry)
            phi.add_incoming(value, loop.latch)
        return context.make_tuple(builder, sig.return_type, _lane_sums(builder, sums))

    return types.UniTuple(types.float32, 8)(q, q_offset, k, k_offsets, length, count), codegen


@intrinsic
def accumulate_bf16(typingctx, acc, acc_offset, weights, weights_offset, weights_stride, v,
                    rows, length, count):  # fmt: skip  # pragma: no cover
    """acc[j] += the r V rows weighted by head j's r weights, for heads j < `count`.

    acc: float32, head j's row at acc.flat[acc_offset + j * length :][:length]; weights:
    bfloat16 bits (uint16), head j's r at weights.flat[weights_offset + j *
    weights_stride :][:r]; v: bfloat16 bits, `rows` a tuple of the r rows' flat offsets (r
    even); `length` a positive multiple of `LANES`; `count` a literal 1..4.

    Per 16 lanes: tokens 0 and 1, 2 and 3, ... interleaved into bfloat16 pairs (a shuffle
    each, shared by the heads), then r / 2 dot instructions between one load and one store
    of each head's slice; the weights pair up alike (32-bit words), broadcast once.
    """
    if not (isinstance(count, types.IntegerLiteral) and 1 <= count.literal_value <= 4):
        return None
    if not (_is_array(acc, types.float32) and _is_array(weights, types.uint16)
            and _is_array(v, types.uint16)):  # fmt: skip
        return None
    if not (isinstance(rows, types.UniTuple) and rows.count % 2 == 0):
        return None
    heads, pairs_per_head = count.literal_value, rows.count // 2
    half_vector = ir.VectorType(ir.IntType(16), LANES)
    interleave = ir.Constant(ir.VectorType(_I32, STEP), [i // 2 + (i % 2) * LANES
                                                         for i in range(STEP)])  # fmt: skip

    def codegen(context, builder, sig, args):
        acc_ptr = _pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1], _F32X16)
        w_ptr = _pointer(context, builder, sig.args[2], args[2], args[3], sig.args[3], _I32)
        w_stride = builder.udiv(_int64(context, builder, sig, args, 4), ir.Constant(_I64, 2))
        pairs = [
            _splat(builder, builder.load(builder.gep(w_ptr, [builder.add(
                builder.mul(w_stride, ir.Constant(_I64, j)), ir.Constant(_I64, half))]), align=2))
            for j in range(heads) for half in range(pairs_per_head)
        ]  # fmt: skip  # head j's tokens (2i, 2i + 1) at pairs_per_head * j + i
        row_ptrs = _row_pointers(context, builder, sig, args, 5, half_vector)
        steps = builder.udiv(_int64(context, builder, sig, args, 7), ir.Constant(_I64, LANES))
        with _Loop(builder, steps) as chunk:
            row = [builder.load(builder.gep(p, [chunk.index]), align=2) for p in row_ptrs]
            values = [builder.bitcast(builder.shuffle_vector(row[i], row[i + 1], interleave),
                                      _I32X16) for i in range(0, rows.count, 2)]  # fmt: skip
            for j in range(heads):
                at = builder.gep(acc_ptr, [builder.add(
                    builder.mul(steps, ir.Constant(_I64, j)), chunk.index)])  # fmt: skip
                total = builder.load(at, align=4)
                for i in range(pairs_per_head):
                    total = _pairs_dot(builder, total, pairs[pairs_per_head * j + i], values[i])
                builder.store(total, at, align=4)
        return context.get_dummy_value()

    signature = types.none(acc, acc_offset, weights, weights_offset, weights_stride, v, rows,
                           length, count)  # fmt: skip
    return signature, codegen


def _splat(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """x in every lane."""
    first = builder.insert_element(ir.Constant(_I32X16, ir.Undefined), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(first, first, ir.Constant(_I32X16, [0] * LANES))


@intrinsic
def _float32_to_bits(typingctx, x):  # pragma: no cover
    """The bits of a float32 as uint32 (a bit cast, no conversion)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], _I32)

    return types.uint32(types.float32), codegen


@njit(inline="always")
def round_to_bf16(x):  # pragma: no cover
    """A finite float32 rounded to the nearest bfloat16 (ties to even), as its bits in the
    low half of a uint32."""
    bits = _float32_to_bits(x)
    return (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)


AHEAD = 2
"""Tokens between a K row's prefetch and its first read."""


@intrinsic
def _prefetch(typingctx, cache, offset):  # pragma: no cover
    """Load the line of cache.flat[offset] (C-contiguous) into L2: a hint, it never faults."""
    if not (isinstance(cache, types.Array) and cache.layout == "C"):
        return None

    def codegen(context, builder, sig, args):
        byte = ir.IntType(8)
        at = _pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1], byte)
        fn = _declare(builder.module, "llvm.prefetch.p0", ir.VoidType(),
                      [byte.as_pointer()] + [_I32] * 3)  # fmt: skip
        builder.call(fn, [at] + [ir.Constant(_I32, x) for x in (0, 2, 1)])  # read, L2, data
        return context.get_dummy_value()

    return types.none(cache, offset), codegen


@njit(inline="always")
def prefetch_rows(key_cache, value_cache, slots, t, known):  # pragma: no cover
    """Before token t of a span is scored, prefetch the K row `AHEAD` tokens on (if before
    `known`) and token t's V row (read after the span's softmax): blocks are scattered, so the
    hardware prefetcher does not run across them. Caches [slots, kv heads, D], C-contiguous."""
    row = key_cache.shape[1] * key_cache.shape[2]
    line = 64 // key_cache.itemsize
    for c in range(0, row, line):
        if t + AHEAD < known:
            _prefetch(key_cache, slots[t + AHEAD] * row + c)
        _prefetch(value_cache, slots[t] * row + c)


@njit(fastmath=True)
def score_span(q_bits, key_cache, value_cache, slots, n, known, scale, scores):  # pragma: no cover
    """`kernels._score_span` for a bfloat16 cache through `dot_bf16`: q_bits [H, D] uint16, the
    query row's bfloat16 bits; head_dim a multiple of `STEP`. Tiles of two tokens x four
    heads of a group (a group's last tile may hold fewer)."""
    num_heads, head_dim = q_bits.shape
    num_kv_heads = key_cache.shape[1]
    group, row = num_heads // num_kv_heads, num_kv_heads * head_dim
    for t in range(0, n, 2):
        prefetch_rows(key_cache, value_cache, slots, t, known)
        prefetch_rows(key_cache, value_cache, slots, min(t + 1, n - 1), known)
        r0, r1 = slots[t] * row, slots[min(t + 1, n - 1)] * row
        for g in range(num_kv_heads):
            k = (r0 + g * head_dim, r1 + g * head_dim)
            for h in range(g * group, (g + 1) * group, 4):
                count = min((g + 1) * group - h, 4)
                sums = dot_bf16(q_bits, h * head_dim, key_cache, k, head_dim, count)
                for i in range(min(2, n - t)):  # a span's odd last token is scored twice
                    for j in range(count):
                        scores[h + j, t + i] = sums[4 * i + j] * scale


@njit(fastmath=True)
def accumulate_span(value_cache, slots, n, weights, acc, weight_bits):  # pragma: no cover
    """`kernels._accumulate_span` for a bfloat16 cache through `accumulate_bf16`, eight tokens
    at a time: the weights rounded to bfloat16 (as torch's bfloat16 attention rounds them) into
    `weight_bits` (uint16 [H, span], span a multiple of 8); past n, weight 0 on the last row."""
    num_heads, head_dim = acc.shape
    num_kv_heads = value_cache.shape[1]
    group, row, span = num_heads // num_kv_heads, num_kv_heads * head_dim, weights.shape[1]
    for h in range(num_heads):
        for t in range(n):
            weight_bits[h, t] = round_to_bf16(weights[h, t])
        for t in range(n, -(-n // 8) * 8):
            weight_bits[h, t] = 0
    last = n - 1
    for t in range(0, n, 8):
        r0, r1 = slots[t] * row, slots[min(t + 1, last)] * row
        r2, r3 = slots[min(t + 2, last)] * row, slots[min(t + 3, last)] * row
        r4, r5 = slots[min(t + 4, last)] * row, slots[min(t + 5, last)] * row
        r6, r7 = slots[min(t + 6, last)] * row, slots[min(t + 7, last)] * row
        for g in range(num_kv_heads):
            at = g * head_dim
            rows = (r0 + at, r1 + at, r2 + at, r3 + at, r4 + at, r5 + at, r6 + at, r7 + at)
            for h in range(g * group, (g + 1) * group, 4):
                a, w, left = h * head_dim, h * span + t, (g + 1) * group - h
                # The head count is a literal: the intrinsic unrolls its heads.
                if left >= 4:
                    accumulate_bf16(acc, a, weight_bits, w, span, value_cache, rows, head_dim, 4)
                elif left == 3:
                    accumulate_bf16(acc, a, weight_bits, w, span, value_cache, rows, head_dim, 3)
                elif left == 2:
                    accumulate_bf16(acc, a, weight_bits, w, span, value_cache, rows, head_dim, 2)
                else:
                    accumulate_bf16(acc, a, weight_bits, w, span, value_cache, rows, head_dim, 1)
