"""The CPU attention backend: decode rows through a Numba kernel, prefills through SDPA.

One batch may mix both (the engine's continuous batches). Sequences with at most
`MAX_DECODE_QUERY` new tokens become kernel rows that read their blocks in place
(`kernels.decode_*`); longer ones gather their blocks and run
`scaled_dot_product_attention` with a bottom-right causal mask, where the matrix products
pay for the copy. float16 and float64 caches, and pools that are not contiguous, take the
SDPA path for every sequence (Numba has no fast float16, and the kernel reads flat views).

`plan` (once per step) runs the checks and the work split in one compiled pass; `run` (per
layer) converts the query and calls one compiled function.

A bfloat16 cache is read as its bits and widened to float32 in the kernels' loops
(`bf16.py`); sums run in float32.

`linear_rows` is the models' product of a few rows with a weight matrix (`matvec.py`), on
one thread, or on all where the OpenMP workers spin; `decode_layers` takes a decode step of a
few rows through a whole Llama-family decoder stack in one compiled call (`layers.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numba
import numpy as np
import torch
import torch.nn.functional as F

from pagedkv import kernel_cache
from pagedkv.ops import checks
from pagedkv.ops.metadata import AttentionMetadata
from pagedkv.ops.reference import attention_mask
from pagedkv.threads import workers_spin

MAX_DECODE_QUERY = 4
"""Sequences with at most this many new tokens go to the kernel; beyond, gather + SDPA."""
SERIAL_BYTES = 4 << 20
"""Batches reading less KV run on one thread: waking the others, asleep since the last
parallel call (on a virtual machine, rescheduling idle CPUs), costs more (benchmarks.md).
Where the workers spin (`workers_spin`) a parallel call costs about a microsecond, and any
batch of more than one item takes every thread."""
MIN_CHUNK = {False: 256, True: 64}
"""Fewest key positions worth an item of their own, with sleeping / spinning workers: an
item is merged at the end, and where waking a thread costs more than scoring 256 tokens
(sleeping workers) a short sequence stays one item."""
KERNEL_DTYPES = (torch.float32, torch.bfloat16)

_kernels = kernel_cache.load_kernels()
_matvec = kernel_cache.load_kernels("matvec")
_layers = kernel_cache.load_kernels("layers")


@dataclass
class CpuPlan:
    """One step's batch, checked and split; valid for caches of `cache_shape`/`dtype`."""

    cache_shape: torch.Size
    dtype: torch.dtype
    num_heads: int
    sliding_window: int | None
    items: np.ndarray  # int64 [num_items, 4]: (kernel row, seq, start, end)
    row_items: np.ndarray  # int64 [num_rows + 1]
    rows: np.ndarray  # int64 [num_rows]: query row of each kernel row
    prefill_seqs: list[int]
    block_tables: np.ndarray  # int32 [num_seqs, max_blocks]
    seq_lens: np.ndarray  # int32 [num_seqs]
    query_start_loc: np.ndarray  # int32 [num_seqs + 1]
    parallel: bool
    rows_index: torch.Tensor | None  # the rows as a tensor, unless they are all the rows


def uses_kernel(cache: torch.Tensor) -> bool:
    """Whether decode rows over `cache` go to the Numba kernel."""
    return cache.dtype in KERNEL_DTYPES and cache.is_contiguous()


def plan(
    metadata: AttentionMetadata,
    key_cache: torch.Tensor,
    num_heads: int,
    sliding_window: int | None,
) -> CpuPlan:
    """See `AttentionBackend.plan`."""
    # Contiguous copies of strided views: one compiled variant reads them all.
    tables = np.ascontiguousarray(metadata.block_tables.numpy())
    lens = np.ascontiguousarray(metadata.seq_lens.numpy())
    starts = np.ascontiguousarray(metadata.query_start_loc.numpy())
    num_tokens = metadata.num_tokens
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    spin = workers_spin()
    items, row_items, rows, prefill, total, error, seq = _kernels.plan_items(
        starts, lens, tables, num_tokens, num_blocks, block_size, sliding_window or 0,
        MAX_DECODE_QUERY if uses_kernel(key_cache) else 0, _sync_threads(), MIN_CHUNK[spin],
    )  # fmt: skip
    if error == _kernels.BAD_BLOCK:
        raise checks.bad_block(tables, lens, seq, num_blocks, block_size)
    if error != _kernels.OK:
        checks.check_lengths(starts, lens, num_tokens, tables.shape[1] * block_size)
        raise AssertionError(f"plan_items reported error {error} that check_lengths missed")
    row_bytes = 2 * key_cache.shape[2] * key_cache.shape[3] * key_cache.element_size()
    return CpuPlan(
        cache_shape=key_cache.shape,
        dtype=key_cache.dtype,
        num_heads=num_heads,
        sliding_window=sliding_window,
        items=items,
        row_items=row_items,
        rows=rows,
        prefill_seqs=prefill.tolist(),
        block_tables=tables,
        seq_lens=lens,
        query_start_loc=starts,
        parallel=total * row_bytes >= SERIAL_BYTES or (spin and items.shape[0] > 1),
        rows_index=None if rows.shape[0] == num_tokens else torch.from_numpy(rows),
    )


