"""Assemble OpenAI response bodies and stream chunks from engine deltas.

A builder turns every delta of a request into stream chunks (`chunks`, one choice each);
a whole response is those chunks merged per choice (`add` each delta, then `response`).
Choice index = prompt index x n + sample index, as OpenAI numbers a batch of prompts with
n samples each. Logprobs come from the engine's token id -> logprob dicts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    SamplingRequest,
    ToolCall,
    TopLogprob,
    UsageInfo,
)
from pagedkv.server.streaming import RequestDelta, SampleDelta
from pagedkv.server.tool_parsers import ToolCallDelta, ToolCallExtractor


class _Builder:
    """Shared bookkeeping: choice numbering, the kept chunks, token counts for `usage`."""

    # The body of stream chunks (one choice each, or none and the usage) and of `response()`.
    chunk_type: type[CompletionResponse] | type[ChatCompletionChunk]
    response_type: type[CompletionResponse] | type[ChatCompletionResponse]
    # No sample text or tokens are sent (an echo of the prompt alone).
    _is_echo_only = False

    def __init__(self, request_id: str, model: str, body: SamplingRequest, tokenizer: Any) -> None:
        self.request_id = request_id
        self.model = model
        self.body = body
        self.tokenizer = tokenizer
        self._parts: dict[int, list[Any]] = {}  # choice index -> its chunks' choices
        self._prompt_tokens: dict[int, int] = {}
        self._completion_tokens = 0

    def _index(self, prompt_index: int, sample: SampleDelta) -> int:
        return prompt_index * self.body.n + sample.index

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

    def _merged(self, parts: list[Any]) -> Any:
        """One choice of `response()` from its stream chunks' choices."""
        raise NotImplementedError

    def _delta_choices(self, prompt_index: int, delta: RequestDelta) -> list[Any]:
        self._prompt_tokens[prompt_index] = len(delta.prompt_token_ids)
        if not self._is_echo_only:
            self._completion_tokens += sum(len(s.token_ids) for s in delta.samples)
        return [self._sample_choice(prompt_index, delta, sample) for sample in delta.samples]

    def chunks(self, prompt_index: int, delta: RequestDelta) -> list[Any]:
        """A delta's stream chunks: one per sample that changed."""
        return [self._chunk([choice]) for choice in self._delta_choices(prompt_index, delta)]

    def add(self, prompt_index: int, delta: RequestDelta) -> None:
        """Keep a delta for `response()`, which merges each choice's stream chunks."""
        for choice in self._delta_choices(prompt_index, delta):
            self._parts.setdefault(choice.index, []).append(choice)

    def response(self) -> Any:
        choices = [self._merged(parts) for _, parts in sorted(self._parts.items())]
        return self.response_type(
            id=self.request_id, model=self.model, choices=choices, usage=self.usage()
        )

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
    chunk_type = response_type = CompletionResponse

    def __init__(
        self, request_id: str, model: str, body: CompletionRequest, tokenizer: Any
    ) -> None:
        super().__init__(request_id, model, body, tokenizer)
        self._text_offsets: dict[int, int] = {}  # choice index -> its text's length so far
        self._is_echo_only = body.echo and body.max_tokens == 0

    def _prompt_text(self, delta: RequestDelta) -> str:
        if delta.prompt is not None:
            return delta.prompt
        return self.tokenizer.decode(delta.prompt_token_ids) if self.tokenizer else ""

    def _sample_choice(
        self, prompt_index: int, delta: RequestDelta, sample: SampleDelta
    ) -> CompletionChoice:
        """A choice's first delta has the echoed prompt in front."""
        index = self._index(prompt_index, sample)
        is_first = index not in self._text_offsets
        self._text_offsets.setdefault(index, 0)
        texts, logprobs = [], []
        if is_first and self.body.echo:
            texts.append(self._prompt_text(delta))
            logprobs.append(self._logprobs(index, delta.prompt_token_ids, delta.prompt_logprobs))
        if not self._is_echo_only:
            texts.append(sample.text)
            logprobs.append(self._logprobs(index, sample.token_ids, sample.logprobs))
        return CompletionChoice(
            index=index,
            text="".join(texts),
            logprobs=_joined(logprobs) if self.body.logprobs is not None else None,
            finish_reason=sample.finish_reason,
        )

    def _merged(self, parts: list[Any]) -> CompletionChoice:
        return CompletionChoice(
            index=parts[0].index,
            text="".join(part.text for part in parts),
            logprobs=_joined([p.logprobs for p in parts])
            if self.body.logprobs is not None
            else None,
            finish_reason=parts[-1].finish_reason,
        )

    def _logprobs(
        self, index: int, token_ids: list[int], tops: Sequence[dict[int, float] | None] | None
    ) -> CompletionLogprobs:
        """Legacy logprobs of choice `index`'s next tokens. `tops[i]`: token id -> logprob of
        token i and of the top tokens at its position (as the engine reports them), None
        where there are none (the first prompt token: nothing predicts it). `tops` None (no
        logprobs asked for): an empty result."""
        out = CompletionLogprobs()
        for token_id, top in zip(token_ids, tops or [], strict=False):
            text = token_text(self.tokenizer, token_id)
            out.tokens.append(text)
            out.text_offset.append(self._text_offsets[index])
            self._text_offsets[index] += len(text)
            if top is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
            else:
                out.token_logprobs.append(_finite(top.get(token_id)))
                out.top_logprobs.append(
                    {token_text(self.tokenizer, t): _finite(lp) for t, lp in _sorted(top)}
                )
        return out


