"""OpenAI logprobs from the engine's token id -> logprob dicts (completions and chat)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedkv.server.protocol import ChatTokenLogprob, CompletionLogprobs, TopLogprob
from pagedkv.server.streaming import SampleDelta


def token_text(tokenizer: Any, token_id: int) -> str:
    """The text of one token (``token_id:N`` when the model has no tokenizer)."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


@dataclass
class LogprobFormatter:
    """Builds OpenAI logprobs for one choice, delta by delta (keeps the text offset)."""

    tokenizer: Any
    text_offset: int = 0

    def completion(self, sample: SampleDelta) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for token_id, top in zip(sample.token_ids, sample.logprobs or [], strict=False):
            self._add_token(out, token_id)
            out.token_logprobs.append(_finite(top.get(token_id)))
            out.top_logprobs.append(self._top_dict(_sorted(top)))
        return out

    def prompt(
        self,
        token_ids: list[int],
        prompt_logprobs: list[dict[int, float] | None] | None,
        num_top: int,
    ) -> CompletionLogprobs:
        """The echoed prompt's logprobs: null for the first token (nothing predicts it)."""
        out = CompletionLogprobs()
        for i, token_id in enumerate(token_ids):
            self._add_token(out, token_id)
            top = prompt_logprobs[i] if prompt_logprobs is not None else None
            if top is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(_finite(top.get(token_id)))
            tops = [(token_id, top[token_id])] if num_top == 0 else _sorted(top)[:num_top]
            if all(t != token_id for t, _ in tops):
                tops.append((token_id, top[token_id]))
            out.top_logprobs.append(self._top_dict(tops))
        return out

    def chat(self, sample: SampleDelta, num_top: int) -> list[ChatTokenLogprob]:
        out = []
        for token_id, top in zip(sample.token_ids, sample.logprobs or [], strict=False):
            tops = [self._chat_entry(TopLogprob, t, lp) for t, lp in _sorted(top)[:num_top]]
            out.append(
                self._chat_entry(ChatTokenLogprob, token_id, top.get(token_id), top_logprobs=tops)
            )
        return out

    def _add_token(self, out: CompletionLogprobs, token_id: int) -> None:
        """Append a token's text and its offset in the choice's text."""
        text = token_text(self.tokenizer, token_id)
        out.tokens.append(text)
        out.text_offset.append(self.text_offset)
        self.text_offset += len(text)

    def _top_dict(self, tops: list[tuple[int, float]]) -> dict[str, float]:
        return {token_text(self.tokenizer, t): _finite(lp) for t, lp in tops}

    def _chat_entry(
        self, cls: type[Any], token_id: int, logprob: float | None, **extra: Any
    ) -> Any:
        text = token_text(self.tokenizer, token_id)
        return cls(token=text, logprob=_finite(logprob), bytes=list(text.encode()), **extra)


def _sorted(top: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(top.items(), key=lambda kv: -kv[1])


def _finite(value: float | None) -> float:
    # JSON has no -inf; OpenAI clients expect a number, so clamp like vLLM does.
    return -9999.0 if value is None else max(float(value), -9999.0)
