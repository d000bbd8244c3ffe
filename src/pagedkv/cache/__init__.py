"""KV cache tensors: per-layer key/value block pools (`PagedKVCache`)."""

from __future__ import annotations

from pagedkv.cache.kv_cache import PagedKVCache

__all__ = ["PagedKVCache"]
