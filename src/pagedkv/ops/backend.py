"""The contract every attention backend implements, and the registry that finds them.

A backend is a module exporting the four functions of `AttentionBackend`. The public ops
(`pagedkv.ops.attention`) check every argument before calling in, so a backend checks only
what it alone can see (values of index tensors where they live on the CPU). Backends are
imported on first use: the GPU one needs Triton, which a CPU install may lack.

One engine step calls them as FlashInfer's wrappers are called:

    plan(metadata, ...)          once per step (and per distinct sliding window)
    write_kv(...); run(...)      per layer, reusing the plan
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any, Protocol

import torch

from pagedkv.ops.metadata import AttentionMetadata
from pagedkv.ops.quantize import KVScales

_MODULES = {
    "reference": "pagedkv.ops.reference",
    "cpu": "pagedkv.ops.cpu",
    "triton": "pagedkv.ops.triton",
}
_DEFAULT = {"cpu": "cpu", "cuda": "triton"}


class AttentionBackend(Protocol):
    """What `pagedkv.ops` needs from a backend (arguments already checked)."""

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        scales: KVScales | None,
    ) -> None:
        """Store token t's key/value rows at slot slot_mapping[t]; skip negative slots.
        Into an int8 cache each row is quantized (`pagedkv.ops.quantize`) and its scale
        stored in `scales` (key_scales, value_scales) at the same slot.

        Raises:
            ValueError: a slot lies past the cache (rows before it may be written).
        """

    def plan(
        self,
        metadata: AttentionMetadata,
        key_cache: torch.Tensor,
        num_heads: int,
        sliding_window: int | None,
    ) -> Any:
        """Check the batch's lengths and block ids against the cache and split the work.

        Args:
            metadata: the step's batch (index tensors checked for dtype, shape, device).
            key_cache: any layer's key pool: every layer has the same shape and dtype.
            num_heads: query heads (a multiple of the cache's KV heads).
            sliding_window: the window the plan serves, or None.

        Returns:
            An opaque plan for `run`.

        Raises:
            ValueError: a length or block id that does not fit.
        """

    def run(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        plan: Any,
        scale: float,
        scales: KVScales | None,
    ) -> torch.Tensor:
        """Attention of the planned batch for one layer.

        Args:
            query: [num_tokens, num_heads, head_dim], the caches' dtype (any float dtype
                over int8 caches).
            key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim].
            plan: what `plan` returned for this step and window.
            scale: softmax scale.
            scales: (key_scales, value_scales) [num_blocks, block_size, num_kv_heads]
                float16 of int8 caches, else None; applied once per token and head.

        Returns:
            [num_tokens, num_heads, head_dim] in the query's dtype.
        """

    def warmup(self, key_cache: torch.Tensor, value_cache: torch.Tensor, num_heads: int) -> None:
        """Compile (or load) every kernel this cache pair will need; never writes it."""


@functools.cache
def _import(name: str) -> AttentionBackend:
    return importlib.import_module(_MODULES[name])  # type: ignore[return-value]


def get_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend module for `name` on `device`; "auto" is the device's default.

    Raises:
        ValueError: an unknown name, a CPU-only backend for a device tensor, or a backend
            that cannot be imported here.
    """
    if name == "auto":
        name = _DEFAULT.get(device.type, "reference")
    elif name not in _MODULES:
        raise ValueError(f"backend: expected auto or one of {sorted(_MODULES)}, got {name!r}")
    elif name == "cpu" and device.type != "cpu":
        raise ValueError(f"backend: expected CPU tensors for backend 'cpu', got device {device}")
    try:
        return _import(name)
    except ImportError as exc:
        raise ValueError(f"backend: expected an importable backend, got {name!r} ({exc})") from exc


def available_backends() -> list[str]:
    """Backend names usable in this process, besides "auto".

    `triton` is listed when it imports and either CUDA is present or ``TRITON_INTERPRET=1``
    (its CPU interpreter, for tests).
    """
    names = []
    for name in _MODULES:
        if name == "triton" and not (
            torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
        ):
            continue
        try:
            _import(name)
        except ImportError:
            continue
        names.append(name)
    return names
