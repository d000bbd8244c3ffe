"""C-callable entry points of the CPU decode kernels, for the C++ launcher (`cpu_launch`).

Reaching a kernel from Python costs ~13 us on a 0.1 ms call once another kernel has swept
the caches: ~10 us of Python reading tensor attributes and ~3 us of Numba's dispatcher. The
launcher checks the tensors in C++ and calls these functions by address with three int64
argument blocks; they run the same code as `cpu_kernels.decode` and `plan_and_decode`.

Threads: a `cfunc` cannot hold a parallel loop (with `parallel=True` it silently runs
nothing, Numba 0.68), so an entry starts the workers itself with `GOMP_parallel`, the
OpenMP runtime that torch and Numba's threading layer share in this process; each worker
is a `cfunc` that finds its share by `omp_get_thread_num`. Everything here is cached on
disk like the kernels (no parallel loop, addresses arrive as arguments).

Blocks, below: int64 arrays. C++ writes CALL per call; Python writes CACHES once per cache
pair and PLAN once per plan (`cpu_launch`). `csrc/cpu_launch.cpp` names the slots it uses
again, and the loader checks that the two agree.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import cfunc, njit, types
from numba.extending import intrinsic

from pagedkv.ops.cpu_kernels import (
    JIT,
    NEEDS_PREFILL,
    _call_int_function,
    _combine,
    _partial_states,
    _pointer,
    _run_worker,
    count_workers,
    partial_state_views,
    prefetch_mode,
    write_rows,
)
from pagedkv.ops.cpu_plan import OK, plan_items

# CALL: one call's tensors, written by C++ per call.
(
    CALL_QUERY,  # data_ptr of the float32 contiguous query [num_tokens, num_heads, head_dim]
    CALL_OUT,  # data_ptr of the float32 output, same shape
    CALL_NUM_TOKENS,
    CALL_NUM_HEADS,
    CALL_SCALE,  # the softmax scale's float64 bits
    CALL_STATUS,  # written by the entry: cpu_plan.OK, an error code or NEEDS_PREFILL
    CALL_TABLES,  # plan_and_decode only: int32 block_tables [num_seqs, max_blocks]
    CALL_NUM_SEQS,
    CALL_MAX_BLOCKS,
    CALL_LENS,  # int32 seq_lens [num_seqs]
    CALL_STARTS,  # int32 query_start_loc [num_seqs + 1]
    CALL_WINDOW,  # sliding window, 0 for none
    CALL_SLOTS,
) = range(13)


# CACHES: a cache pair, written once by `cpu.py` (C++ reads the first five to check a call).
(
    CACHES_KEY,  # key_cache.data_ptr(), also the start of its flat view
    CACHES_VALUE,
    CACHES_HEAD_DIM,
    CACHES_NUM_KV_HEADS,
    CACHES_MAX_DECODE_QUERY,  # cpu.MAX_DECODE_QUERY
    CACHES_ELEMENTS,  # elements in each flat cache
    CACHES_BLOCK_SIZE,
    CACHES_THREADS,  # cpu_kernels.thread_count_address()
    CACHES_GOMP_PARALLEL,  # address of GOMP_parallel
    CACHES_THREAD_NUM,  # address of omp_get_thread_num
    CACHES_TEAM_SIZE,  # address of omp_get_num_threads
    CACHES_WORKER,  # the worker cfunc of the caches' element type
    CACHES_ELEMENT_SIZE,  # 4 (float32) or 2 (bfloat16)
    CACHES_SLOTS,
) = range(14)

# PLAN: a planned batch (`cpu._Plan`), written once per plan (C++ reads PLAN_NUM_TOKENS).
(
    PLAN_NUM_TOKENS,
    PLAN_TABLES,  # int32 [num_seqs, max_blocks]
    PLAN_NUM_SEQS,
    PLAN_MAX_BLOCKS,
    PLAN_ITEMS,  # int64 [num_items, 6]
    PLAN_NUM_ITEMS,
    PLAN_SPLITS,  # int64 [num_splits, 3]
    PLAN_NUM_SPLITS,
    PLAN_NUM_WORKERS,
    PLAN_PREFETCH,
    PLAN_SLOTS,
) = range(11)

# WRITE: one `write_kv` call, written by C++ per call.
(
    WRITE_KEY,  # data_ptr of the contiguous new keys [num_tokens, num_kv_heads, head_dim]
    WRITE_VALUE,
    WRITE_SLOTS,  # data_ptr of the contiguous slot_mapping
    WRITE_IS_INT64,  # 1: int64 slots, 0: int32
    WRITE_NUM_TOKENS,
    WRITE_RESULT,  # written by the entry: -1, or the first token whose slot is past the end
    WRITE_SLOTS_COUNT,
) = range(7)

# ROWS: a cache pair as raw rows (`cpu._bytes`), written once by `cpu.py` (C++ reads them all).
(
    ROWS_KEY,  # key_cache.data_ptr()
    ROWS_VALUE,
    ROWS_NUM_KV_HEADS,
    ROWS_HEAD_DIM,
    ROWS_NUM_SLOTS,  # num_blocks * block_size
    ROWS_WORDS,  # words per row (uint64 when a row is a multiple of 8 bytes, else bytes)
    ROWS_SLOTS,
) = range(7)

# WORK: what every worker reads, built by an entry per call.
(
    WORK_QUERY,
    WORK_OUT,
    WORK_NUM_TOKENS,
    WORK_NUM_HEADS,
    WORK_HEAD_DIM,
    WORK_KEY,
    WORK_VALUE,
    WORK_ELEMENTS,
    WORK_BLOCK_SIZE,
    WORK_NUM_KV_HEADS,
    WORK_TABLES,
    WORK_NUM_SEQS,
    WORK_MAX_BLOCKS,
    WORK_ITEMS,
    WORK_NUM_ITEMS,
    WORK_PARTS,  # the partial states' buffer (`cpu_kernels.partial_state_views`)
    WORK_NUM_PARTS,
    WORK_SCALE,
    WORK_NUM_WORKERS,
    WORK_PREFETCH,
    WORK_THREAD_NUM,
    WORK_TEAM_SIZE,
    WORK_SLOTS,
) = range(23)
CALL_BLOCK = CALL_SLOTS + WORK_SLOTS
"""Length of the CALL block C++ provides: its slots, then room for the WORK block (the
workers read it, so it lives in the caller's frame until they are done)."""


@intrinsic
def _address(typingctx, pointer):  # pragma: no cover
    """A `voidptr` as an integer address."""
    if not isinstance(pointer, types.RawPointer):
        return None

    def codegen(context, builder, signature, args):
        return builder.ptrtoint(args[0], ir.IntType(64))

    return types.int64(pointer), codegen


@intrinsic
def _f64_from_bits(typingctx, bits):  # pragma: no cover
    """An int64 holding a float64's bits (CALL_SCALE, written by C++) as the float64."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())

    return types.float64(bits), codegen


@intrinsic
def _gomp_parallel(typingctx, gomp, worker, data, num_threads):  # pragma: no cover
    """GOMP_parallel(worker, data, num_threads, 0) through its address: `worker(data)` on
    `num_threads` threads of the OpenMP team, the calling thread one of them."""
    if not all(isinstance(t, types.Integer) for t in (gomp, worker, data, num_threads)):
        return None

    def codegen(context, builder, signature, args):
        byte_ptr = ir.IntType(8).as_pointer()
        worker_type = ir.FunctionType(ir.VoidType(), [byte_ptr])
        gomp_type = ir.FunctionType(
            ir.VoidType(), [worker_type.as_pointer(), byte_ptr, ir.IntType(32), ir.IntType(32)]
        )
        builder.call(
            builder.inttoptr(args[0], gomp_type.as_pointer()),
            [
                builder.inttoptr(args[1], worker_type.as_pointer()),
                builder.inttoptr(args[2], byte_ptr),
                builder.trunc(args[3], ir.IntType(32)),
                ir.Constant(ir.IntType(32), 0),
            ],
        )
        return context.get_dummy_value()

    return types.none(gomp, worker, data, num_threads), codegen


@njit(cache=True, inline="always", **JIT)
def _work(work, worker, num_workers, like):  # pragma: no cover
    """Worker `worker`'s share of the items described by the WORK block; `like`: the caches'
    element type (np.float32, or np.uint16 for bfloat16 bits)."""
    num_tokens, num_heads, head_dim = (
        work[WORK_NUM_TOKENS],
        work[WORK_NUM_HEADS],
        work[WORK_HEAD_DIM],
    )
    num_parts = work[WORK_NUM_PARTS]
    query = numba.carray(_pointer(work[WORK_QUERY], np.float32), (num_tokens, num_heads, head_dim))
    out = numba.carray(_pointer(work[WORK_OUT], np.float32), (num_tokens, num_heads, head_dim))
    key = numba.carray(_pointer(work[WORK_KEY], like), (work[WORK_ELEMENTS],))
    value = numba.carray(_pointer(work[WORK_VALUE], like), (work[WORK_ELEMENTS],))
    tables = numba.carray(
        _pointer(work[WORK_TABLES], np.int32), (work[WORK_NUM_SEQS], work[WORK_MAX_BLOCKS])
    )
    items = numba.carray(_pointer(work[WORK_ITEMS], np.int64), (work[WORK_NUM_ITEMS], 6))
    parts = numba.carray(
        _pointer(work[WORK_PARTS], np.float32), (num_parts * num_heads * (head_dim + 2),)
    )
    part_acc, part_m, part_l = partial_state_views(parts, num_parts, num_heads, head_dim)
    _run_worker(worker, num_workers, query, key, value, work[WORK_BLOCK_SIZE],
                work[WORK_NUM_KV_HEADS], tables, items, _f64_from_bits(work[WORK_SCALE]), out,
                part_acc, part_m, part_l, work[WORK_PREFETCH])  # fmt: skip


@njit(cache=True, inline="always", **JIT)
def _share(work, like):  # pragma: no cover
    """This thread's workers: its own, and those of threads the team did not get (OpenMP
    may start fewer than asked for, e.g. inside another parallel region)."""
    num_workers = work[WORK_NUM_WORKERS]
    thread = _call_int_function(work[WORK_THREAD_NUM])
    team_size = _call_int_function(work[WORK_TEAM_SIZE])
    for worker in range(thread, num_workers, max(team_size, 1)):
        _work(work, worker, num_workers, like)


@cfunc(types.void(types.voidptr), cache=True, **JIT)
def worker_float32(data):  # pragma: no cover
    work = numba.carray(_pointer(_address(data), np.int64), (WORK_SLOTS,))
    _share(work, np.float32)


@cfunc(types.void(types.voidptr), cache=True, **JIT)
def worker_bfloat16(data):  # pragma: no cover
    work = numba.carray(_pointer(_address(data), np.int64), (WORK_SLOTS,))
    _share(work, np.uint16)


@njit(cache=True, inline="always", **JIT)
def _run(call, caches, tables_address, num_seqs, max_blocks, items, splits, num_workers,
         prefetch, like):  # fmt: skip  # pragma: no cover
    """Run a planned batch's items on `num_workers` threads, then merge split rows."""
    num_tokens, num_heads = call[CALL_NUM_TOKENS], call[CALL_NUM_HEADS]
    head_dim = caches[CACHES_HEAD_DIM]
    part_acc, part_m, part_l = _partial_states(splits, num_heads, head_dim)
    work = call[CALL_SLOTS:]
    work[WORK_QUERY], work[WORK_OUT] = call[CALL_QUERY], call[CALL_OUT]
    work[WORK_NUM_TOKENS], work[WORK_NUM_HEADS], work[WORK_HEAD_DIM] = (
        num_tokens,
        num_heads,
        head_dim,
    )
    work[WORK_KEY], work[WORK_VALUE] = caches[CACHES_KEY], caches[CACHES_VALUE]
    work[WORK_ELEMENTS], work[WORK_BLOCK_SIZE] = caches[CACHES_ELEMENTS], caches[CACHES_BLOCK_SIZE]
    work[WORK_NUM_KV_HEADS] = caches[CACHES_NUM_KV_HEADS]
    work[WORK_TABLES], work[WORK_NUM_SEQS], work[WORK_MAX_BLOCKS] = (
        tables_address,
        num_seqs,
        max_blocks,
    )
    work[WORK_ITEMS], work[WORK_NUM_ITEMS] = items.ctypes.data, items.shape[0]
    work[WORK_PARTS], work[WORK_NUM_PARTS] = part_acc.ctypes.data, part_acc.shape[0]
    work[WORK_SCALE] = call[CALL_SCALE]
    work[WORK_NUM_WORKERS], work[WORK_PREFETCH] = num_workers, prefetch
    work[WORK_THREAD_NUM] = caches[CACHES_THREAD_NUM]
    work[WORK_TEAM_SIZE] = caches[CACHES_TEAM_SIZE]
    if num_workers <= 1:
        _work(work, 0, 1, like)
    else:
        _gomp_parallel(caches[CACHES_GOMP_PARALLEL], caches[CACHES_WORKER], work.ctypes.data,
                       num_workers)  # fmt: skip
    out = numba.carray(_pointer(call[CALL_OUT], np.float32), (num_tokens, num_heads, head_dim))
    _combine(splits, out, part_acc, part_m, part_l)
    # The workers read `items` and the partial states through their addresses: a use after
    # the parallel region keeps Numba from freeing them at their last use before it (the
    # plain call's items are allocated by the planner here).
    return items.shape[0] + part_acc.shape[0]


