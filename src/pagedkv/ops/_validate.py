"""Argument checks for the public ops, shared by every backend.

The shape/dtype/device checks read only tensor metadata (no kernel launch, no device sync):
they run twice per layer per engine step. The value checks (`check_lengths`) read the small
integer tensors and therefore run only where those already live on the CPU.
"""

from __future__ import annotations

import math

import numpy as np
import torch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


def _fail(name: str, expected: str, got: object) -> ValueError:
    return ValueError(f"{name}: expected {expected}, got {got}")


def check_kv_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[int, ...]:
    """Check the two cache pools and return their shape (num_blocks, block_size, kv_heads, dim)."""
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not isinstance(cache, torch.Tensor):
            raise _fail(name, "a torch.Tensor", type(cache).__name__)
        if cache.dim() != 4:
            raise _fail(
                name,
                "4 dims [num_blocks, block_size, num_kv_heads, head_dim]",
                f"shape {tuple(cache.shape)}",
            )
        if cache.dtype not in SUPPORTED_DTYPES:
            raise _fail(name, "float32, bfloat16, float16 (or float64)", cache.dtype)
        if cache.stride(-1) != 1:
            raise _fail(name, "a contiguous last dim (stride 1)", f"stride {cache.stride()}")
    if value_cache.shape != key_cache.shape:
        raise _fail(
            "value_cache",
            f"shape {tuple(key_cache.shape)} (as key_cache)",
            tuple(value_cache.shape),
        )
    if value_cache.dtype != key_cache.dtype:
        raise _fail("value_cache", f"dtype {key_cache.dtype} (as key_cache)", value_cache.dtype)
    if value_cache.device != key_cache.device:
        raise _fail("value_cache", f"device {key_cache.device}", value_cache.device)
    return tuple(key_cache.shape)


def known_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple:
    """Check a cache pair once and remember it: (value_cache, (num_kv_heads, head_dim), dtype,
    device, or None for the CPU).

    The ops run per layer per step, and a decode step's write has a 10 us budget: the pair's
    checks are memoized on `key_cache` (a tensor's shape, dtype and device do not change;
    restriding a cache in place with `resize_`, `set_` or `as_strided_` is not supported), so
    a call with a known pair reads only the new tensors' attributes. Raises like
    `check_kv_pair`.
    """
    pair = key_cache.__dict__.get("_pagedkv_pair") if type(key_cache) is torch.Tensor else None
    if pair is not None and pair[0] is value_cache:
        return pair
    check_kv_pair(key_cache, value_cache)
    pair = (
        value_cache,
        key_cache.shape[2:],
        key_cache.dtype,
        None if key_cache.is_cpu else key_cache.device,  # None: compare with `is_cpu`
    )
    key_cache.__dict__["_pagedkv_pair"] = pair
    return pair


def check_index(
    name: str,
    tensor: torch.Tensor,
    shape: tuple[int | None, ...],
    device: torch.device,
    dtypes: tuple[torch.dtype, ...] = (torch.int32,),
) -> None:
    """Check an integer tensor's dtype, device and shape (None in `shape` matches any size)."""
    if not isinstance(tensor, torch.Tensor):
        raise _fail(name, "a torch.Tensor", type(tensor).__name__)
    if tensor.dtype not in dtypes:
        raise _fail(name, " or ".join(str(d) for d in dtypes), tensor.dtype)
    if tensor.device != device:
        raise _fail(name, f"device {device}", tensor.device)
    if tensor.dim() != len(shape) or any(
        want is not None and want != got for want, got in zip(shape, tensor.shape, strict=True)
    ):
        expected = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise _fail(name, f"shape {expected}", f"shape {tuple(tensor.shape)}")


def _attention_args_ok(
    query, block_tables, seq_lens, query_start_loc, sliding_window, pair
) -> bool:
    # Run per layer per step, right after other kernels have flushed the caches (where each
    # tensor attribute costs several times its hot ~60-150 ns): read each one once, index
    # torch.Size objects rather than slice or compare them, test `is_cpu` for a CPU cache.
    _, (num_kv_heads, head_dim), dtype, device = pair
    int32 = torch.int32
    try:
        q_shape, num_seqs = query.shape, seq_lens.shape[0]
        return (
            len(q_shape) == 3 and q_shape[2] == head_dim and q_shape[1] % num_kv_heads == 0
            and query.dtype is dtype and seq_lens.ndim == 1
            and block_tables.dtype is int32 and seq_lens.dtype is int32
            and query_start_loc.dtype is int32
            and block_tables.ndim == 2 and block_tables.shape[0] == num_seqs
            and query_start_loc.ndim == 1 and query_start_loc.shape[0] == num_seqs + 1
            and (
                query.is_cpu and block_tables.is_cpu and seq_lens.is_cpu
                and query_start_loc.is_cpu if device is None
                else query.device == device and block_tables.device == device
                and seq_lens.device == device and query_start_loc.device == device
            )
            and (sliding_window is None or (type(sliding_window) is int and sliding_window >= 1))
        )  # fmt: skip
    except (AttributeError, TypeError, IndexError, ZeroDivisionError):
        return False  # not tensors, or 0-dim: the detailed checks say which


