"""pagedkv: a paged KV cache for LLM inference.

Names are re-exported lazily so that the torch-free layers (`pagedkv.memory`,
`pagedkv.sim`, the scheduler) import without pulling in torch. Importing the package sets
the OpenMP thread policy first (`pagedkv.runtime.threads`).
"""

from __future__ import annotations

import importlib
from typing import Any

from pagedkv.runtime.threads import apply_thread_policy

apply_thread_policy()

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "pagedkv.engine.llm",
    "LLMEngine": "pagedkv.engine.engine",
    "EngineArgs": "pagedkv.engine.args",
    "SamplingParams": "pagedkv.engine.sampling_params",
    "BeamSearchParams": "pagedkv.engine.sampling_params",
    "StructuredOutputsParams": "pagedkv.engine.structured",
    "BeamSearchOutput": "pagedkv.engine.beam_search",
    "RequestOutput": "pagedkv.engine.outputs",
    "CompletionOutput": "pagedkv.engine.outputs",
    "KVCacheManager": "pagedkv.memory",
    "OutOfBlocks": "pagedkv.errors",
    "PagedKVCache": "pagedkv.cache",
    "paged_attention": "pagedkv.ops",
    "write_kv": "pagedkv.ops",
    "ModelConfig": "pagedkv.config",
    "CacheConfig": "pagedkv.config",
    "SchedulerConfig": "pagedkv.config",
    "EngineConfig": "pagedkv.config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedkv' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