@njit(cache=True, inline="always", **JIT)
def _decode(call, caches, plan, like):  # pragma: no cover
    items = numba.carray(_pointer(plan[PLAN_ITEMS], np.int64), (plan[PLAN_NUM_ITEMS], 6))
    splits = numba.carray(_pointer(plan[PLAN_SPLITS], np.int64), (plan[PLAN_NUM_SPLITS], 3))
    _run(call, caches, plan[PLAN_TABLES], plan[PLAN_NUM_SEQS], plan[PLAN_MAX_BLOCKS], items,
         splits, plan[PLAN_NUM_WORKERS], plan[PLAN_PREFETCH], like)  # fmt: skip
    call[CALL_STATUS] = OK


@njit(cache=True, inline="always", **JIT)
def _plan_and_decode(call, caches, like):  # pragma: no cover
    """As `cpu_kernels.plan_and_decode`: plan, then run when every sequence is a decode row;
    the status (CALL_STATUS) says whether the output was written."""
    num_seqs, max_blocks = call[CALL_NUM_SEQS], call[CALL_MAX_BLOCKS]
    tables = numba.carray(_pointer(call[CALL_TABLES], np.int32), (num_seqs, max_blocks))
    lens = numba.carray(_pointer(call[CALL_LENS], np.int32), (num_seqs,))
    starts = numba.carray(_pointer(call[CALL_STARTS], np.int32), (num_seqs + 1,))
    block_size, num_kv_heads = caches[CACHES_BLOCK_SIZE], caches[CACHES_NUM_KV_HEADS]
    head_dim = caches[CACHES_HEAD_DIM]
    num_blocks = caches[CACHES_ELEMENTS] // (block_size * num_kv_heads * head_dim)
    num_threads = _call_int_function(caches[CACHES_THREADS])
    items, splits, rows, prefill, total, error, seq = plan_items(
        starts, lens, tables, call[CALL_NUM_TOKENS], num_blocks, block_size, call[CALL_WINDOW],
        caches[CACHES_MAX_DECODE_QUERY], num_threads,
    )  # fmt: skip
    if error != OK or prefill.shape[0]:
        call[CALL_STATUS] = error if error != OK else NEEDS_PREFILL
        return
    element_size = caches[CACHES_ELEMENT_SIZE]
    kv_bytes = total * 2 * num_kv_heads * head_dim * element_size
    _run(call, caches, call[CALL_TABLES], num_seqs, max_blocks, items, splits,
         count_workers(kv_bytes, items.shape[0], num_threads),
         prefetch_mode(element_size, kv_bytes), like)  # fmt: skip
    call[CALL_STATUS] = OK


