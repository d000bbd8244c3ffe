"""transformers as an anchor of `bench_latency.py`: the same Hugging Face directory, greedy
decoding over a static KV cache, eager or with the decode step compiled by `torch.compile`
(Inductor's CPU backend, one graph per batch size: the shapes are fixed).

A run is measured as `bench_latency.run_batch` measures pagedkv: time to first token is the
prefill of the whole batch and its first sample; decode tokens/s counts the tokens after the
first over the time after it. Prompts of one length, so no padding or attention mask.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

MODES = ("eager", "compile")


class TransformersDecoder:
    """One model in one dtype; `run(prompts, new_tokens)` for any batch size, prompt and new
    tokens together at most `max_len`."""

    def __init__(self, model_dir: Path, dtype: str, mode: str, max_len: int) -> None:
        from transformers import AutoModelForCausalLM

        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, torch_dtype=getattr(torch, dtype)
        ).eval()
        self.mode = mode
        self.max_len = max_len
        self._steps: dict[int, tuple[Any, Callable[..., torch.Tensor]]] = {}

    def _step_for(self, batch: int) -> tuple[Any, Callable[..., torch.Tensor]]:
        """The static cache and the decode step of a batch size, built (compiled) once."""
        if batch not in self._steps:
            from transformers import StaticCache

            cache = StaticCache(config=self.model.config, max_cache_len=self.max_len)

            def step(tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
                out = self.model(tokens, cache_position=position, past_key_values=cache)
                return out.logits[:, -1]

            if self.mode == "compile":
                step = torch.compile(step, fullgraph=True, dynamic=False)
            self._steps[batch] = (cache, step)
        return self._steps[batch]

    def run(self, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
        """Greedy decoding of `new_tokens` per prompt (prompts of one length)."""
        if len({len(p) for p in prompts}) != 1:
            raise ValueError("prompts: expected one length for all, got several")
        if len(prompts[0]) + new_tokens > self.max_len:
            raise ValueError(f"prompt and new tokens: expected at most {self.max_len}, "
                             f"got {len(prompts[0]) + new_tokens}")  # fmt: skip
        ids = torch.tensor(prompts, dtype=torch.int64)
        length = ids.shape[1]
        cache, step = self._step_for(len(prompts))
        with torch.inference_mode():
            cache.reset()
            start = time.perf_counter()
            logits = self.model(
                ids, cache_position=torch.arange(length), past_key_values=cache
            ).logits[:, -1]
            tokens = logits.argmax(-1, keepdim=True)
            first = time.perf_counter()
            for i in range(new_tokens - 1):
                tokens = step(tokens, torch.tensor([length + i])).argmax(-1, keepdim=True)
            end = time.perf_counter()
        return {
            "ttft_s": first - start,
            "decode_tokens_per_s": len(prompts) * (new_tokens - 1) / (end - first),
        }
