"""Assemble OpenAI response bodies and stream chunks from engine deltas.

A builder sees every delta of a request once, either to accumulate a whole response
(`add` then `response`) or to turn each into stream chunks (`chunks`). Choice index =
prompt index x n + sample index, as OpenAI numbers a batch of prompts with n samples each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedkv.server.logprobs import LogprobFormatter
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
    UsageInfo,
)
from pagedkv.server.streaming import RequestDelta, SampleDelta


@dataclass
class _Choice:
    formatter: LogprobFormatter
    text: list[str] = field(default_factory=list)
    completion_logprobs: CompletionLogprobs = field(default_factory=CompletionLogprobs)
    chat_logprobs: list[ChatTokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


class _Builder:
    """Shared bookkeeping: choices by index, token counts for `usage`."""

    # The body of stream chunks: one choice each, or none and the usage.
    chunk_type: type[CompletionResponse] | type[ChatCompletionChunk]

    def __init__(self, request_id: str, model: str, body: SamplingRequest, tokenizer: Any) -> None:
        self.request_id = request_id
        self.model = model
        self.body = body
        self.tokenizer = tokenizer
        self._choices: dict[int, _Choice] = {}
        self._prompt_tokens: dict[int, int] = {}
        self._completion_tokens = 0

    def _choice(self, prompt_index: int, sample: SampleDelta) -> tuple[int, _Choice]:
        index = prompt_index * self.body.n + sample.index
        if index not in self._choices:
            self._choices[index] = _Choice(LogprobFormatter(self.tokenizer))
        return index, self._choices[index]

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

    def _part(
        self, prompt_index: int, delta: RequestDelta, sample: SampleDelta
    ) -> tuple[int, _Choice, str, CompletionLogprobs | None]:
        """A sample delta's text and logprobs, the echoed prompt first on a choice's first."""
        index = prompt_index * self.body.n + sample.index
        is_first = index not in self._choices
        index, choice = self._choice(prompt_index, sample)
        with_logprobs = self.body.logprobs is not None
        text, logprobs = "", CompletionLogprobs() if with_logprobs else None
        if is_first and self.body.echo:
            text = self._prompt_text(delta)
            if with_logprobs:
                logprobs = choice.formatter.prompt(
                    delta.prompt_token_ids, delta.prompt_logprobs, self.body.logprobs or 0
                )
        if not self._is_echo_only:
            text += sample.text
            if logprobs is not None:
                _extend(logprobs, choice.formatter.completion(sample))
        return index, choice, text, logprobs

    def _prompt_text(self, delta: RequestDelta) -> str:
        if delta.prompt is not None:
            return delta.prompt
        return self.tokenizer.decode(delta.prompt_token_ids) if self.tokenizer else ""

    def add(self, prompt_index: int, delta: RequestDelta) -> None:
        self._count(prompt_index, delta)
        for sample in delta.samples:
            _, choice, text, logprobs = self._part(prompt_index, delta, sample)
            choice.text.append(text)
            choice.finish_reason = sample.finish_reason or choice.finish_reason
            if logprobs is not None:
                _extend(choice.completion_logprobs, logprobs)

    def response(self) -> CompletionResponse:
        choices = [
            CompletionChoice(
                index=i,
                text="".join(c.text),
                finish_reason=c.finish_reason,
                logprobs=c.completion_logprobs if self.body.logprobs is not None else None,
            )
            for i, c in sorted(self._choices.items())
        ]
        return self._chunk(choices, self.usage())

    def chunks(self, prompt_index: int, delta: RequestDelta) -> list[CompletionResponse]:
        self._count(prompt_index, delta)
        out = []
        for sample in delta.samples:
            index, _, text, logprobs = self._part(prompt_index, delta, sample)
            choice = CompletionChoice(
                index=index, text=text, logprobs=logprobs, finish_reason=sample.finish_reason
            )
            out.append(self._chunk([choice]))
        return out


def _extend(logprobs: CompletionLogprobs, part: CompletionLogprobs) -> None:
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        getattr(logprobs, name).extend(getattr(part, name))


class ChatBuilder(_Builder):
    """`/v1/chat/completions` bodies: assistant messages, per-token logprob objects."""

    body: ChatCompletionRequest
    chunk_type = ChatCompletionChunk

    def _chat_logprobs(self, choice: _Choice, sample: SampleDelta) -> list[Any] | None:
        if not self.body.logprobs:
            return None
        return choice.formatter.chat(sample, self.body.top_logprobs or 0)

    def add(self, prompt_index: int, delta: RequestDelta) -> None:
        self._count(prompt_index, delta)
        for sample in delta.samples:
            _, choice = self._choice(prompt_index, sample)
            choice.text.append(sample.text)
            choice.finish_reason = sample.finish_reason or choice.finish_reason
            content = self._chat_logprobs(choice, sample)
            if content is not None:
                choice.chat_logprobs.extend(content)

    def response(self) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=i,
                message=ChatResponseMessage(content="".join(c.text)),
                finish_reason=c.finish_reason,
                logprobs=(ChatLogprobs(content=c.chat_logprobs) if self.body.logprobs else None),
            )
            for i, c in sorted(self._choices.items())
        ]
        return ChatCompletionResponse(
            id=self.request_id, model=self.model, choices=choices, usage=self.usage()
        )

    def first_chunks(self) -> list[ChatCompletionChunk]:
        # OpenAI opens every choice's stream with the role, then sends content deltas.
        return [
            self._chunk(
                [ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))]
            )
            for i in range(self.body.n)
        ]

    def chunks(self, prompt_index: int, delta: RequestDelta) -> list[ChatCompletionChunk]:
        self._count(prompt_index, delta)
        out = []
        for sample in delta.samples:
            index, choice = self._choice(prompt_index, sample)
            content = self._chat_logprobs(choice, sample)
            chunk_choice = ChatChunkChoice(
                index=index,
                delta=DeltaMessage(content=sample.text),
                logprobs=ChatLogprobs(content=content) if content is not None else None,
                finish_reason=sample.finish_reason,
            )
            out.append(self._chunk([chunk_choice]))
        return out
