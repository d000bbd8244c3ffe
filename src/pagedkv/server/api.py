"""The OpenAI-compatible HTTP server (FastAPI): completions, chat, models, tokenizer, health,
metrics.

Every error, including FastAPI's own validation errors and invalid JSON, is answered with
OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for bad input (the
message names the field, the expected and the given value, never the whole request), 404
for another model's name, 503 with `Retry-After` when the waiting queue is full or the
server is shutting down, 500 for a server fault; 401 for a missing or wrong API key
(`pagedkv.server.auth`) and 413 for a body over the size limit (`pagedkv.server.limits`),
both before the body is read. Every refusal is counted by reason in
`pagedkv_rejected_requests_total` (401s in `pagedkv_auth_failures_total`). Streams are
server-sent events that end with ``data: [DONE]``; a client that disconnects has its
requests aborted at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedkv.server.async_engine import AsyncEngine, EngineDead
from pagedkv.server.auth import AccessMiddleware, AccessPolicy, request_salt
from pagedkv.server.limits import BodyLimitMiddleware, RequestLimits
from pagedkv.server.metrics import CONTENT_TYPE, ServerMetrics
from pagedkv.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    random_id,
    short,
)
from pagedkv.server.responses import ChatBuilder, CompletionBuilder
from pagedkv.server.serving import (
    APIError,
    ServerState,
    admit,
    check_context,
    check_limits,
    check_model,
    make_sampling_params,
    merge,
    param_of,
    render_chat,
    require_tokenizer,
    run_to_end,
    track,
)
from pagedkv.server.structured import constrain, request_constraint, tool_constraint
from pagedkv.server.tokenization import add_tokenize_routes

logger = logging.getLogger("pagedkv.server")

# Seconds a client should wait before retrying a 503 (the queue drains within steps).
RETRY_AFTER_S = 1
_ERROR = {"model": ErrorResponse}
_ERRORS: dict[int | str, Any] = {
    400: {
        **_ERROR,
        "description": "Bad request: the message names the field, the expected and the "
        "given value. Unknown and unsupported fields are refused, not ignored.",
    },
    404: {**_ERROR, "description": "Another model's name (code `model_not_found`)."},
    503: {
        **_ERROR,
        "description": "Overloaded, or shutting down; retry after `Retry-After` seconds.",
        "headers": {"Retry-After": {"schema": {"type": "integer"}}},
    },
}
# The completion routes' answers: a JSON body, or server-sent events.
_GENERATE_RESPONSES = {
    200: {
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
        "description": "JSON, or SSE with stream: true.",
    }
} | _ERRORS


@dataclass(frozen=True)
class CorsOptions:
    """Cross-origin requests from browsers (Starlette's `CORSMiddleware`), off unless
    `allowed_origins` names some."""

    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("GET", "POST")
    allowed_headers: tuple[str, ...] = ("Authorization", "Content-Type")


def create_app(
    engine: AsyncEngine,
    *,
    model_name: str,
    access: AccessPolicy | None = None,
    limits: RequestLimits | None = None,
    cors: CorsOptions | None = None,
    tool_call_parser: str | None = None,
) -> FastAPI:
    """Build the server app around a (not necessarily started) `AsyncEngine`.

    The engine starts and stops with the app; `model_name` is the name `/v1/models` lists
    and requests must use (or omit); `tool_call_parser` reads tool calls for
    `tool_choice: "auto"` (`tool_parsers.TOOL_CALL_PARSERS`). `access` (default: no keys),
    `limits` (default: `RequestLimits()`) and `cors` (default: none) guard every request
    before any work. Serve the app with uvicorn, or `launch.serve` for a bounded shutdown.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="pagedkv", version="0.1.0", lifespan=lifespan)
    max_model_len = engine.engine.max_model_len
    access, limits = access or AccessPolicy(), limits or RequestLimits()
    metrics = ServerMetrics(engine.stats)
    app.state.server = ServerState(
        engine, metrics, model_name, max_model_len, access, limits, tool_call_parser
    )
    # The last added runs first: CORS answers preflights, then keys, then the body's size.
    app.add_middleware(
        BodyLimitMiddleware, max_bytes=limits.max_request_body_bytes, metrics=metrics
    )
    app.add_middleware(AccessMiddleware, policy=access, metrics=metrics)
    if cors is not None and cors.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors.allowed_origins),
            allow_methods=list(cors.allowed_methods),
            allow_headers=list(cors.allowed_headers),
        )
    _add_error_handlers(app)
    _add_routes(app)
    add_tokenize_routes(app, _ERRORS)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema without its 422s: validation errors are answered as 400s here."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


