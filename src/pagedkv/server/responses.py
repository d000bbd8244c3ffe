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
    completion_logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class _Builder:
    """Shared bookkeeping: choices by index, token counts for `usage`."""

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

    def _count(self, prompt_index: int, delta: RequestDelta) -> None:
        self._prompt_tokens[prompt_index] = len(delta.prompt_token_ids)
        self._completion_tokens += sum(len(s.token_ids) for s in delta.samples)

    def usage(self) -> UsageInfo:
        prompt = sum(self._prompt_tokens.values())
        return UsageInfo(
            prompt_tokens=prompt,
            completion_tokens=self._completion_tokens,
            total_tokens=prompt + self._completion_tokens,
        )

    def _include_usage(self) -> bool:
        return bool(self.body.stream_options and self.body.stream_options.include_usage)

    def first_chunks(self) -> list[Any]:
        return []


class CompletionBuilder(_Builder):
    """`/v1/completions` bodies: `text_completion` objects, legacy logprobs lists.

    With `echo`, each choice starts with the prompt (text, tokens and, with `logprobs`,
    the prompt logprobs); with `max_tokens: 0` as well, the prompt is all it holds (the
    engine still generates one token, which is dropped, as vLLM does).
    """

    body: CompletionRequest

    @property
    def _is_echo_only(self) -> bool:
        return self.body.echo and self.body.max_tokens == 0

    def _count(self, prompt_index: int, delta: RequestDelta) -> None:
        self._prompt_tokens[prompt_index] = len(delta.prompt_token_ids)
        if not self._is_echo_only:
            self._completion_tokens += sum(len(s.token_ids) for s in delta.samples)

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
                if choice.completion_logprobs is None:
                    choice.completion_logprobs = logprobs
                else:
                    _extend(choice.completion_logprobs, logprobs)

    def response(self) -> CompletionResponse:
        choices = [
            CompletionChoice(
                index=i,
                text="".join(c.text),
                finish_reason=c.finish_reason,
                logprobs=c.completion_logprobs
                or (CompletionLogprobs() if self.body.logprobs is not None else None),
            )
            for i, c in sorted(self._choices.items())
        ]
        return CompletionResponse(
            id=self.request_id, model=self.model, choices=choices, usage=self.usage()
        )

    def chunks(self, prompt_index: int, delta: RequestDelta) -> list[CompletionResponse]:
        self._count(prompt_index, delta)
        out = []
        for sample in delta.samples:
            index, _, text, logprobs = self._part(prompt_index, delta, sample)
            out.append(
                CompletionResponse(
                    id=self.request_id,
                    model=self.model,
                    choices=[
                        CompletionChoice(
                            index=index,
                            text=text,
                            logprobs=logprobs,
                            finish_reason=sample.finish_reason,
                        )
                    ],
                )
            )
        return out

    def usage_chunk(self) -> CompletionResponse | None:
        if not self._include_usage():
            return None
        return CompletionResponse(
            id=self.request_id, model=self.model, choices=[], usage=self.usage()
        )


def _extend(logprobs: CompletionLogprobs, part: CompletionLogprobs) -> None:
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        getattr(logprobs, name).extend(getattr(part, name))


class ChatBuilder(_Builder):
    """`/v1/chat/completions` bodies: assistant messages, per-token logprob objects."""

    body: ChatCompletionRequest

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
                choice.formatter.chat_content.extend(content)

    def response(self) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=i,
                message=ChatResponseMessage(content="".join(c.text)),
                finish_reason=c.finish_reason,
                logprobs=(
                    ChatLogprobs(content=c.formatter.chat_content) if self.body.logprobs else None
                ),
            )
            for i, c in sorted(self._choices.items())
        ]
        return ChatCompletionResponse(
            id=self.request_id, model=self.model, choices=choices, usage=self.usage()
        )

    def first_chunks(self) -> list[ChatCompletionChunk]:
        # OpenAI opens every choice's stream with the role, then sends content deltas.
        return [
            ChatCompletionChunk(
                id=self.request_id,
                model=self.model,
                choices=[
                    ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                ],
            )
            for i in range(self.body.n)
        ]

    def chunks(self, prompt_index: int, delta: RequestDelta) -> list[ChatCompletionChunk]:
        self._count(prompt_index, delta)
        out = []
        for sample in delta.samples:
            index, choice = self._choice(prompt_index, sample)
            content = self._chat_logprobs(choice, sample)
            out.append(
                ChatCompletionChunk(
                    id=self.request_id,
                    model=self.model,
                    choices=[
                        ChatChunkChoice(
                            index=index,
                            delta=DeltaMessage(content=sample.text),
                            logprobs=ChatLogprobs(content=content) if content is not None else None,
                            finish_reason=sample.finish_reason,
                        )
                    ],
                )
            )
        return out

    def usage_chunk(self) -> ChatCompletionChunk | None:
        if not self._include_usage():
            return None
        return ChatCompletionChunk(
            id=self.request_id, model=self.model, choices=[], usage=self.usage()
        )
