"""Public attention ops and the backend registry.

A backend is a module exporting

    paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                    *, scale: float, sliding_window: int | None) -> Tensor
    write_kv(key, value, key_cache, value_cache, slot_mapping) -> None

and receiving arguments already validated here. It may also export
``paged_attention_from_metadata(query, key_cache, value_cache, attn_metadata, *, scale,
sliding_window)`` to reuse a per-step plan, and ``warmup(key_cache, value_cache, num_heads)``
to compile its kernels ahead of the first step. Backends are imported lazily, on first use.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

from pagedkv.ops import _validate
from pagedkv.ops.metadata import AttentionMetadata

_BACKEND_MODULES = {
    "reference": "pagedkv.ops.reference",
    "cpu": "pagedkv.ops.cpu",
    "triton": "pagedkv.ops.triton",
}
_loaded: dict[str, ModuleType] = {}


def _load(name: str) -> ModuleType:
    module = _loaded.get(name)
    if module is None:
        module = _loaded[name] = importlib.import_module(_BACKEND_MODULES[name])
    return module


def available_backends() -> list[str]:
    """Backend names usable in this process.

    `triton` is listed when `pagedkv.ops.triton` imports and either CUDA is present or
    ``TRITON_INTERPRET=1`` (the CPU interpreter, for tests).

    Returns:
        Names accepted by ``backend=``, besides "auto".
    """
    names = []
    for name in _BACKEND_MODULES:
        if name == "triton" and not (
            torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
        ):
            continue
        try:
            _load(name)
        except ImportError:
            continue
        names.append(name)
    return names


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map "auto" to a concrete backend for `device`, and check the name and device."""
    if backend == "auto":
        return "triton" if device.type == "cuda" else "cpu"
    if backend not in _BACKEND_MODULES:
        raise ValueError(
            f"backend: expected auto or one of {sorted(_BACKEND_MODULES)}, got {backend!r}"
        )
    if backend == "cpu" and device.type != "cpu":
        raise ValueError(f"backend: expected CPU tensors for backend 'cpu', got device {device}")
    return backend


def _get(backend: str, device: torch.device) -> ModuleType:
    name = resolve_backend(backend, device)
    try:
        return _load(name)
    except ImportError as exc:
        raise ValueError(f"backend: expected an importable backend, got {name!r} ({exc})") from exc


