"""The public attention ops: argument checks, then the backend that `backend.py` finds.

    write_kv(key, value, key_cache, value_cache, slot_mapping, ...)  per layer
    plan(metadata, key_cache, value_cache, num_heads, sliding_window) once per step
    paged_attention_from_metadata(query, key_cache, value_cache, metadata, ...)  per layer
    paged_attention(query, key_cache, value_cache, block_tables, ...)  plan + run, one call

Every check lives in `checks.py`; backends receive checked arguments.

An int8 cache comes with its scales (`key_scales`, `value_scales`: [num_blocks,
block_size, num_kv_heads] float16, `pagedkv.ops.quantize`): `write_kv` quantizes into
both, and attention reads both. Backends receive them as one `(key_scales, value_scales)`
pair, or None beside a float cache.
"""

from __future__ import annotations

import torch

from pagedkv.ops import checks
from pagedkv.ops.backend import get_backend
from pagedkv.ops.metadata import AttentionMetadata, AttentionPlan
from pagedkv.ops.quantize import KVScales


def _pair(key_scales: torch.Tensor | None, value_scales: torch.Tensor | None) -> KVScales | None:
    """The backends' form of the scales: both or None."""
    if key_scales is None and value_scales is None:
        return None
    if key_scales is None or value_scales is None:
        name = "key_scales" if key_scales is None else "value_scales"
        raise checks.fail(name, "a tensor, as the other scales", None)
    return key_scales, value_scales


def warmup(
    key_cache: torch.Tensor, value_cache: torch.Tensor, num_heads: int, *, backend: str = "auto"
) -> None:
    """Get the backend's kernels for this cache pair ready before the first step.

    JIT backends compile on first use (seconds per kernel); an engine calls this once at
    start-up so no request waits for it. Reads the caches, never writes them.

    Args:
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim].
        num_heads: query heads, a multiple of num_kv_heads.
        backend: as for `paged_attention`.

    Raises:
        ValueError: bad caches, `num_heads` or backend.
    """
    _, _, num_kv_heads, _ = checks.check_kv_pair(key_cache, value_cache)
    checks.check_num_heads(num_heads, num_kv_heads)
    get_backend(backend, key_cache.device).warmup(key_cache, value_cache, num_heads)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
    backend: str = "auto",
) -> None:
    """Write the new tokens' keys and values into the paged cache, in place.

    Args:
        key: [num_tokens, num_kv_heads, head_dim], the cache's dtype (any float dtype for
            an int8 cache).
        value: [num_tokens, num_kv_heads, head_dim], as key.
        key_cache: [num_blocks, block_size, num_kv_heads, head_dim], float32 | bfloat16 |
            float16 | float64 | int8 (each row quantized, its scale stored beside it).
        value_cache: same shape, dtype and device as `key_cache`.
        slot_mapping: int64 | int32 [num_tokens]; token t goes to block
            ``slot // block_size``, row ``slot % block_size``. Negative slots are skipped.
        key_scales, value_scales: [num_blocks, block_size, num_kv_heads] float16 beside an
            int8 cache, else None.
        backend: as for `paged_attention`; an engine writes with its attention backend.

    Raises:
        ValueError: a shape, dtype or device does not match, a slot lies past the cache,
            or the backend is unknown or unavailable.
    """
    scales = _pair(key_scales, value_scales)
    checks.check_write(key, value, key_cache, value_cache, slot_mapping, scales)
    if key.shape[0]:
        get_backend(backend, key_cache.device).write_kv(
            key, value, key_cache, value_cache, slot_mapping, scales
        )


def plan(
    metadata: AttentionMetadata,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_heads: int,
    sliding_window: int | None = None,
) -> AttentionPlan:
    """Check the step's batch once and let its backend split the work, for every layer.

    The plan is kept in ``metadata.plans[sliding_window]`` and returned; call once per
    distinct window of the model's layers (most models have one). Layers whose caches
    differ in shape or dtype from `key_cache` are refused at run time.

    Args:
        metadata: the step's batch; its `backend` picks the backend.
        key_cache, value_cache: any layer's pools (all layers share shape and dtype).
        num_heads: query heads.
        sliding_window: the window of the layers this plan serves, or None.

    Raises:
        ValueError: an index tensor, length, block id or backend that does not fit.
    """
    _, _, num_kv_heads, _ = checks.check_kv_pair(key_cache, value_cache)
    checks.check_num_heads(num_heads, num_kv_heads)
    checks.check_window(sliding_window)
    device = key_cache.device
    backend = get_backend(metadata.backend, device)
    checks.check_index("seq_lens", metadata.seq_lens, (None,), device)
    num_seqs = metadata.seq_lens.shape[0]
    checks.check_index("block_tables", metadata.block_tables, (num_seqs, None), device)
    checks.check_index("query_start_loc", metadata.query_start_loc, (num_seqs + 1,), device)
    made = AttentionPlan(
        cache_shape=key_cache.shape,
        dtype=key_cache.dtype,
        num_heads=num_heads,
        sliding_window=sliding_window,
        run=backend.run,
        state=backend.plan(metadata, key_cache, num_heads, sliding_window),
    )
    metadata.plans[sliding_window] = made
    return made


