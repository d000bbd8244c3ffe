"""Assemble OpenAI response bodies and stream chunks from engine deltas.

A builder turns every delta of a request into stream chunks (`chunks`, one choice each);
a whole response is those chunks merged per choice (`add` each delta, then `response`).
Choice index = prompt index x n + sample index, as OpenAI numbers a batch of prompts with
n samples each. Logprobs come from the engine's token id -> logprob dicts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedkv.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    SamplingRequest,
    TopLogprob,
    UsageInfo,
)
from pagedkv.server.streaming import RequestDelta, SampleDelta


class _Builder:
    """Shared bookkeeping: one logprob formatter per choice, token counts for `usage`."""

    # The body of stream chunks: one choice each, or none and the usage.
    chunk_type: type[CompletionResponse] | type[ChatCompletionChunk]

    def __init__(self, request_id: str, model: str, body: SamplingRequest, tokenizer: Any) -> None:
        self.request_id = request_id
        self.model = model
        self.body = body
        self.tokenizer = tokenizer
        self._formatters: dict[int, LogprobFormatter] = {}
        self._parts: dict[int, list[Any]] = {}  # choice index -> its chunks' choices
        self._prompt_tokens: dict[int, int] = {}
        self._completion_tokens = 0

    def _choice_formatter(
        self, prompt_index: int, sample: SampleDelta
    ) -> tuple[int, LogprobFormatter, bool]:
        """The sample's choice index, its logprob formatter, and whether it is new."""
        index = prompt_index * self.body.n + sample.index
        is_new = index not in self._formatters
        if is_new:
            self._formatters[index] = LogprobFormatter(self.tokenizer)
        return index, self._formatters[index], is_new

    @property
    def _is_echo_only(self) -> bool:
        return False

    def _count(self, prompt_index: int, delta: RequestDelta) -> None:
        self._prompt_tokens[prompt_index] = len(delta.prompt_token_ids)
        if not self._is_echo_only:
            self._completion_tokens += sum(len(s.token_ids) for s in delta.samples)

    def usage(self) -> UsageInfo:
        prompt = sum(self._prompt_tokens.values())
        return UsageInfo(
            prompt_tokens=prompt,
            completion_tokens=self._completion_tokens,
            total_tokens=prompt + self._completion_tokens,
        )

    def _chunk(self, choices: list[Any], usage: UsageInfo | None = None) -> Any:
        return self.chunk_type(id=self.request_id, model=self.model, choices=choices, usage=usage)

    def _sample_choice(self, prompt_index: int, delta: RequestDelta, sample: SampleDelta) -> Any:
        """One sample's delta as the choice of a stream chunk."""
        raise NotImplementedError

    def _delta_choices(self, prompt_index: int, delta: RequestDelta) -> list[Any]:
        self._count(prompt_index, delta)
        return [self._sample_choice(prompt_index, delta, sample) for sample in delta.samples]

    def chunks(self, prompt_index: int, delta: RequestDelta) -> list[Any]:
        """A delta's stream chunks: one per sample that changed."""
        return [self._chunk([choice]) for choice in self._delta_choices(prompt_index, delta)]

    def add(self, prompt_index: int, delta: RequestDelta) -> None:
        """Keep a delta for `response()`, which merges each choice's stream chunks."""
        for choice in self._delta_choices(prompt_index, delta):
            self._parts.setdefault(choice.index, []).append(choice)

    def first_chunks(self) -> list[Any]:
        return []

    def usage_chunk(self) -> Any:
        """The last chunk, with no choice and the usage, if `stream_options` asks for it."""
        options = self.body.stream_options
        return self._chunk([], self.usage()) if options and options.include_usage else None


class CompletionBuilder(_Builder):
    """`/v1/completions` bodies: `text_completion` objects, legacy logprobs lists.

    With `echo`, each choice starts with the prompt (text, tokens and, with `logprobs`,
    the prompt logprobs); with `max_tokens: 0` as well, the prompt is all it holds (the
    engine still generates one token, which is dropped, as vLLM does).
    """

    body: CompletionRequest
    chunk_type = CompletionResponse

    @property
    def _is_echo_only(self) -> bool:
        return self.body.echo and self.body.max_tokens == 0

    def _prompt_text(self, delta: RequestDelta) -> str:
        if delta.prompt is not None:
            return delta.prompt
        return self.tokenizer.decode(delta.prompt_token_ids) if self.tokenizer else ""

    def _sample_choice(
        self, prompt_index: int, delta: RequestDelta, sample: SampleDelta
    ) -> CompletionChoice:
        """A choice's first delta has the echoed prompt in front."""
        index, formatter, is_new = self._choice_formatter(prompt_index, sample)
        text, logprobs = "", CompletionLogprobs() if self.body.logprobs is not None else None
        if is_new and self.body.echo:
            text = self._prompt_text(delta)
            if logprobs is not None:
                logprobs = formatter.prompt(
                    delta.prompt_token_ids, delta.prompt_logprobs, self.body.logprobs or 0
                )
        if not self._is_echo_only:
            text += sample.text
            if logprobs is not None:
                _extend(logprobs, formatter.completion(sample))
        return CompletionChoice(
            index=index, text=text, logprobs=logprobs, finish_reason=sample.finish_reason
        )

    def response(self) -> CompletionResponse:
        choices = []
        for index, parts in sorted(self._parts.items()):
            logprobs = None
            if self.body.logprobs is not None:
                logprobs = CompletionLogprobs()
                for part in parts:
                    _extend(logprobs, part.logprobs)
            text = "".join(part.text for part in parts)
            choices.append(
                CompletionChoice(
                    index=index, text=text, logprobs=logprobs, finish_reason=parts[-1].finish_reason
                )
            )
        return self._chunk(choices, self.usage())


def _extend(logprobs: CompletionLogprobs, part: CompletionLogprobs) -> None:
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        getattr(logprobs, name).extend(getattr(part, name))


class ChatBuilder(_Builder):
    """`/v1/chat/completions` bodies: assistant messages, per-token logprob objects."""

    body: ChatCompletionRequest
    chunk_type = ChatCompletionChunk

    def first_chunks(self) -> list[ChatCompletionChunk]:
        # OpenAI opens every choice's stream with the role, then sends content deltas.
        return [
            self._chunk(
                [ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))]
            )
            for i in range(self.body.n)
        ]

    def _sample_choice(
        self, prompt_index: int, delta: RequestDelta, sample: SampleDelta
    ) -> ChatChunkChoice:
        index, formatter, _ = self._choice_formatter(prompt_index, sample)
        logprobs = None
        if self.body.logprobs:
            logprobs = ChatLogprobs(content=formatter.chat(sample, self.body.top_logprobs or 0))
        return ChatChunkChoice(
            index=index,
            delta=DeltaMessage(content=sample.text),
            logprobs=logprobs,
            finish_reason=sample.finish_reason,
        )

    def response(self) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=i,
                message=ChatResponseMessage(content="".join(p.delta.content for p in parts)),
                finish_reason=parts[-1].finish_reason,
                logprobs=(
                    ChatLogprobs(content=[t for p in parts for t in p.logprobs.content])
                    if self.body.logprobs
                    else None
                ),
            )
            for i, parts in sorted(self._parts.items())
        ]
        return ChatCompletionResponse(
            id=self.request_id, model=self.model, choices=choices, usage=self.usage()
        )


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
            tops = _sorted(top)[:num_top]
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