_ENTRY = types.void(types.voidptr, types.voidptr, types.voidptr)


@njit(cache=True, inline="always")
def _blocks(call, caches, plan):  # pragma: no cover
    """An entry point's three pointers as the CALL, CACHES and PLAN blocks (PLAN is NULL for
    `plan_and_decode_*`, and never read there)."""
    return (
        numba.carray(_pointer(_address(call), np.int64), (CALL_BLOCK,)),
        numba.carray(_pointer(_address(caches), np.int64), (CACHES_SLOTS,)),
        numba.carray(_pointer(_address(plan), np.int64), (PLAN_SLOTS,)),
    )


@cfunc(_ENTRY, cache=True, **JIT)
def decode_float32(call, caches, plan):  # pragma: no cover
    """Run a planned batch (PLAN) over float32 caches (CACHES) for one call (CALL)."""
    blocks = _blocks(call, caches, plan)
    _decode(blocks[0], blocks[1], blocks[2], np.float32)


@cfunc(_ENTRY, cache=True, **JIT)
def decode_bfloat16(call, caches, plan):  # pragma: no cover
    blocks = _blocks(call, caches, plan)
    _decode(blocks[0], blocks[1], blocks[2], np.uint16)


@cfunc(_ENTRY, cache=True, **JIT)
def plan_and_decode_float32(call, caches, plan):  # pragma: no cover
    """Plan a plain call's batch and run it."""
    blocks = _blocks(call, caches, plan)
    _plan_and_decode(blocks[0], blocks[1], np.float32)