def check_attention_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float | None,
    sliding_window: int | None,
) -> float:
    """Check `paged_attention`'s arguments (metadata only) and return the resolved scale.

    As in `check_write_args`, one combined test passes the valid case cheaply.
    """
    pair = known_pair(key_cache, value_cache)
    if _attention_args_ok(query, block_tables, seq_lens, query_start_loc, sliding_window, pair):
        if scale is None:
            return 1.0 / math.sqrt(pair[1][1])
        if not isinstance(scale, bool) and isinstance(scale, (int, float)) and math.isfinite(scale):
            return float(scale)
    _, _, num_kv_heads, head_dim = check_kv_pair(key_cache, value_cache)
    if not isinstance(query, torch.Tensor):
        raise _fail("query", "a torch.Tensor", type(query).__name__)
    if query.dim() != 3:
        raise _fail(
            "query", "3 dims [num_tokens, num_heads, head_dim]", f"shape {tuple(query.shape)}"
        )
    if query.dtype != key_cache.dtype:
        raise _fail("query", f"dtype {key_cache.dtype} (as key_cache)", query.dtype)
    if query.device != key_cache.device:
        raise _fail("query", f"device {key_cache.device} (as key_cache)", query.device)
    num_heads = query.shape[1]
    if query.shape[2] != head_dim:
        raise _fail("query", f"head_dim {head_dim} (as key_cache)", query.shape[2])
    if num_heads % num_kv_heads != 0:
        raise _fail("query", f"num_heads a multiple of num_kv_heads={num_kv_heads}", num_heads)
    num_seqs = seq_lens.shape[0] if isinstance(seq_lens, torch.Tensor) and seq_lens.dim() else None
    check_index("seq_lens", seq_lens, (None,), query.device)
    check_index("block_tables", block_tables, (num_seqs, None), query.device)
    check_index("query_start_loc", query_start_loc, (num_seqs + 1,), query.device)
    if sliding_window is not None and (
        isinstance(sliding_window, bool)
        or not isinstance(sliding_window, int)
        or sliding_window < 1
    ):
        raise _fail("sliding_window", "None or a positive int", repr(sliding_window))
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise _fail("scale", "None or a finite float", repr(scale))
    return float(scale)


def check_lengths(
    query_start_loc: np.ndarray, seq_lens: np.ndarray, num_tokens: int, max_context: int
) -> None:
    """Check the packed-layout invariants on CPU copies of the index tensors.

    Invariant: 0 = qsl[0] <= qsl[1] <= ... <= qsl[-1] = num_tokens, and each sequence's new
    tokens fit in its total length, which fits in its block table (max_blocks x block_size).
    """
    if query_start_loc[0] != 0 or query_start_loc[-1] != num_tokens:
        raise _fail(
            "query_start_loc",
            f"to run from 0 to num_tokens={num_tokens}",
            f"{int(query_start_loc[0])}..{int(query_start_loc[-1])}",
        )
    query_lens = np.diff(query_start_loc)
    if (query_lens < 0).any():
        raise _fail("query_start_loc", "non-decreasing offsets", query_start_loc.tolist())
    bad = np.flatnonzero((seq_lens < query_lens) | (seq_lens > max_context))
    if bad.size:
        s = int(bad[0])
        raise _fail(
            "seq_lens",
            f"query_len={int(query_lens[s])} <= seq_lens[{s}] <= "
            f"max_blocks*block_size={max_context}",
            int(seq_lens[s]),
        )


def check_write_args(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> int:
    """Check `write_kv`'s arguments (metadata only); returns the number of tokens.

    One combined test covers the valid case; the detailed checks below run only to name
    what is wrong (this runs per layer per step, so the common path must be cheap: a decode
    step's write has a 10 us budget). The cache pair's checks are memoized (`known_pair`),
    so a call with a known pair reads nine attributes of the new tensors.
    """
    _, (num_kv_heads, head_dim), dtype, device = known_pair(key_cache, value_cache)
    try:
        # Indexing a torch.Size is cheap, slicing it is not (~0.2 us per slice).
        key_shape = key.shape
        if (
            len(key_shape) == 3 and key_shape[1] == num_kv_heads and key_shape[2] == head_dim
            and value.shape == key_shape
            and slot_mapping.ndim == 1 and slot_mapping.shape[0] == key_shape[0]
            and slot_mapping.dtype in INDEX_DTYPES
            and key.dtype is dtype and value.dtype is dtype
            and (
                key.is_cpu and value.is_cpu and slot_mapping.is_cpu if device is None
                else key.device == device and value.device == device
                and slot_mapping.device == device
            )
        ):  # fmt: skip
            return key_shape[0]
    except (AttributeError, TypeError):
        pass  # not tensors: the detailed checks say which
    _check_write_args(key, value, key_cache, value_cache, slot_mapping)
    return key.shape[0]


def _check_write_args(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Name what is wrong with arguments the combined test rejected."""
    _, _, num_kv_heads, head_dim = check_kv_pair(key_cache, value_cache)
    for name, tensor in (("key", key), ("value", value)):
        if not isinstance(tensor, torch.Tensor):
            raise _fail(name, "a torch.Tensor", type(tensor).__name__)
        if tensor.dim() != 3 or tuple(tensor.shape[1:]) != (num_kv_heads, head_dim):
            raise _fail(
                name,
                f"shape [num_tokens, {num_kv_heads}, {head_dim}]",
                f"shape {tuple(tensor.shape)}",
            )
        if tensor.dtype != key_cache.dtype:
            raise _fail(name, f"dtype {key_cache.dtype} (as key_cache)", tensor.dtype)
        if tensor.device != key_cache.device:
            raise _fail(name, f"device {key_cache.device} (as key_cache)", tensor.device)
    if value.shape[0] != key.shape[0]:
        raise _fail("value", f"{key.shape[0]} tokens (as key)", value.shape[0])
    check_index("slot_mapping", slot_mapping, (key.shape[0],), key.device, INDEX_DTYPES)
