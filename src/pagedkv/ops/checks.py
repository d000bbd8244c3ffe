"""Argument checks of the public ops, shared by every backend: the one place that names a
bad argument ("<name>: expected X, got Y").

The shape, dtype and device checks read tensor metadata only (no kernel launch, no device
sync). The value checks (`check_lengths`; the backends' own passes raise `bad_block` and
`slot_past_end`) read the small index tensors and run where those already live on the CPU.
"""

from __future__ import annotations

import math
from typing import TypeGuard

import numpy as np
import torch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
CACHE_DTYPES = (*SUPPORTED_DTYPES, torch.int8)
"""A cache holds the queries' dtype, or int8 with float16 scales (`pagedkv.ops.quantize`)."""
INDEX_DTYPES = (torch.int32, torch.int64)


def fail(name: str, expected: str, got: object) -> ValueError:
    """The error every check raises."""
    return ValueError(f"{name}: expected {expected}, got {got}")


def check_kv_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[int, ...]:
    """Check two cache pools; return their shape (num_blocks, block_size, kv_heads, dim)."""
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not isinstance(cache, torch.Tensor):
            raise fail(name, "a torch.Tensor", type(cache).__name__)
        if cache.dim() != 4:
            raise fail(
                name,
                "4 dims [num_blocks, block_size, num_kv_heads, head_dim]",
                f"shape {tuple(cache.shape)}",
            )
        if cache.dtype not in CACHE_DTYPES:
            raise fail(name, "float32, bfloat16, float16, int8 (or float64)", cache.dtype)
        if cache.stride(-1) != 1:
            raise fail(name, "a contiguous last dim (stride 1)", f"stride {cache.stride()}")
    if value_cache.shape != key_cache.shape:
        raise fail(
            "value_cache",
            f"shape {tuple(key_cache.shape)} (as key_cache)",
            tuple(value_cache.shape),
        )
    if value_cache.dtype != key_cache.dtype:
        raise fail("value_cache", f"dtype {key_cache.dtype} (as key_cache)", value_cache.dtype)
    if value_cache.device != key_cache.device:
        raise fail("value_cache", f"device {key_cache.device}", value_cache.device)
    return tuple(key_cache.shape)


def _is_positive_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_num_heads(num_heads: object, num_kv_heads: int) -> None:
    """Query heads: a positive multiple of the caches' KV heads."""
    if not _is_positive_int(num_heads) or num_heads % num_kv_heads:
        raise fail("num_heads", f"a positive multiple of num_kv_heads = {num_kv_heads}", num_heads)


def check_query(query: torch.Tensor, key_cache: torch.Tensor) -> None:
    """query: [num_tokens, num_heads, head_dim] in the cache's dtype and device."""
    if not isinstance(query, torch.Tensor):
        raise fail("query", "a torch.Tensor", type(query).__name__)
    if query.dim() != 3:
        raise fail(
            "query", "3 dims [num_tokens, num_heads, head_dim]", f"shape {tuple(query.shape)}"
        )
    check_rows_dtype("query", query, key_cache)
    if query.device != key_cache.device:
        raise fail("query", f"device {key_cache.device} (as key_cache)", query.device)
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    if query.shape[2] != head_dim:
        raise fail("query", f"head_dim {head_dim} (as key_cache)", query.shape[2])
    if query.shape[1] % num_kv_heads != 0:
        raise fail("query", f"num_heads a multiple of num_kv_heads={num_kv_heads}", query.shape[1])


def check_rows_dtype(name: str, rows: torch.Tensor, key_cache: torch.Tensor) -> None:
    """Query, key or value rows: the cache's dtype, or any float dtype over an int8 cache."""
    if key_cache.dtype == torch.int8:
        if rows.dtype not in SUPPORTED_DTYPES:
            raise fail(name, "float32, bfloat16, float16 or float64 (int8 cache)", rows.dtype)
    elif rows.dtype != key_cache.dtype:
        raise fail(name, f"dtype {key_cache.dtype} (as key_cache)", rows.dtype)


def check_scales(scales: tuple[torch.Tensor, torch.Tensor] | None, key_cache: torch.Tensor) -> None:
    """(key_scales, value_scales): [num_blocks, block_size, num_kv_heads] float16 beside an
    int8 cache, with a contiguous last dim; None beside any other."""
    if key_cache.dtype != torch.int8:
        if scales is not None:
            raise fail("key_scales", f"None for a {key_cache.dtype} cache", "scales")
        return
    if scales is None:
        raise fail("key_scales", "float16 scales beside an int8 cache", None)
    shape = tuple(key_cache.shape[:3])
    for name, t in zip(("key_scales", "value_scales"), scales, strict=True):
        if not isinstance(t, torch.Tensor):
            raise fail(name, "a torch.Tensor", type(t).__name__)
        if tuple(t.shape) != shape or t.dtype != torch.float16:
            raise fail(name, f"float16 of shape {shape}", f"{t.dtype} {tuple(t.shape)}")
        if t.device != key_cache.device:
            raise fail(name, f"device {key_cache.device} (as key_cache)", t.device)
        if t.stride(-1) != 1:
            raise fail(name, "a contiguous last dim (stride 1)", f"stride {t.stride()}")