def _joined(parts: list[CompletionLogprobs]) -> CompletionLogprobs:
    """Consecutive runs of tokens' logprobs as one."""
    joined = CompletionLogprobs()
    for part in parts:
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(joined, name).extend(getattr(part, name))
    return joined


class ChatBuilder(_Builder):
    """`/v1/chat/completions` bodies: assistant messages, per-token logprob objects."""

    body: ChatCompletionRequest
    chunk_type = ChatCompletionChunk
    response_type = ChatCompletionResponse

    def __init__(
        self,
        request_id: str,
        model: str,
        body: ChatCompletionRequest,
        tokenizer: Any,
        tools: Callable[[], ToolCallExtractor] | None = None,
    ) -> None:
        """`tools`: makes each choice's tool-call extractor (None: all text is content)."""
        super().__init__(request_id, model, body, tokenizer)
        self._new_extractor = tools
        self._extractors: dict[int, ToolCallExtractor] = {}

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
        logprobs = None
        if self.body.logprobs:
            logprobs = ChatLogprobs(content=self._logprobs(sample, self.body.top_logprobs or 0))
        index = self._index(prompt_index, sample)
        message, finish_reason = DeltaMessage(content=sample.text), sample.finish_reason
        if self._new_extractor is not None:
            message, finish_reason = self._tool_delta(index, sample)
        return ChatChunkChoice(
            index=index, delta=message, logprobs=logprobs, finish_reason=finish_reason
        )

    def _tool_delta(self, index: int, sample: SampleDelta) -> tuple[DeltaMessage, str | None]:
        """A sample's text split into content and tool-call pieces; a choice that called a
        tool and stopped finishes with "tool_calls"."""
        assert self._new_extractor is not None, "only with tools"
        extractor = self._extractors.setdefault(index, self._new_extractor())
        content, calls = extractor.feed(sample.text)
        finish_reason = sample.finish_reason
        if finish_reason is not None:
            rest, more = extractor.finish()
            content, calls = content + rest, calls + more
            if extractor.num_calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        delta = DeltaMessage(
            content=content if content or not calls else None,
            tool_calls=[_delta_tool_call(c) for c in calls] or None,
        )
        return delta, finish_reason

    def _merged(self, parts: list[Any]) -> ChatChoice:
        content = "".join(p.delta.content or "" for p in parts)
        tool_calls = _merged_tool_calls([c for p in parts for c in p.delta.tool_calls or []])
        return ChatChoice(
            index=parts[0].index,
            message=ChatResponseMessage(
                content=None if tool_calls and not content.strip() else content,
                tool_calls=tool_calls or None,
            ),
            finish_reason=parts[-1].finish_reason,
            logprobs=ChatLogprobs(content=[t for p in parts for t in p.logprobs.content])
            if self.body.logprobs
            else None,
        )

    def _logprobs(self, sample: SampleDelta, num_top: int) -> list[ChatTokenLogprob]:
        """Each token's logprob object, with the `num_top` most likely tokens."""

        def entry(cls: type[Any], token_id: int, logprob: float | None, **extra: Any) -> Any:
            text = token_text(self.tokenizer, token_id)
            return cls(token=text, logprob=_finite(logprob), bytes=list(text.encode()), **extra)

        return [
            entry(
                ChatTokenLogprob,
                token_id,
                top.get(token_id),
                top_logprobs=[entry(TopLogprob, t, lp) for t, lp in _sorted(top)[:num_top]],
            )
            for token_id, top in zip(sample.token_ids, sample.logprobs or [], strict=False)
        ]


def _delta_tool_call(call: ToolCallDelta) -> DeltaToolCall:
    """OpenAI's shape: the first piece of a call has its id, type and name."""
    return DeltaToolCall(
        index=call.index,
        id=call.id,
        type="function" if call.id is not None else None,
        function=DeltaFunctionCall(name=call.name, arguments=call.arguments),
    )


def _merged_tool_calls(pieces: list[DeltaToolCall]) -> list[ToolCall]:
    """Streamed tool-call pieces joined per call index (arguments concatenated)."""
    calls: dict[int, ToolCall] = {}
    for piece in pieces:
        call = calls.get(piece.index)
        if call is None:
            name = piece.function.name or ""
            call = calls[piece.index] = ToolCall(
                id=piece.id or "", function=FunctionCall(name=name, arguments="")
            )
        call.function.arguments += piece.function.arguments or ""
    return [calls[i] for i in sorted(calls)]


def token_text(tokenizer: Any, token_id: int) -> str:
    """The text of one token (``token_id:N`` when the model has no tokenizer)."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _sorted(top: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(top.items(), key=lambda kv: -kv[1])


def _finite(value: float | None) -> float:
    # JSON has no -inf; OpenAI clients expect a number, so clamp like vLLM does.
    return -9999.0 if value is None else max(float(value), -9999.0)
