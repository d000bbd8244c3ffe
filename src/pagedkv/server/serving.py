"""What the routes of `api.py` share: request checks, admitting a batch of prompts to the
`AsyncEngine`, and following their streams (latency metrics, one INFO log line each)."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any

from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.structured import StructuredOutputsParams
from pagedkv.server.async_engine import AsyncEngine, RequestStream
from pagedkv.server.auth import AccessPolicy
from pagedkv.server.limits import RequestLimits
from pagedkv.server.metrics import ServerMetrics
from pagedkv.server.protocol import SamplingRequest, short
from pagedkv.server.streaming import RequestDelta

logger = logging.getLogger("pagedkv.server")


@dataclass(eq=False)
class APIError(Exception):
    """An error answered with OpenAI's body shape and an HTTP status.

    `reason` is the `reason` label it counts under in `pagedkv_rejected_requests_total`
    (one of `metrics.REJECT_REASONS`).
    """

    message: str
    _: KW_ONLY
    status: int = 400
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    reason: str = "invalid_request"

    def __post_init__(self) -> None:
        super().__init__(self.message)


@dataclass
class ServerState:
    """What every route needs: the engine, the metrics, the served model's name, and the
    access policy and limits (`pagedkv.server.auth`, `pagedkv.server.limits`)."""

    engine: AsyncEngine
    metrics: ServerMetrics
    model_name: str
    max_model_len: int
    access: AccessPolicy
    limits: RequestLimits
    tool_call_parser: str | None = None  # `tool_parsers.TOOL_CALL_PARSERS`, for "auto"


def check_model(state: ServerState, model: str | None) -> None:
    """404 (`model_not_found`) unless `model` is None or the served model's name."""
    if model is not None and model != state.model_name:
        raise APIError(
            f"model: expected {state.model_name!r} (the served model), got {short(model)}",
            status=404,
            param="model",
            code="model_not_found",
            reason="model_not_found",
        )


def require_tokenizer(state: ServerState, param: str) -> Any:
    """The engine's tokenizer, or a 400 naming `param` when the model directory has none."""
    tokenizer = state.engine.tokenizer
    if tokenizer is None:
        raise APIError(
            f"{param}: expected token ids (the model directory has no tokenizer), got text",
            param=param,
        )
    return tokenizer


def render_chat(
    state: ServerState,
    messages: list[Any],
    add_generation_prompt: bool,
    tools: list[Any] | None = None,
) -> dict[str, Any]:
    """Pydantic `ChatMessage`s (and `ChatTool`s, passed to the template as `tools`) as an
    engine prompt, `Tokenizer.chat_prompt` (or a 400)."""
    tokenizer = require_tokenizer(state, "messages")
    tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    try:
        plain = [_plain_message(m) for m in messages]
        return tokenizer.chat_prompt(plain, add_generation_prompt, tool_dicts)
    except ValueError as exc:
        raise APIError(f"messages: {exc}", param="messages") from None


def _plain_message(message: Any) -> dict[str, Any]:
    """A `ChatMessage` as the template sees it: text content, and the tool fields set."""
    plain: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.tool_calls:
        plain["tool_calls"] = [c.model_dump() for c in message.tool_calls]
    if message.tool_call_id is not None:
        plain["tool_call_id"] = message.tool_call_id
    return plain


def param_of(message: str, default: str | None = None) -> str | None:
    """The field an engine error message names first ("top_k: expected ..." -> "top_k")."""
    match = re.match(r"([a-z_]+)(?::|\[)", message)
    return match.group(1) if match else default


def check_context(max_model_len: int, num_prompt: int, max_tokens: int) -> None:
    """A 400 naming both numbers (reason "context_length") unless the prompt and `max_tokens`
    new tokens fit the model's context."""
    if num_prompt + max_tokens <= max_model_len:
        return
    raise APIError(
        f"this model's maximum context length is {max_model_len} tokens: expected prompt "
        f"tokens + max_tokens <= {max_model_len}, got {num_prompt} prompt tokens + "
        f"max_tokens {max_tokens} = {num_prompt + max_tokens}",
        param="max_tokens" if num_prompt < max_model_len else "prompt",
        code="context_length_exceeded",
        reason="context_length",
    )


def _over(name: str, limit: int, given: int, param: str) -> APIError:
    return APIError(
        f"{param}: expected at most {limit} ({name.replace('_', '-')}), got {given}",
        param=param,
        code="limit_exceeded",
        reason="limit",
    )


def check_limits(
    limits: RequestLimits,
    *,
    num_prompts: int,
    n: int,
    logprobs: int | None,
    stop: str | list[str] | None,
    logprobs_param: str = "logprobs",
) -> None:
    """Raise the 400 `APIError` of the first limit the request passes, if any."""
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    checks = (
        ("max_prompts_per_request", num_prompts, "prompt"),
        ("max_n", n, "n"),
        ("max_logprobs", logprobs or 0, logprobs_param),
        ("max_stop_strings", len(stops), "stop"),
        ("max_stop_string_length", max(map(len, stops), default=0), "stop"),
    )
    for name, given, param in checks:
        limit = getattr(limits, name)
        if given > limit:
            raise _over(name, limit, given, param)