def _error_response(error: APIError) -> JSONResponse:
    """OpenAI's error body for `error`, with `Retry-After` on a 503."""
    info = ErrorInfo(message=error.message, type=error.type, param=error.param, code=error.code)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if error.status == 503 else None
    body = ErrorResponse(error=info).model_dump()
    return JSONResponse(body, status_code=error.status, headers=headers)


def _reject(request: Request, reason: str) -> None:
    request.app.state.server.metrics.rejected.labels(reason).inc()


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        if exc.reason:
            _reject(request, exc.reason)
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422; OpenAI's clients expect 400 with a message.
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid" or (first.get("type") == "missing" and not loc):
            _reject(request, "invalid_json")
            detail = first.get("ctx", {}).get("error", first.get("msg", "no body"))
            return _error_response(APIError(f"invalid JSON body: {detail}"))
        _reject(request, "schema")
        message = "; ".join(_describe(e) for e in errors[:3])
        return _error_response(APIError(message, param=".".join(loc) or param_of(message)))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        response = _error_response(APIError(str(exc.detail), status=exc.status_code, type=kind))
        response.headers.update(exc.headers or {})  # e.g. a 405's Allow
        return response

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        error = APIError(f"internal server error: {exc}", status=500, type="server_error")
        return _error_response(error)


def _describe(error: dict[str, Any]) -> str:
    """One pydantic error as "field: expected ..., got ..." (the value only in short)."""
    loc = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
    kind = error.get("type", "")
    if kind == "extra_forbidden":
        return f"{loc}: not a supported field (unknown fields are refused, not ignored)"
    if kind == "missing":
        return f"{loc}: expected a value, got none (the field is required)"
    if kind == "value_error":
        # Our validators' messages already name the expected and the given value.
        text = str(error.get("ctx", {}).get("error", error.get("msg", "invalid")))
        return text if not loc or text.startswith(loc.split(".")[0]) else f"{loc}: {text}"
    expected = str(error.get("msg", "invalid")).replace("Input should be", "expected")
    return f"{loc or 'body'}: {expected}, got {short(error.get('input'))}"


