"""The OpenAI-compatible HTTP server (FastAPI): completions, chat, models, health, metrics.

Every error, including FastAPI's own validation errors and invalid JSON, is answered with
OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for bad input, 503
when the waiting queue is full, 500 for a server fault. Streams are server-sent events that
end with ``data: [DONE]``; a client that disconnects has its requests aborted at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedkv.server.async_engine import AsyncEngine
from pagedkv.server.metrics import CONTENT_TYPE, ServerMetrics
from pagedkv.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    random_id,
)
from pagedkv.server.responses import ChatBuilder, CompletionBuilder
from pagedkv.server.serving import (
    APIError,
    ServerState,
    admit,
    make_sampling_params,
    merge,
    run_to_end,
    track,
)

logger = logging.getLogger("pagedkv.server")


def create_app(engine: AsyncEngine, *, model_name: str, shutdown_engine: bool = True) -> FastAPI:
    """Build the server app around a (not necessarily started) `AsyncEngine`.

    Args:
        engine: the engine front; started when the app starts.
        model_name: the name `/v1/models` lists and requests must use (or omit).
        shutdown_engine: stop the engine thread when the app shuts down.

    Returns:
        The FastAPI app; serve it with uvicorn.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        if shutdown_engine:
            engine.shutdown()

    app = FastAPI(title="pagedkv", version="0.1.0", lifespan=lifespan)
    max_model_len = int(engine.model_config.max_position_embeddings)
    app.state.server = ServerState(engine, ServerMetrics(engine.stats), model_name, max_model_len)
    _add_error_handlers(app)
    _add_routes(app)
    return app


def error_response(
    status: int,
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422; OpenAI's clients and the issue expect 400 with a message.
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        if first.get("type") == "json_invalid":
            message = f"invalid JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}"
            param = None
        else:
            message = "; ".join(_describe(e) for e in errors[:5])
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(
            exc.status_code,
            str(exc.detail),
            "not_found_error" if exc.status_code == 404 else "invalid_request_error",
        )

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(500, f"internal server error: {exc}", "server_error")


def _describe(error: dict[str, Any]) -> str:
    loc = ".".join(str(p) for p in error.get("loc", ()) if p != "body") or "body"
    message = f"{loc}: {error.get('msg', 'invalid')}"
    if "input" in error and error.get("type") != "missing":
        message += f", got {error['input']!r:.80}"
    return message


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(
            f"model {model!r} does not exist: expected {state.model_name!r}",
            param="model",
            code="model_not_found",
        )


def _add_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(request: Request) -> Response:
        state: ServerState = request.app.state.server
        if not state.engine.is_running:
            return error_response(503, "the engine is not running", "server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(request.app.state.server.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> ModelList:
        state: ServerState = request.app.state.server
        card = ModelCard(
            id=state.model_name, root=state.model_name, max_model_len=state.max_model_len
        )
        return ModelList(data=[card])

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        state: ServerState = request.app.state.server
        _check_model(state, body.model)
        params = make_sampling_params(body, body.max_tokens, body.logprobs)
        builder = CompletionBuilder(
            random_id("cmpl"), state.model_name, body, state.engine.tokenizer
        )
        return await _serve(request, state, builder, body.prompts(), params, body.stream)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        state: ServerState = request.app.state.server
        _check_model(state, body.model)
        prompt_ids = _render_chat(state, body)
        max_tokens = body.requested_max_tokens() or max(1, state.max_model_len - len(prompt_ids))
        params = make_sampling_params(body, max_tokens, body.num_logprobs())
        builder = ChatBuilder(random_id("chatcmpl"), state.model_name, body, state.engine.tokenizer)
        return await _serve(request, state, builder, [prompt_ids], params, body.stream)


def _render_chat(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    tokenizer = state.engine.tokenizer
    if tokenizer is None:
        raise APIError(
            "chat needs a tokenizer: the model directory has none; "
            "use /v1/completions with token ids",
            param="messages",
        )
    try:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except ValueError as exc:
        raise APIError(str(exc), param="messages") from None
    # The template already spells out special tokens such as BOS.
    return tokenizer.encode(text, add_special_tokens=False)


async def _serve(
    request: Request,
    state: ServerState,
    builder: Any,
    prompts: list[Any],
    params: Any,
    stream: bool,
) -> Response:
    arrival = time.monotonic()
    streams = await admit(state, builder.request_id, prompts, params)
    deltas = merge([track(state, s, arrival) for s in streams])
    if stream:
        return StreamingResponse(
            _sse(builder, deltas),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    try:
        if not await run_to_end(request, deltas, builder.add):
            return Response(status_code=499)  # client closed the connection; nobody reads this
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
        logger.exception("stream %s failed", builder.request_id)
        body = ErrorResponse(error=ErrorInfo(message=str(exc), type="server_error"))
        yield f"data: {body.model_dump_json()}\n\n"
    finally:
        await deltas.aclose()  # type: ignore[attr-defined]
    yield "data: [DONE]\n\n"
