"""A Llama-family decoder stack for a decode step of a few rows: every layer and the LM head
in one call.

At batch 1 a step's arithmetic is small (each weight is read once) and driving ~15 torch
operations per layer from Python costs about as much as the products. Here the whole stack
runs in compiled code, as `pagedkv.models.llama` computes it:

    n = rms_norm(x);  q|k|v = qkv_proj(n);  q, k = rotary(qk_norm(q), qk_norm(k))
    write k, v at the rows' slots;  x += o_proj(attention(q, the paged cache))
    n = rms_norm(x);  gate|up = gate_up_proj(n);  x += down_proj(silu(gate) * up)

then `logits = lm_head(rms_norm(x))`. In bfloat16 every value is rounded where torch rounds
it, sums run in float32 (`rows.py`); attention is `kernels.py`'s, and the products are those
of the weights as the model holds them (`phase_products.py`): `matvec.py`'s from plain
weights, or integer products from GGML blocks with each phase's input quantized once per
thread, as a `QuantWeight`'s few-row product quantizes it. The LM
head is in the region because whatever runs after the layers' weight stream starts from cold
code and data: from Python, the final norm and the head's own parallel call paid that twice.

One parallel region per step. Each layer is five *phases* (q|k|v by heads, attention items,
o_proj rows, gate/up rows, down rows), then the LM head's rows; every thread walks the phases
in order, claims a phase's chunks from shared counters, and waits until all are done before
the next. What costs less than a hand-off (a norm of the step's rows, the merge of their
attention items, the MLP's activation) every thread computes for itself, into its own
buffers, before its first chunk of the phase. A sleeping worker (``OMP_WAIT_POLICY=PASSIVE``)
is thus woken once per step, not per product, and a late (or preempted) thread only leaves
its chunks to the others. A waiting thread spins briefly, then yields its core. After a few
long waits in one step another process holds a core: the waiting thread finishes
the step alone and the caller runs the next steps on one thread (`TeamBackoff`): on a shared
core every hand-off would cost a scheduler slice.

How long "briefly" and "long" are, and how far ahead weights are prefetched, are
`CpuTuning`'s knobs, passed in as `knobs` (a module constant would be frozen into the
cached machine code). NumPy and Numba only (tensors arrive as NumPy views, bfloat16 as
uint16 bits); compiled code cached as `pagedkv.runtime.kernel_cache` says.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange
from numba.typed import List

from pagedkv.ops.cpu.bf16 import as_float32
from pagedkv.ops.cpu.int8 import layer_of
from pagedkv.ops.cpu.kernels import attend_item
from pagedkv.runtime import atomics, kernel_cache
from pagedkv.runtime.matvec import narrow
from pagedkv.runtime.phase_products import (
    chunk_work,
    in_features,
    input_buffers,
    out_features,
    phase_input,
    phase_products,
)
from pagedkv.runtime.rows import merge_rows, norm_rows, place_head, silu_rows

kernel_cache.use_shared_cache()  # before the first `cache=True` decorator

QKV, ATTEND, O_PROJ, GATE_UP, DOWN, HEAD = range(6)
"""The kinds of phases: a layer's five, then the LM head's after the last layer."""
PHASES = HEAD
"""Phases per layer."""
CHUNK_WORK = 32_768
"""Multiply-adds per input row in a claimed chunk of a product, at least: small enough that
two threads share a small model's projection evenly, large enough that claims are rare."""
CHUNKS_PER_THREAD = 8
"""Chunks per thread of a phase, at most, where its product is large: each claim is an
atomic add, a locked instruction that waits for the loads in flight, so every chunk boundary
stalls the stream of weight reads; a few chunks a thread still let one take over the share
of another that is late."""
LINE = 8
"""int64 counters per cache line: each counter on its own line, so claiming one phase's
chunks does not stall a thread polling another's."""
LONG_WAITS = 3
"""Long waits in one step after which a waiting thread finishes the step alone: one is
a virtual CPU preempted once, several mean that another process holds a core."""


