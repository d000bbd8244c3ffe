"""The demo's workload: a seeded mix of chat turns behind shared system prompts, parallel
samples and long documents, and what contiguous per-request reservation would admit of it."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DemoRequest:
    kind: str  # "chat" (shared system prompt), "sample" (n > 1), "document" (long, alone)
    prompt_token_ids: list[int]
    n: int
    max_tokens: int

    @property
    def reserved_tokens(self) -> int:
        """What a contiguous allocator reserves up front: prompt + max_tokens per sample."""
        return self.n * (len(self.prompt_token_ids) + self.max_tokens)


def make_workload(
    num_requests: int, vocab_size: int, seed: int = 0, max_model_len: int = 4096
) -> list[DemoRequest]:
    """A seeded mix: 55% chat turns behind 3 shared system prompts, 20% n = 2..4 samples,
    25% long documents; prompts of ~20 to ~2000 tokens, 16 to 160 new tokens each
    (prompts cut to fit `max_model_len`).

    Raises:
        ValueError: num_requests < 1 or a vocabulary too small for random prompts.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests: expected >= 1, got {num_requests}")
    if vocab_size < 16:
        raise ValueError(f"vocab_size: expected >= 16, got {vocab_size}")
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab_size) for _ in range(n)]  # 0..2 are special

    systems = [tokens(n) for n in (96, 384, 768)]
    return [_fit(_draw(rng, tokens, systems), max_model_len) for _ in range(num_requests)]


def _draw(rng: random.Random, tokens: Any, systems: list[list[int]]) -> DemoRequest:
    draw = rng.random()
    if draw < 0.55:
        prompt = rng.choice(systems) + tokens(rng.randint(12, 200))
        return DemoRequest("chat", prompt, 1, rng.randint(16, 160))
    if draw < 0.75:
        return DemoRequest(
            "sample", tokens(rng.randint(20, 400)), rng.randint(2, 4), rng.randint(16, 96)
        )
    return DemoRequest("document", tokens(rng.randint(600, 1900)), 1, rng.randint(16, 64))


def _fit(request: DemoRequest, max_model_len: int) -> DemoRequest:
    max_tokens = min(request.max_tokens, max_model_len // 4)
    prompt = request.prompt_token_ids[: max_model_len - max_tokens]
    return DemoRequest(request.kind, prompt, request.n, max_tokens)


def contiguous_admission(requests: list[DemoRequest], pool_tokens: int) -> int:
    """Requests (in arrival order) a contiguous per-request allocator admits at once.

    Each request reserves `n x (prompt + max_tokens)` token slots before it starts, as
    systems without paging do; admission stops at the first that does not fit.
    """
    totals = itertools.accumulate(r.reserved_tokens for r in requests)
    return sum(1 for _ in itertools.takewhile(lambda used: used <= pool_tokens, totals))


def default_num_blocks(requests: list[DemoRequest], block_size: int) -> int:
    """A pool holding about a sixth of the workload's total reservation (at least the
    largest single request): small enough that paging and sharing decide throughput."""
    total = sum(r.reserved_tokens for r in requests)
    largest = max(len(r.prompt_token_ids) + r.max_tokens + r.n * block_size for r in requests)
    return -(-max(total // 6, largest) // block_size)