def _sync_threads() -> int:
    """Give the kernels torch's thread count (both run on one OpenMP runtime's pool)."""
    threads = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
    if numba.get_num_threads() != threads:
        numba.set_num_threads(threads)
    return threads


def run(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: CpuPlan,
    scale: float,
) -> torch.Tensor:
    """See `AttentionBackend.run`."""
    if plan.rows.shape[0] and not uses_kernel(key_cache):
        raise checks.fail("key_cache", "a contiguous pool, as the plan's", "a strided one")
    if not plan.prefill_seqs:
        return _decode_rows(query, key_cache, value_cache, plan, scale).to(query.dtype)
    out = torch.empty_like(query)
    if plan.rows.shape[0]:
        out[plan.rows_index] = _decode_rows(query, key_cache, value_cache, plan, scale).to(
            query.dtype
        )
    for s in plan.prefill_seqs:
        lo, hi = int(plan.query_start_loc[s]), int(plan.query_start_loc[s + 1])
        out[lo:hi] = _prefill_seq(
            query[lo:hi], key_cache, value_cache, plan.block_tables[s], int(plan.seq_lens[s]),
            scale, plan.sliding_window,
        )  # fmt: skip
    return out


def _cache_rows(cache: torch.Tensor) -> np.ndarray:
    """A cache as the kernels read it: [num_slots, num_heads, head_dim]."""
    return _flat(cache.view(-1, cache.shape[-2], cache.shape[-1]))


def _decode_rows(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: CpuPlan,
    scale: float,
) -> torch.Tensor:
    """The kernel rows' output, float32 [num_rows, num_heads, head_dim]."""
    rows = query if plan.rows_index is None else query[plan.rows_index]
    q = rows.to(torch.float32).contiguous()
    out = torch.empty_like(q)
    decode = _kernels.decode_parallel if plan.parallel else _kernels.decode_serial
    decode(
        q.numpy(), _cache_rows(key_cache), _cache_rows(value_cache), plan.block_tables,
        plan.items, plan.row_items, key_cache.shape[1], scale, out.numpy(),
    )  # fmt: skip
    return out


def _prefill_seq(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: np.ndarray,
    seq_len: int,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """One sequence by gather + SDPA: query [q, H, D] -> [q, H, D]."""
    query_len, block_size = query.shape[0], key_cache.shape[1]
    # Blocks wholly before the window of the first new token are never read.
    first = 0 if sliding_window is None else max(0, seq_len - query_len - sliding_window + 1)
    b0, b1 = first // block_size, -(-seq_len // block_size)
    blocks = torch.from_numpy(block_table[b0:b1].astype(np.int64))
    start = b0 * block_size
    # (nb, bs, Hkv, D) -> (nb * bs, Hkv, D) -> (Hkv, L', D) with L' = seq_len - start;
    # made contiguous because SDPA's CPU kernel is slower on the strided view.
    k = key_cache.index_select(0, blocks).flatten(0, 1)[: seq_len - start].transpose(0, 1)
    v = value_cache.index_select(0, blocks).flatten(0, 1)[: seq_len - start].transpose(0, 1)
    k, v = k.contiguous(), v.contiguous()
    q = query.transpose(0, 1)  # (H, q, D)
    if sliding_window is None and start == 0 and query_len == seq_len:
        mask, causal = None, True
    else:
        mask = attention_mask(query_len, seq_len, sliding_window, query.device)[:, start:]
        causal = False
    out = F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
    )
    return out[0].transpose(0, 1)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """See `AttentionBackend.write_kv`: one `index_copy_` per pool, whose rows are the
    slots of ``[num_blocks * block_size, num_kv_heads, head_dim]``. Checked before anything
    is written, so a bad batch leaves the cache as it was."""
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    slots, low = _checked_slots(slot_mapping, num_slots)
    if low < 0:  # padding rows are skipped
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        from pagedkv.ops import reference

        reference.write_kv(key, value, key_cache, value_cache, slots)
        return
    rows = (num_slots, key_cache.shape[2], key_cache.shape[3])
    key_cache.view(rows).index_copy_(0, slots, key)
    value_cache.view(rows).index_copy_(0, slots, value)


