"""Turn the engine's cumulative outputs into deltas a client can stream.

The engine reports each sample's whole text and token ids so far. Streaming sends only
what is new. One subtlety: a stop string can be completed by a later token, and the engine
then truncates the text before it. Text that might be the start of a stop string is
therefore held back (up to the longest stop string minus one character) until the next
token settles it, so the concatenated deltas always equal the final text.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class SampleDelta:
    """What one sample (`index` among the request's n) gained since the last delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None


@dataclass
class RequestDelta:
    """One progress report of a request: the samples that changed, and whether it is done."""

    prompt_token_ids: list[int]
    samples: list[SampleDelta]
    finished: bool
    prompt: str | None = None
    # The request's prompt logprobs (RequestOutput's shape) when it asked for them.
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass
class _SampleState:
    num_chars: int = 0
    num_tokens: int = 0
    is_finished: bool = False


@dataclass
class DeltaTracker:
    """Per-request memory of what has been sent; `update` turns an output into a delta.

    Text that may start one of the request's `stop` strings is held back.
    """

    stop: Sequence[str] | None = None
    _samples: dict[int, _SampleState] = field(default_factory=dict)

    @property
    def holdback(self) -> int:
        return max((len(s) for s in self.stop or ()), default=1) - 1

    def update(self, output: Any) -> RequestDelta:
        """Delta of a `RequestOutput` (duck-typed) against what earlier calls returned."""
        samples = [self._sample_delta(c) for c in output.outputs]
        return RequestDelta(
            prompt_token_ids=list(output.prompt_token_ids or []),
            samples=[s for s in samples if s is not None],
            finished=bool(output.finished),
            prompt=output.prompt,
            prompt_logprobs=getattr(output, "prompt_logprobs", None),
        )

    def _sample_delta(self, completion: Any) -> SampleDelta | None:
        state = self._samples.setdefault(completion.index, _SampleState())
        if state.is_finished:
            return None  # a finished sample of a request whose other samples still run
        text = completion.text or ""
        finish_reason = completion.finish_reason
        end = len(text) if finish_reason is not None else len(text) - self.holdback
        if end < state.num_chars:
            if finish_reason is not None and len(text) < state.num_chars:
                # Would mean the engine changed text already released; keep what was sent.
                logger.warning("sample %d: text shrank below what was streamed", completion.index)
            end = state.num_chars
        token_ids = list(completion.token_ids[state.num_tokens :])
        logprobs = None
        if completion.logprobs is not None:
            logprobs = list(completion.logprobs[state.num_tokens : len(completion.token_ids)])
        new_text = text[state.num_chars : end]
        if not new_text and not token_ids and finish_reason is None:
            return None
        state.num_chars = end
        state.num_tokens = len(completion.token_ids)
        state.is_finished = finish_reason is not None
        return SampleDelta(
            index=completion.index,
            text=new_text,
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=finish_reason,
        )
