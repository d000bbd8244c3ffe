"""What the engine returns, shaped like vLLM's `RequestOutput` (standard library only)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["length", "stop", "abort"]


@dataclass
class CompletionOutput:
    """One completion of a request (one of its `n` samples).

    Attributes:
        index: the sample's index in `0..n-1`.
        text: the detokenized completion ("" without a tokenizer); cut before a stop string.
        token_ids: the generated token ids (a stop token id or EOS is kept).
        cumulative_logprob: sum of the sampled tokens' logprobs (raw logits, float32); None
            unless `SamplingParams.logprobs` is set (as vLLM: the engine computes logprobs
            only when asked).
        logprobs: per generated token, token id -> logprob for the top `logprobs` tokens and
            the sampled one; None unless `SamplingParams.logprobs` is set.
        finish_reason: "length", "stop", "abort", or None while running.
        stop_reason: the stop string or stop token id that ended it; None for EOS or length.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestMetrics:
    """Timings (seconds, `time.monotonic()` clock unless the caller gave `arrival_time`) and
    memory events of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_swaps: int = 0
    # Prompt tokens served from the prefix cache at first admission.
    num_cached_tokens: int = 0
    num_computed_tokens: int = 0


@dataclass
class RequestOutput:
    """The cumulative state of one request after a step (or at the end).

    Attributes:
        prompt_logprobs: None unless `SamplingParams.prompt_logprobs` is set; then one entry
            per prompt token: None for the first (nothing predicts it), then token id ->
            logprob for the top `prompt_logprobs` tokens and the prompt token itself, from
            the logits of the position before it (vLLM's shape, logprobs as floats).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def num_cached_tokens(self) -> int:
        return self.metrics.num_cached_tokens