def _checked_slots(slot_mapping: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, int]:
    """The slots as int64 and the lowest one; raises where one lies past the pool."""
    slots = slot_mapping.long()
    low, high = (int(x) for x in torch.aminmax(slots))
    if high >= num_slots:
        first = int(torch.nonzero(slot_mapping >= num_slots)[0])
        raise checks.slot_past_end(slot_mapping, first, num_slots)
    return slots, low


def linear_rows(
    weight: torch.Tensor, bias: torch.Tensor | None, parallel: bool | None = None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """`x -> F.linear(x, weight, bias)` for a few rows of x (`matvec.py`): each weight row
    is read once, sums in float32, the result rounded once to the weight's dtype; the same
    bits on one thread or on all. The weight is read in place (an in-place update shows).

    Args:
        weight: [out_features, in_features], C-contiguous, float32 or bfloat16, on the CPU.
        bias: [out_features] of the same dtype, or None.
        parallel: split the rows over torch's threads; default: where the workers spin
            (`pagedkv.threads.workers_spin`) and there is more than one thread.
    """
    flat_weight = _flat(weight)
    flat_bias = _flat(torch.empty(0, dtype=weight.dtype) if bias is None else bias.detach())
    out_features = weight.shape[0]
    parts = _sync_threads()
    if parallel is None:
        parallel = workers_spin() and parts > 1

    def product(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], out_features, dtype=x.dtype)
        if parallel:
            _matvec.matvec_parallel(
                _flat(x.contiguous()), flat_weight, flat_bias, _flat(out), parts
            )
        else:
            _matvec.matvec(_flat(x.contiguous()), flat_weight, flat_bias, _flat(out))
        return out

    return product


@dataclass
class DecoderWeights:
    """A decoder stack's weights as `decode_layers` reads them: per role, one Numba typed
    list of NumPy views (no copies), entry l for layer l; absent ones (a bias, q/k norms)
    as empty arrays."""

    in_norm: Sequence[np.ndarray]
    qkv: Sequence[np.ndarray]
    qkv_bias: Sequence[np.ndarray]
    q_norm: Sequence[np.ndarray]
    k_norm: Sequence[np.ndarray]
    o_proj: Sequence[np.ndarray]
    post_norm: Sequence[np.ndarray]
    gate_up: Sequence[np.ndarray]
    down: Sequence[np.ndarray]
    eps: float
    dtype: torch.dtype

    @classmethod
    def create(cls, layers: Sequence[dict[str, torch.Tensor | None]], eps: float) -> DecoderWeights:
        """layers: per layer a dict of the fields' tensors (plain, C-contiguous, one dtype:
        float32 or bfloat16; None for an absent one). The tensors are read in place."""
        dtype = layers[0]["qkv"].dtype  # type: ignore[union-attr]
        empty = torch.empty(0, dtype=dtype)
        fields = {}
        for name in ("in_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o_proj", "post_norm",
                     "gate_up", "down"):  # fmt: skip
            views = [_flat(_plain(layer[name], name, dtype, empty)) for layer in layers]
            fields[name] = numba.typed.List(views)
        return cls(**fields, eps=eps, dtype=dtype)


def _plain(
    t: torch.Tensor | None, name: str, dtype: torch.dtype, empty: torch.Tensor
) -> torch.Tensor:
    if t is None:
        return empty
    if t.is_mkldnn or t.dtype != dtype or not t.is_contiguous():
        raise checks.fail(name, f"a plain contiguous {dtype} tensor", f"{t.dtype} {t.layout}")
    return t.detach()


