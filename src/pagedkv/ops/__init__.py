"""Attention ops over the paged KV cache: `write_kv`, `plan`, `paged_attention` and their
metadata. Backends (`reference`, `cpu`, `triton`) load lazily; see `pagedkv.ops.backend`.
"""

from __future__ import annotations

from pagedkv.ops.attention import (
    paged_attention,
    paged_attention_from_metadata,
    plan,
    step_plan,
    warmup,
    write_kv,
)
from pagedkv.ops.backend import AttentionBackend, available_backends
from pagedkv.ops.metadata import AttentionMetadata, AttentionPlan

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionPlan",
    "available_backends",
    "paged_attention",
    "paged_attention_from_metadata",
    "plan",
    "step_plan",
    "warmup",
    "write_kv",
]