def check_index(
    name: str,
    tensor: torch.Tensor,
    shape: tuple[int | None, ...],
    device: torch.device,
    dtypes: tuple[torch.dtype, ...] = (torch.int32,),
) -> None:
    """Check an integer tensor's dtype, device and shape (None in `shape` matches any size)."""
    if not isinstance(tensor, torch.Tensor):
        raise fail(name, "a torch.Tensor", type(tensor).__name__)
    if tensor.dtype not in dtypes:
        raise fail(name, " or ".join(str(d) for d in dtypes), tensor.dtype)
    if tensor.device != device:
        raise fail(name, f"device {device}", tensor.device)
    if tensor.dim() != len(shape) or any(
        want is not None and want != got for want, got in zip(shape, tensor.shape, strict=True)
    ):
        expected = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise fail(name, f"shape {expected}", f"shape {tuple(tensor.shape)}")


def resolve_scale(scale: float | None, head_dim: int) -> float:
    """The softmax scale: `scale`, or 1 / sqrt(head_dim) for None."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise fail("scale", "None or a finite float", repr(scale))
    return float(scale)


def check_window(sliding_window: int | None) -> None:
    """None, or a positive int."""
    if sliding_window is not None and not _is_positive_int(sliding_window):
        raise fail("sliding_window", "None or a positive int", repr(sliding_window))


def check_lengths(
    query_start_loc: np.ndarray, seq_lens: np.ndarray, num_tokens: int, max_context: int
) -> None:
    """Check the packed layout on CPU copies of the index tensors.

    Invariant: 0 = qsl[0] <= qsl[1] <= ... <= qsl[-1] = num_tokens, and each sequence's new
    tokens fit in its total length, which fits in its block table (max_blocks x block_size).
    """
    if query_start_loc[0] != 0 or query_start_loc[-1] != num_tokens:
        raise fail(
            "query_start_loc",
            f"to run from 0 to num_tokens={num_tokens}",
            f"{int(query_start_loc[0])}..{int(query_start_loc[-1])}",
        )
    query_lens = np.diff(query_start_loc)
    if (query_lens < 0).any():
        raise fail("query_start_loc", "non-decreasing offsets", query_start_loc.tolist())
    bad = np.flatnonzero((seq_lens < query_lens) | (seq_lens > max_context))
    if bad.size:
        s = int(bad[0])
        raise fail(
            "seq_lens",
            f"query_len={int(query_lens[s])} <= seq_lens[{s}] <= "
            f"max_blocks*block_size={max_context}",
            int(seq_lens[s]),
        )


def bad_block(
    block_tables: np.ndarray, seq_lens: np.ndarray, seq: int, num_blocks: int, block_size: int
) -> ValueError:
    """The error for a sequence whose block table holds an id outside the pool."""
    used = -(-int(seq_lens[seq]) // block_size)
    return fail(
        "block_tables",
        f"block ids in [0, {num_blocks}) for the blocks of sequence {seq}",
        block_tables[seq].tolist()[:used],
    )


def check_write(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """`write_kv`'s arguments (metadata only)."""
    _, _, num_kv_heads, head_dim = check_kv_pair(key_cache, value_cache)
    check_scales(scales, key_cache)
    for name, tensor in (("key", key), ("value", value)):
        if not isinstance(tensor, torch.Tensor):
            raise fail(name, "a torch.Tensor", type(tensor).__name__)
        if tensor.dim() != 3 or tuple(tensor.shape[1:]) != (num_kv_heads, head_dim):
            raise fail(
                name,
                f"shape [num_tokens, {num_kv_heads}, {head_dim}]",
                f"shape {tuple(tensor.shape)}",
            )
        check_rows_dtype(name, tensor, key_cache)
        if tensor.device != key_cache.device:
            raise fail(name, f"device {key_cache.device} (as key_cache)", tensor.device)
    if value.dtype != key.dtype:
        raise fail("value", f"dtype {key.dtype} (as key)", value.dtype)
    if value.shape[0] != key.shape[0]:
        raise fail("value", f"{key.shape[0]} tokens (as key)", value.shape[0])
    check_index("slot_mapping", slot_mapping, (key.shape[0],), key.device, INDEX_DTYPES)


def slot_past_end(slot_mapping: torch.Tensor, token: int, num_slots: int) -> ValueError:
    """The error for a slot beyond the cache."""
    return fail(
        "slot_mapping",
        f"slots < num_blocks * block_size = {num_slots}",
        f"slot_mapping[{token}] = {int(slot_mapping[token])}",
    )


def check_slots_fit(slot_mapping: torch.Tensor, num_slots: int) -> None:
    """Raise `slot_past_end` for the first slot at or past `num_slots`, before anything is
    written. Reads every slot: for backends whose slots live on the CPU (or a reference)."""
    past = torch.nonzero(slot_mapping >= num_slots)
    if past.numel():
        raise slot_past_end(slot_mapping, int(past[0]), num_slots)