def decode_layers(
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    weights: DecoderWeights,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    plan: CpuPlan,
    scale: float,
) -> None:
    """A decode step's rows through every layer (`layers.py`), in place.

    Args:
        hidden: [T, hidden_size] in the weights' dtype; rows past the plan's only pad.
        cos, sin: [T, head_dim // 2], hidden's dtype.
        slot_mapping: [num_real] int64 (the plan's rows; -1 skips a row's write).
        key_pool, value_pool: [num_layers, num_blocks, block_size, num_kv_heads, head_dim].
        plan: the step's plan over these pools, with every real row a kernel row
            (`is_decode_only`).
        scale: softmax scale.
    """
    if not is_decode_only(plan, slot_mapping.shape[0]):
        raise checks.fail("plan", "kernel rows only (a decode step)", "prefill sequences")
    if key_pool.shape[1:] != plan.cache_shape or key_pool.dtype != plan.dtype:
        raise checks.fail("key_pool", f"layers of {tuple(plan.cache_shape)} (as planned)",
                          tuple(key_pool.shape))  # fmt: skip
    if value_pool.shape != key_pool.shape or value_pool.dtype != key_pool.dtype:
        raise checks.fail("value_pool", f"as key_pool, {tuple(key_pool.shape)}", value_pool.shape)
    for name, t in (("hidden", hidden), ("key_pool", key_pool)):
        if t.dtype != weights.dtype:
            raise checks.fail(name, f"the weights' dtype {weights.dtype}", t.dtype)
    slots, _ = _checked_slots(slot_mapping, plan.cache_shape[0] * plan.cache_shape[1])
    parts = _sync_threads() if workers_spin() else 1
    pool_rows = (key_pool.shape[0], -1, key_pool.shape[3], key_pool.shape[4])
    _layers.decode_layers(
        _flat(hidden), _flat(cos), _flat(sin), slot_mapping.shape[0],
        slots.numpy(), weights.in_norm, weights.qkv,
        weights.qkv_bias, weights.q_norm, weights.k_norm, weights.o_proj, weights.post_norm,
        weights.gate_up, weights.down, _flat(key_pool.view(pool_rows)),
        _flat(value_pool.view(pool_rows)), plan.block_tables, plan.items, plan.row_items,
        key_pool.shape[2], weights.eps, scale, parts, plan.parallel,
    )  # fmt: skip


def is_decode_only(plan: CpuPlan, num_real: int) -> bool:
    """Whether every one of the step's `num_real` rows is a kernel row of `plan`."""
    return not plan.prefill_seqs and plan.rows_index is None and plan.rows.shape[0] == num_real


def _flat(t: torch.Tensor) -> np.ndarray:
    """A float32 tensor as NumPy, a bfloat16 one as its bits (NumPy has no bfloat16)."""
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


def warmup(key_cache: torch.Tensor, value_cache: torch.Tensor, num_heads: int) -> None:
    """Load or compile every kernel variant (the plan and both decode kernels, for float32
    and bfloat16 caches, and `linear_rows`); say so on stderr when it compiles."""
    kernel_cache.announce()
    for dtype in KERNEL_DTYPES:
        _compile(dtype)
        for parallel in (False, True):
            weight = torch.zeros(1, 2, dtype=dtype)
            linear_rows(weight, None, parallel)(torch.zeros(1, 2, dtype=dtype))
    kernel_cache.mark_compiled()


def _compile(dtype: torch.dtype) -> None:
    """Run each kernel once on a tiny cache of `dtype` (a decode of one 1-token sequence),
    and a one-layer decoder stack over it."""
    cache = torch.zeros(1, 1, 1, 8, dtype=dtype)
    metadata = AttentionMetadata.build([[0]], [1], [1], [0])
    for parallel in (False, True):
        p = plan(metadata, cache, 1, None)
        p.parallel = parallel
        run(torch.zeros(1, 1, 8, dtype=dtype), cache, cache, p, 1.0)
    sizes = {"in_norm": (8,), "qkv": (24, 8), "qkv_bias": (24,), "q_norm": (8,), "k_norm": (8,),
             "o_proj": (8, 8), "post_norm": (8,), "gate_up": (4, 8), "down": (8, 2)}  # fmt: skip
    weights = DecoderWeights.create(
        [{k: torch.zeros(v, dtype=dtype) for k, v in sizes.items()}], 1e-6
    )
    row, half = torch.zeros(1, 8, dtype=dtype), torch.zeros(1, 4, dtype=dtype)
    slots = torch.zeros(1, dtype=torch.int64)
    decode_layers(row, half, half, slots, weights, cache[None], cache[None].clone(), p, 1.0)