@njit(cache=True, fastmath=True, parallel=True)
def decode_layers(
    x, cos, sin, num_real, slots, in_norm, qkv, qkv_bias, q_norm, k_norm, o_proj, post_norm,
    gate_up, down, final_norm, head, key_pool, value_pool, block_tables, items, row_items,
    block_size, eps, scale, threads, final, logits, knobs, key_scale_pool, value_scale_pool,
):  # fmt: skip  # pragma: no cover
    """Pass x through every layer, in place, writing each layer's K/V of the real rows; then
    its final norm into `final` and the LM head's logits into `logits`.

    Args:
        x: [T, hidden] hidden states (rows past `num_real` only pad the products).
        cos, sin: [T, head_dim // 2], x's dtype.  slots: int64 [num_real], -1 to skip.
        in_norm, post_norm: per layer [hidden].  qkv: per layer [(H + 2 KV) * D, hidden],
            qkv_bias [(H + 2 KV) * D] or empty.  q_norm, k_norm: per layer [D] or empty.
        o_proj: [hidden, H * D].  gate_up: [2 I, hidden].  down: [hidden, I].  (Numba
            typed lists, one entry per layer, x's dtype.)
        final_norm: [hidden].  head: [vocab, hidden].  (x's dtype.)  The projections and
            the head may instead all be in GGML blocks (`phase_products.block_parts`).
        key_pool, value_pool: [L, num_slots, KV, D], x's dtype, or int8 with scales.
        block_tables, items, row_items: the step's `CpuPlan` (every real row a kernel row).
        block_size: tokens per block of the pools.
        eps, scale: RMSNorm epsilon and softmax scale.
        threads: threads to share the step (1: the calling one alone, no parallel region).
        final: [T, hidden], x's dtype.  logits: float32 [T, vocab] (a bfloat16 model's
            rounded to bfloat16 first, as its matmul gives them).
        knobs: (prefetch bytes, spin ticks, long-wait ticks), `CpuTuning.kernel_knobs()`.
        key_scale_pool, value_scale_pool: [L, num_slots, KV] float16 bits beside int8 pools
            (each K/V row is quantized as it is written), else None.

    Returns:
        Whether a thread finished the step alone because another was off its core.
    """
    rows, hidden = x.shape
    attended_size, inner = in_features(o_proj[0]), in_features(down[0])
    head_dim, qkv_size = key_pool.shape[3], out_features(qkv[0])
    num_heads = attended_size // head_dim
    num_items = items.shape[0]
    work = chunk_work(head, CHUNK_WORK)
    widest = max(  # a chunk's outputs, at most (`_chunks`)
        head_dim * _share(qkv_size // head_dim, threads),
        work // min(hidden, attended_size, inner),
        _share(max(hidden, 2 * inner, out_features(head)), threads),
    )
    f32 = np.float32
    buffers = (
        np.empty((threads, rows, hidden), dtype=x.dtype),  # normed: each thread's norm
        np.empty((rows, qkv_size), dtype=x.dtype),  # fused q|k|v
        np.empty((num_real, num_heads, head_dim), dtype=f32),  # query
        np.empty((num_items, num_heads, head_dim), dtype=f32),  # acc
        np.empty((num_items, num_heads), dtype=f32),  # row_max
        np.empty((num_items, num_heads), dtype=f32),  # row_sum
        np.empty((threads, num_real, num_heads, head_dim), dtype=f32),  # attended
        # heads: each thread's o_proj input, the attended rows rounded; pad rows stay 0
        np.zeros((threads, rows, attended_size), dtype=x.dtype),
        np.empty_like(x),  # update: a residual branch's output
        np.empty((rows, 2 * inner), dtype=x.dtype),  # gate|up
        np.empty((threads, rows, inner), dtype=x.dtype),  # mid: each thread's down input
        final,
        np.empty((rows, out_features(head)), dtype=x.dtype),  # the head's products in x's dtype
        logits,
        np.empty((threads, inner), dtype=f32),  # each thread's activations
        # then each thread's quantized product input, for weights in blocks (not a tuple in
        # this tuple: a tuple of arrays nested in an argument does not pass into the parallel
        # region, nor does the head's in `weights`, hence its typed list)
    ) + input_buffers(head, threads, rows, max(hidden, attended_size, inner), widest)
    heads = List()
    heads.append(head)
    weights = (in_norm, qkv, qkv_bias, q_norm, k_norm, o_proj, post_norm, gate_up, down,
               final_norm, heads)  # fmt: skip
    pools = (key_pool, value_pool, block_tables, items, row_items, block_size, key_scale_pool,
             value_scale_pool)  # fmt: skip
    # per phase, chunks claimed in each thread's lane and chunks done; then long waits,
    # tries to go alone, and the thread that did
    counters = np.zeros(((len(qkv) * PHASES + 1) * (threads + 1) + 3) * LINE, dtype=np.int64)
    # Thread ids as int64 on both paths (a constant, or prange's unsigned index, would make
    # Numba compile `_take_part` once more for its type).
    if threads == 1:
        _take_part(threads - 1, threads, x, cos, sin, num_real, slots, weights, pools, buffers,
                   eps, scale, counters, knobs)  # fmt: skip
    else:
        for me in prange(threads):
            _take_part(np.int64(me), threads, x, cos, sin, num_real, slots, weights, pools,
                       buffers, eps, scale, counters, knobs)  # fmt: skip
    return counters[-LINE] != 0


@njit(cache=True)
def typed_list(arrays):  # pragma: no cover
    """A tuple of arrays of one type as the typed list `decode_layers` takes, built by cached
    code (`numba.typed.List(arrays)` compiles its helpers anew in every process)."""
    out = List()
    for array in arrays:
        out.append(array)
    return out


@njit(cache=True, fastmath=True)
def _take_part(me, threads, x, cos, sin, num_real, slots, weights, pools, buffers, eps, scale,
               counters, knobs):  # fmt: skip  # pragma: no cover
    """Thread `me`'s walk through every phase (the whole step where it is alone)."""
    num_layers = len(weights[1])
    for phase in range(num_layers * PHASES + 1):
        layer = min(phase // PHASES, num_layers - 1)
        kind = phase - layer * PHASES  # after the last layer's: HEAD
        n, step = _chunks(kind, x, weights, pools, buffers, threads)
        _run_phase(kind, phase, n, step, layer, me, threads, counters, x, cos, sin, num_real,
                   slots, weights, pools, buffers, eps, scale, knobs[0])  # fmt: skip
        if not _wait(counters, phase, n, me, threads, knobs[1], knobs[2]):
            return


@njit(cache=True)
def _chunks(kind, x, weights, pools, buffers, threads):  # pragma: no cover
    """(chunks, rows of a product per chunk) of a phase of `kind`: whole heads of q|k|v, one
    attention item, or rows of a product, `CHUNKS_PER_THREAD` a thread but no fewer rows
    than `CHUNK_WORK` takes; the head's phase has at least one (its thread writes the final
    norm) even where the head has no rows."""
    head_dim, items, inner = pools[0].shape[3], pools[3], buffers[10].shape[2]
    if kind == QKV:
        heads = out_features(weights[1][0]) // head_dim
        per_chunk = _share(heads, threads)
        return -(-heads // per_chunk), per_chunk * head_dim
    if kind == ATTEND:
        return items.shape[0], 1
    if kind == O_PROJ:
        size, outputs = in_features(weights[5][0]), x.shape[1]
    elif kind == GATE_UP:  # rows of the fused gate|up, in order
        size, outputs = x.shape[1], 2 * inner
    elif kind == HEAD:
        size, outputs = x.shape[1], max(1, out_features(weights[10][0]))
    else:  # down
        size, outputs = inner, x.shape[1]
    step = max(1, chunk_work(weights[5][0], CHUNK_WORK) // size, _share(outputs, threads))
    return -(-outputs // step), step


@njit(cache=True)
def _share(outputs, threads):  # pragma: no cover
    """Outputs per chunk where a phase of `outputs` is cut into `CHUNKS_PER_THREAD` a thread."""
    return max(1, -(-outputs // (threads * CHUNKS_PER_THREAD)))


@njit(cache=True, fastmath=True)
def _run_phase(kind, phase, n, step, layer, me, threads, counters, x, cos, sin, num_real,
               slots, weights, pools, buffers, eps, scale,
               prefetch):  # fmt: skip  # pragma: no cover
    """Thread `me`'s chunks of layer `layer`'s phase of `kind` (`_chunks`), claimed one by
    one until none is left; before the first, the product's input in its own buffers.

    The arrays are taken out of their tuples and typed lists once per phase, not once per
    chunk: each reference taken is an atomic count on an array that every thread shares."""
    c = _claim(counters, phase, n, me, threads)
    if c >= n:
        return
    in_norm, qkv, qkv_bias, q_norm, k_norm, o_proj, post_norm, gate_up, down = weights[:9]
    final_norm, head = weights[9], weights[10][0]
    key_pool, value_pool, block_tables, items, row_items, block_size = pools[:6]
    fused, query, acc, row_max, row_sum = buffers[1:6]
    update, mlp_in, mids, final, head_out, logits = buffers[8:14]
    normed, attended, heads = buffers[0][me], buffers[6][me], buffers[7][me]
    mid = mids[me]
    keys, values = key_pool[layer], value_pool[layer]
    key_scales, value_scales = layer_of(pools[6], layer), layer_of(pools[7], layer)
    # the phase's product (for attention, unused) and its input, taken once
    bias, source = qkv_bias[0][:0], normed
    if kind == QKV:
        weight, bias = qkv[layer], qkv_bias[layer]
        norm_rows(x, in_norm[layer], eps, normed)
    elif kind == O_PROJ:
        weight, source = o_proj[layer], heads
        merge_rows(num_real, row_items, acc, row_max, row_sum, attended, heads, x)
    elif kind == GATE_UP:
        weight = gate_up[layer]
        norm_rows(x, post_norm[layer], eps, normed)
    elif kind == DOWN:
        weight, source = down[layer], mid
        silu_rows(mlp_in, mid, x, buffers[14][me])
    elif kind == HEAD:
        weight = head
        norm_rows(x, final_norm, eps, normed)
    else:  # attention: no product
        weight = head
    own = (buffers[15][me], buffers[16][me], buffers[17][me], buffers[18][me], buffers[19][me])
    chunk = buffers[20][me]
    source = phase_input(source, weight, own, kind != ATTEND)
    outputs = out_features(weight)
    done = 0
    while c < n:
        first = c * step
        if kind == QKV:
            end = min(outputs, first + step)
            phase_products(source, weight, bias, fused, first, end, prefetch, chunk)
            for h in range(first // keys.shape[2], end // keys.shape[2]):
                place_head(h, fused, q_norm[layer], k_norm[layer], cos, sin, eps, num_real,
                           slots, query, (keys, values, key_scales, value_scales))  # fmt: skip
        elif kind == ATTEND:
            attend_item(c, query, keys, values, key_scales, value_scales, block_tables, items,
                        block_size, scale, acc[c], row_max[c], row_sum[c])  # fmt: skip
        elif kind == HEAD:
            if c == 0:
                final[:] = normed
            end = min(outputs, first + step)
            phase_products(source, weight, bias, head_out, first, end, prefetch, chunk)
            for r in range(x.shape[0]):
                for i in range(first, end):
                    logits[r, i] = as_float32(head_out[r, i])
        elif kind == GATE_UP:
            end = min(outputs, first + step)
            phase_products(source, weight, bias, mlp_in, first, end, prefetch, chunk)
        else:  # o_proj or down, each with its residual add
            end = min(x.shape[1], first + step)
            phase_products(source, weight, bias, update, first, end, prefetch, chunk)
            for r in range(x.shape[0]):
                for i in range(first, end):
                    x[r, i] = narrow(as_float32(x[r, i]) + as_float32(update[r, i]), x)
        done += 1
        c = _claim(counters, phase, n, me, threads)
    # Counted once, after their writes: the count's line is the one that waiting threads
    # poll, and adding to it per chunk would pass it between the cores every chunk.
    atomics.fetch_add(counters, (phase * (threads + 1) + threads) * LINE, done)


@njit(cache=True)
def _claim(counters, phase, n, me, threads):  # pragma: no cover
    """The next chunk of `phase` for thread `me`; n when none is left for it (all claimed,
    or another thread finishes the step alone).

    The chunks are cut into one contiguous lane per thread, each with its own counter: a
    thread takes its lane's chunks in order (one stream through the weights, which the
    hardware prefetcher follows), then what is left in the others'."""
    alone = atomics.load(counters, counters.shape[0] - LINE)
    if alone != 0 and alone != me + 1:
        return n
    lane_size = -(-n // threads)
    for k in range(threads):
        lane = (me + k) % threads
        counter = (phase * (threads + 1) + lane) * LINE
        if atomics.load(counters, counter) < lane_size:
            c = lane * lane_size + atomics.fetch_add(counters, counter, 1)
            if c < min(n, (lane + 1) * lane_size):
                return c
    return n


@njit(cache=True)
def _wait(counters, phase, n, me, threads, spin_ticks, long_ticks):  # pragma: no cover
    """Wait until all n chunks of `phase` are done; False where thread `me` should leave
    the step to another that goes on alone."""
    done = (phase * (threads + 1) + threads) * LINE
    end = counters.shape[0]
    long_waits, tries, alone = end - 3 * LINE, end - 2 * LINE, end - LINE
    start = atomics.ticks()
    turns = 0
    counted = False
    while atomics.load(counters, done) < n:
        owner = atomics.load(counters, alone)
        if owner != 0 and owner != me + 1:
            return False  # this thread's chunks are done; the one going on alone waits for the rest
        turns += 1
        waited = max(atomics.ticks() - start, turns * 64)  # no cycle counter: count turns
        if waited < spin_ticks:
            atomics.pause()
            continue
        if waited > long_ticks and not counted:
            counted = True
            if (atomics.fetch_add(counters, long_waits, 1) + 1 >= LONG_WAITS and owner == 0
                    and atomics.fetch_add(counters, tries, 1) == 0):  # fmt: skip
                counters[alone] = me + 1
        atomics.yield_cpu()
    owner = atomics.load(counters, alone)
    return owner == 0 or owner == me + 1