def _add_routes(app: FastAPI) -> None:
    @app.get("/health", responses={503: _ERRORS[503]})
    async def health(request: Request) -> Response:
        state: ServerState = request.app.state.server
        if not state.engine.is_running:
            failure = state.engine.error
            reason = f"the engine failed: {failure}" if failure is not None else "shutting down"
            message = f"the engine is not running: {reason}"
            return _error_response(APIError(message, status=503, type="server_error"))
        return JSONResponse({"status": "ok"})

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={200: {"description": "Prometheus text format.", "content": {"text/plain": {}}}},
    )
    async def metrics(request: Request) -> Response:
        return Response(request.app.state.server.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> ModelList:
        return ModelList(data=[_card(request.app.state.server)])

    @app.get("/v1/models/{model_id}", responses={404: _ERRORS[404]})
    async def model(model_id: str, request: Request) -> ModelCard:
        state: ServerState = request.app.state.server
        check_model(state, model_id)
        return _card(state)

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_GENERATE_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        state: ServerState = request.app.state.server
        check_model(state, body.model)
        check_limits(
            state.limits,
            num_prompts=_num_prompts(body.prompt),
            n=body.n,
            logprobs=body.logprobs,
            stop=body.stop,
        )
        prompts = _completion_prompts(state, body)
        # max_tokens 0 with echo: generate one token and drop it, as vLLM does.
        max_tokens = max(body.max_tokens, 1)
        for prompt in prompts:
            check_context(state.max_model_len, len(prompt["prompt_token_ids"]), max_tokens)
        prompt_logprobs = body.logprobs if body.echo else None
        salt = request_salt(state.access, request, body.cache_salt)
        constraint = await constrain(state, request_constraint(body))
        params = make_sampling_params(
            body, max_tokens, body.logprobs, prompt_logprobs, constraint, salt
        )
        builder = CompletionBuilder(
            random_id("cmpl"), state.model_name, body, state.engine.tokenizer
        )
        return await _serve(request, builder, prompts, params)

    @app.post(
        "/v1/chat/completions", response_model=ChatCompletionResponse, responses=_GENERATE_RESPONSES
    )
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        state: ServerState = request.app.state.server
        check_model(state, body.model)
        check_limits(
            state.limits,
            num_prompts=1,
            n=body.n,
            logprobs=body.top_logprobs,
            stop=body.stop,
            logprobs_param="top_logprobs",
        )
        tokenizer = require_tokenizer(state, "messages")
        tool_choice, tools = tool_constraint(body, state.tool_call_parser, tokenizer.chat_template)
        prompt = render_chat(state, body.messages, True, body.tools)
        num_prompt_tokens = len(prompt["prompt_token_ids"])
        room = max(1, state.max_model_len - num_prompt_tokens)
        max_tokens = body.max_completion_tokens or body.max_tokens or room
        check_context(state.max_model_len, num_prompt_tokens, max_tokens)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        salt = request_salt(state.access, request, body.cache_salt)
        constraint = await constrain(state, tool_choice + request_constraint(body))
        params = make_sampling_params(body, max_tokens, logprobs, None, constraint, salt)
        builder = ChatBuilder(
            random_id("chatcmpl"), state.model_name, body, state.engine.tokenizer, tools
        )
        return await _serve(request, builder, [prompt], params)


def _card(state: ServerState) -> ModelCard:
    return ModelCard(id=state.model_name, root=state.model_name, max_model_len=state.max_model_len)


def _num_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> int:
    """Prompts in a completions request: one text or token-id list, else the batch's length."""
    if isinstance(prompt, str) or all(isinstance(t, int) for t in prompt):
        return 1
    return len(prompt)


def _completion_prompts(state: ServerState, body: CompletionRequest) -> list[dict[str, Any]]:
    """Each prompt of the batch as {"prompt_token_ids", and "prompt" for text}: text prompts
    are tokenized here so their length is checked before admission (the engine keeps the text)."""
    batch: Any = body.prompt
    if isinstance(batch, str) or all(isinstance(t, int) for t in batch):
        batch = [batch]  # one prompt
    return [
        {"prompt": p, "prompt_token_ids": require_tokenizer(state, "prompt").encode(p)}
        if isinstance(p, str)
        else {"prompt_token_ids": p}
        for p in batch
    ]


async def _serve(request: Request, builder: Any, prompts: list[Any], params: Any) -> Response:
    """Admit the prompts; stream the builder's chunks or answer with its whole response."""
    arrival = time.monotonic()
    state: ServerState = request.app.state.server
    streams = await admit(state, builder.request_id, prompts, params)
    deltas = merge([track(state, s, arrival) for s in streams])
    if builder.body.stream:
        return StreamingResponse(
            _sse(builder, deltas),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    try:
        if not await run_to_end(request, deltas, builder.add):
            return Response(status_code=499)  # client closed the connection; nobody reads this
    except EngineDead as exc:  # aborted by a shutdown after admission: not a rejection
        raise APIError(str(exc), status=503, type="server_error", reason="") from None
    finally:
        for s in streams:
            s.abort()  # no-op for finished requests; covers a consumer cancelled before start
    return JSONResponse(builder.response().model_dump())


async def _sse(builder: Any, deltas: AsyncIterator[tuple[int, Any]]) -> AsyncIterator[str]:
    try:
        for chunk in builder.first_chunks():
            yield f"data: {chunk.model_dump_json()}\n\n"
        async for i, delta in deltas:
            for chunk in builder.chunks(i, delta):
                yield f"data: {chunk.model_dump_json()}\n\n"
        usage = builder.usage_chunk()
        if usage is not None:
            yield f"data: {usage.model_dump_json()}\n\n"
    except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band
        if not isinstance(exc, EngineDead):
            logger.exception("stream %s failed", builder.request_id)
        body = ErrorResponse(error=ErrorInfo(message=str(exc), type="server_error"))
        yield f"data: {body.model_dump_json()}\n\n"
    finally:
        await deltas.aclose()  # type: ignore[attr-defined]
    yield "data: [DONE]\n\n"