@cfunc(_ENTRY, cache=True, **JIT)
def plan_and_decode_bfloat16(call, caches, plan):  # pragma: no cover
    blocks = _blocks(call, caches, plan)
    _plan_and_decode(blocks[0], blocks[1], np.uint16)


@njit(cache=True, inline="always")
def _write(call, rows, like):  # pragma: no cover
    """`cpu_kernels.write_rows` on the caches' raw rows (`like`: their word type)."""
    shape = (rows[ROWS_NUM_SLOTS], rows[ROWS_WORDS])
    key_cache = numba.carray(_pointer(rows[ROWS_KEY], like), shape)
    value_cache = numba.carray(_pointer(rows[ROWS_VALUE], like), shape)
    call[WRITE_RESULT] = write_rows(
        call[WRITE_KEY], call[WRITE_VALUE], call[WRITE_SLOTS], call[WRITE_IS_INT64] != 0,
        call[WRITE_NUM_TOKENS], key_cache, value_cache,
    )  # fmt: skip


_WRITE_ENTRY = types.void(types.voidptr, types.voidptr)


@njit(cache=True, inline="always")
def _write_blocks(call, rows):  # pragma: no cover
    """A write entry point's two pointers as the WRITE and ROWS blocks."""
    return (
        numba.carray(_pointer(_address(call), np.int64), (WRITE_SLOTS_COUNT,)),
        numba.carray(_pointer(_address(rows), np.int64), (ROWS_SLOTS,)),
    )


@cfunc(_WRITE_ENTRY, cache=True, **JIT)
def write_words(call, rows):  # pragma: no cover
    """`write_kv` into caches whose rows are whole uint64 words (WRITE, ROWS blocks)."""
    blocks = _write_blocks(call, rows)
    _write(blocks[0], blocks[1], np.uint64)


@cfunc(_WRITE_ENTRY, cache=True, **JIT)
def write_bytes(call, rows):  # pragma: no cover
    """As `write_words`, for rows that are not a multiple of 8 bytes."""
    blocks = _write_blocks(call, rows)
    _write(blocks[0], blocks[1], np.uint8)
