"""The engine: requests, the torch-free scheduler, the model runner, sampling and `LLM`.

Nothing is imported eagerly here, so `pagedkv.engine.scheduler` and
`pagedkv.engine.request` stay importable without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "pagedkv.engine.llm",
    "LLMEngine": "pagedkv.engine.engine",
    "SamplingParams": "pagedkv.engine.sampling_params",
    "BeamSearchParams": "pagedkv.engine.sampling_params",
    "RequestOutput": "pagedkv.engine.outputs",
    "CompletionOutput": "pagedkv.engine.outputs",
    "RequestMetrics": "pagedkv.engine.outputs",
    "Scheduler": "pagedkv.engine.scheduler",
    "SchedulerOutput": "pagedkv.engine.scheduler",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedkv.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