def step_plan(
    metadata: AttentionMetadata,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_heads: int,
    sliding_window: int | None = None,
) -> AttentionPlan:
    """The step's plan for `sliding_window`: the one `plan` made, else made now (a bad
    cache pair is named before the batch is read)."""
    made = metadata.plans.get(sliding_window)
    if made is None:
        checks.check_kv_pair(key_cache, value_cache)
        made = plan(metadata, key_cache, value_cache, num_heads, sliding_window)
    return made


def paged_attention_from_metadata(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    attn_metadata: AttentionMetadata,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_attention` of one layer, with the batch planned once for the step.

    Plans on first use when `plan` was not called for this window. Checks only the query
    and that the caches are the ones the plan was made for.

    Args:
        query: [num_tokens, num_heads, head_dim].
        key_cache, value_cache: this layer's pools.
        attn_metadata: the step's metadata.
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        sliding_window: as in `paged_attention`.
        key_scales, value_scales: this layer's scales, as in `paged_attention`.

    Returns:
        [num_tokens, num_heads, head_dim] in the query's dtype.

    Raises:
        ValueError: as `paged_attention`.
    """
    scales = _pair(key_scales, value_scales)
    if sliding_window not in attn_metadata.plans:
        checks.check_kv_pair(key_cache, value_cache)
        checks.check_query(query, key_cache)  # a bad query is named before plan() reads it
    made = step_plan(attn_metadata, key_cache, value_cache, query.shape[1], sliding_window)
    cache_shape, dtype, num_heads = made.cache_shape, made.dtype, made.num_heads
    if key_cache.shape != cache_shape or value_cache.shape != cache_shape:
        checks.check_kv_pair(key_cache, value_cache)
        raise checks.fail("key_cache", f"shape {tuple(cache_shape)} (as planned)", key_cache.shape)
    if key_cache.dtype != dtype or value_cache.dtype != dtype:
        raise checks.fail("key_cache", f"dtype {dtype} (as planned)", key_cache.dtype)
    checks.check_query(query, key_cache)
    checks.check_scales(scales, key_cache)
    if query.shape[0] != attn_metadata.num_tokens or query.shape[1] != num_heads:
        raise checks.fail(
            "query",
            f"shape [{attn_metadata.num_tokens}, {num_heads}, *] (as planned)",
            tuple(query.shape),
        )
    scale = checks.resolve_scale(scale, cache_shape[3])
    return made.run(query, key_cache, value_cache, made.state, scale, scales)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    backend: str = "auto",
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed new tokens over their sequences' paged KV.

    Serves prefill, chunked prefill over a cached prefix and decode, mixed in one batch. New
    token i of sequence s sits at position ``p = seq_lens[s] - query_len_s + i`` and attends
    to cached positions j with ``j <= p`` (and ``j > p - sliding_window`` when set). Query
    head h reads KV head ``h // (num_heads // num_kv_heads)`` (GQA).

    Args:
        query: [num_tokens, num_heads, head_dim], float32 | bfloat16 | float16 | float64.
        key_cache: [num_blocks, block_size, num_kv_heads, head_dim], the query's dtype, or
            int8 with scales.
        value_cache: same shape, dtype and device as `key_cache`.
        block_tables: int32 [num_seqs, max_blocks]; entries past a sequence's last block
            are never read (may be -1).
        seq_lens: int32 [num_seqs], total length of each sequence including its new tokens.
        query_start_loc: int32 [num_seqs + 1], cumulative query lengths starting at 0.
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        sliding_window: attend to at most this many most recent positions (incl. own).
        backend: "auto" (triton on CUDA, cpu on CPU), "cpu", "reference" or "triton".
        key_scales, value_scales: [num_blocks, block_size, num_kv_heads] float16 beside an
            int8 cache (row t of a head holds ``cache * scale``), else None.

    Returns:
        [num_tokens, num_heads, head_dim] in the query's dtype (accumulated in float32).

    Raises:
        ValueError: a shape, dtype, device or length does not match ("expected X, got Y"),
            or the backend is unknown or unavailable.
    """
    checks.check_kv_pair(key_cache, value_cache)
    checks.check_query(query, key_cache)
    metadata = AttentionMetadata(
        slot_mapping=torch.empty(query.shape[0], dtype=torch.int64),
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        backend=backend,
    )
    return paged_attention_from_metadata(
        query, key_cache, value_cache, metadata, scale=scale, sliding_window=sliding_window,
        key_scales=key_scales, value_scales=value_scales,
    )  # fmt: skip