def warmup(
    key_cache: torch.Tensor, value_cache: torch.Tensor, num_heads: int, *, backend: str = "auto"
) -> None:
    """Get the backend's kernels for this cache pair ready before the first step.

    JIT backends compile on first use, seconds per kernel, and a kernel can first be needed
    deep into serving (the CPU backend's parallel decode only runs for large batches). An
    engine calls this once at start-up; backends without a warm-up do nothing. Reads the
    caches, never writes them.

    Args:
        key_cache, value_cache: the pools steps will use, [num_blocks, block_size,
            num_kv_heads, head_dim].
        num_heads: query heads, a multiple of num_kv_heads.
        backend: as for `paged_attention`.

    Raises:
        ValueError: bad caches, `num_heads` or backend.
    """
    num_kv_heads = _validate.check_kv_pair(key_cache, value_cache)[2]
    if (
        isinstance(num_heads, bool)
        or not isinstance(num_heads, int)
        or num_heads < 1
        or (num_heads % num_kv_heads)
    ):
        raise ValueError(
            f"num_heads: expected a positive multiple of num_kv_heads = {num_kv_heads}, "
            f"got {num_heads!r}"
        )
    module = _get(backend, key_cache.device)
    prepare = getattr(module, "warmup", None)
    if prepare is not None:
        prepare(key_cache, value_cache, num_heads)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write the new tokens' keys and values into the paged cache, in place.

    Args:
        key: [num_tokens, num_kv_heads, head_dim], the cache's dtype.
        value: [num_tokens, num_kv_heads, head_dim], the cache's dtype.
        key_cache: [num_blocks, block_size, num_kv_heads, head_dim], float32 | bfloat16 | float16.
        value_cache: same shape, dtype and device as `key_cache`.
        slot_mapping: int64 | int32 [num_tokens]; token t goes to block
            ``slot // block_size``, row ``slot % block_size``. Negative slots are skipped.

    Raises:
        ValueError: a shape, dtype or device does not match ("expected X, got Y").
    """
    # The common case, CPU tensors and a known cache pair, checks its own arguments and
    # writes in one compiled call (`cpu.try_write`); False: anything else.
    cpu = _loaded.get("cpu")
    if cpu is not None and cpu.try_write(key, value, key_cache, value_cache, slot_mapping):
        return
    if not _validate.check_write_args(key, value, key_cache, value_cache, slot_mapping):
        return  # no tokens
    # A pair's first write, or one `try_write` does not take (strided, other devices).
    module = _loaded.get("cpu") if key.is_cpu else None
    if module is None:
        try:
            module = _load(resolve_backend("auto", key_cache.device))
        except ImportError:
            # Without the Triton backend a GPU cache is still writable (with a host sync).
            module = _load("reference")
    module.write_kv(key, value, key_cache, value_cache, slot_mapping)


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
) -> torch.Tensor:
    """Causal attention of packed new tokens over their sequences' paged KV.

    Serves prefill, chunked prefill over a cached prefix and decode, mixed in one batch. New
    token i of sequence s sits at position ``p = seq_lens[s] - query_len_s + i`` and attends
    to cached positions j with ``j <= p`` (and ``j > p - sliding_window`` when set). Query
    head h reads KV head ``h // (num_heads // num_kv_heads)`` (GQA).

    Args:
        query: [num_tokens, num_heads, head_dim], float32 | bfloat16 | float16.
        key_cache: [num_blocks, block_size, num_kv_heads, head_dim], the query's dtype.
        value_cache: same shape, dtype and device as `key_cache`.
        block_tables: int32 [num_seqs, max_blocks]; entries past a sequence's last block
            are never read (may be -1).
        seq_lens: int32 [num_seqs], total length of each sequence including its new tokens.
        query_start_loc: int32 [num_seqs + 1], cumulative query lengths starting at 0.
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        sliding_window: attend to at most this many most recent positions (incl. own).
        backend: "auto" (triton on CUDA, cpu on CPU), "cpu", "reference" or "triton".

    Returns:
        [num_tokens, num_heads, head_dim] in the query's dtype (accumulated in float32).

    Raises:
        ValueError: a shape, dtype, device or length does not match ("expected X, got Y"),
            or the backend is unknown or unavailable.
    """
    if backend == "auto" or backend == "cpu":
        # The common case, a CPU decode batch over a known cache pair, checks its own
        # arguments and runs in one compiled call (`cpu.try_decode`); None: anything else.
        cpu = _loaded.get("cpu")
        if cpu is not None:
            out = cpu.try_decode(
                query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                sliding_window,
            )  # fmt: skip
            if out is not None:
                return out
    scale = _validate.check_attention_args(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        sliding_window,
    )
    if query.is_cpu and (backend == "auto" or backend == "cpu"):
        # Without the lookups below (a few us per call on a cold cache). The cpu backend
        # checks lengths and block ids while planning, in one Numba pass.
        module = _loaded.get("cpu") or _load("cpu")
    else:
        resolve_backend(backend, query.device)  # names a bad backend before any length
        if query.is_cpu:  # reference, or triton under its interpreter
            _validate.check_lengths(
                query_start_loc.numpy(),
                seq_lens.numpy(),
                query.shape[0],
                block_tables.shape[1] * key_cache.shape[1],
            )
        module = _get(backend, query.device)
    return module.paged_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale=scale,
        sliding_window=sliding_window,
    )


def paged_attention_from_metadata(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    attn_metadata: AttentionMetadata,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """`paged_attention` with the batch description taken from `attn_metadata`.

    Same result as the plain function; backends that keep a per-step plan (the CPU backend
    splits work across cores once per step) reuse it across layers, and the length checks
    run once per step instead of once per layer.

    Args:
        query: [num_tokens, num_heads, head_dim].
        key_cache: [num_blocks, block_size, num_kv_heads, head_dim].
        value_cache: same as `key_cache`.
        attn_metadata: this step's metadata (its `backend` selects the backend).
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        sliding_window: as in `paged_attention`.

    Returns:
        [num_tokens, num_heads, head_dim] in the query's dtype.

    Raises:
        ValueError: as `paged_attention`.
    """
    md = attn_metadata
    if md.backend == "auto" or md.backend == "cpu":
        # A later layer of a CPU decode step runs its plan in one compiled call, checking
        # only the query (`cpu.try_planned`); None: anything else.
        cpu = _loaded.get("cpu")
        if cpu is not None:
            out = cpu.try_planned(query, key_cache, value_cache, md, scale, sliding_window)
            if out is not None:
                return out
    scale = _validate.check_attention_args(
        query,
        key_cache,
        value_cache,
        md.block_tables,
        md.seq_lens,
        md.query_start_loc,
        scale,
        sliding_window,
    )
    module = _get(md.backend, query.device)
    planned = getattr(module, "paged_attention_from_metadata", None)
    if planned is None:
        if query.device.type == "cpu" and ("checked", key_cache.shape[1]) not in md.plans:
            _validate.check_lengths(
                md.query_start_loc.numpy(),
                md.seq_lens.numpy(),
                query.shape[0],
                md.block_tables.shape[1] * key_cache.shape[1],
            )
            md.plans["checked", key_cache.shape[1]] = True
        return module.paged_attention(
            query,
            key_cache,
            value_cache,
            md.block_tables,
            md.seq_lens,
            md.query_start_loc,
            scale=scale,
            sliding_window=sliding_window,
        )
    return planned(query, key_cache, value_cache, md, scale=scale, sliding_window=sliding_window)


__all__ = [
    "AttentionMetadata",
    "available_backends",
    "paged_attention",
    "paged_attention_from_metadata",
    "resolve_backend",
    "write_kv",
]