def make_sampling_params(
    body: SamplingRequest,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
    cache_salt: str | None = None,
) -> SamplingParams:
    """`SamplingParams` from a request body (ValueError from its validation becomes a 400);
    `cache_salt` is the request's effective salt (`auth.request_salt`)."""
    try:
        return SamplingParams(
            n=body.n,
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            seed=body.seed,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias={int(t): v for t, v in body.logit_bias.items()} if body.logit_bias else None,
            structured_outputs=structured_outputs,
            cache_salt=cache_salt,
        )
    except ValueError as exc:
        raise APIError(str(exc), param=param_of(str(exc)), reason="schema") from None


async def admit(
    state: ServerState, request_id: str, prompts: Sequence[dict[str, Any]], params: SamplingParams
) -> list[RequestStream]:
    """Add every prompt to the engine (ids `request_id-i`), all or none.

    Raises:
        APIError: 400 for a request the engine rejects, 503 when overloaded or stopped.
    """
    from pagedkv.server.async_engine import EngineDead, EngineOverloaded, EngineShuttingDown

    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(prompts):
            sub_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            streams.append(await state.engine.add_request(sub_id, prompt, params))
    except BaseException as exc:
        for stream in streams:
            stream.abort()
        if isinstance(exc, EngineOverloaded):
            raise APIError(
                str(exc),
                status=503,
                type="server_overloaded",
                code="too_many_requests",
                reason="overloaded",
            ) from None
        if isinstance(exc, EngineDead):
            code = "server_shutting_down" if isinstance(exc, EngineShuttingDown) else None
            raise APIError(
                str(exc), status=503, type="server_error", code=code, reason="unavailable"
            ) from None
        if isinstance(exc, ValueError):
            raise APIError(str(exc), param=param_of(str(exc), "prompt")) from None
        raise
    return streams


async def track(
    state: ServerState, stream: RequestStream, arrival: float
) -> AsyncIterator[RequestDelta]:
    """Yield a request's deltas, recording its latency metrics and one log line at the end."""
    metrics = state.metrics
    first_time: float | None = None
    last_time = arrival
    num_prompt = num_generated = 0
    reason = "abort"
    try:
        async for delta in stream:
            now = time.monotonic()
            num_prompt = len(delta.prompt_token_ids)
            new_tokens = [len(s.token_ids) for s in delta.samples]
            if sum(new_tokens):
                if first_time is None:
                    first_time = now
                    metrics.time_to_first_token.observe(now - arrival)
                else:
                    metrics.inter_token_latency.observe((now - last_time) / max(new_tokens))
                last_time = now
                num_generated += sum(new_tokens)
                metrics.generation_tokens.inc(sum(new_tokens))
            for sample in delta.samples:
                if sample.index == 0 and sample.finish_reason is not None:
                    reason = sample.finish_reason
            yield delta
    except Exception:
        reason = "error"
        raise
    finally:
        stream.abort()  # no-op once finished; otherwise the client left or an error struck
        end = time.monotonic()
        metrics.requests.labels(reason).inc()
        metrics.prompt_tokens.inc(num_prompt)
        metrics.request_latency.observe(end - arrival)
        ttft = f"{first_time - arrival:.3f}s" if first_time is not None else "-"
        logger.info(
            "%s: %d prompt tokens, %d generated, finish=%s, ttft=%s, total=%.3fs",
            stream.request_id,
            num_prompt,
            num_generated,
            reason,
            ttft,
            end - arrival,
        )


_DONE = object()


async def merge(
    streams: list[AsyncIterator[RequestDelta]],
) -> AsyncIterator[tuple[int, RequestDelta]]:
    """Interleave several requests' deltas as they come: yields (prompt index, delta).

    Stopping early (or an error in one) cancels the rest, whose streams then abort.
    """
    if len(streams) == 1:
        try:
            async for delta in streams[0]:
                yield 0, delta
        finally:
            # Leaving `async for` early does not close the inner generator: do it now, so
            # the request is aborted before this returns rather than at garbage collection.
            await streams[0].aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, it: AsyncIterator[RequestDelta]) -> None:
        try:
            async for delta in it:
                queue.put_nowait((i, delta))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait((i, _DONE))

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


async def run_to_end(
    request: Any, deltas: AsyncIterator[tuple[int, RequestDelta]], on_delta: Any
) -> bool:
    """Feed every delta to `on_delta` until all finish; False if the client went away first.

    A non-streaming handler is not cancelled by Starlette when its client disconnects, so
    a second task waits on the ASGI `receive()` for `http.disconnect` (the request body is
    already read, so that is the only message left) while the engine works; whichever ends
    first cancels the other, and a cancelled consumer aborts its requests.
    """

    async def consume() -> None:
        async for i, delta in deltas:
            on_delta(i, delta)

    async def wait_for_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            await asyncio.sleep(0.1)  # a server that repeats body messages must not spin

    task = asyncio.create_task(consume())
    watcher = asyncio.create_task(wait_for_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        return False
    task.result()  # re-raises the consumer's error
    return True
