"""How much one request may ask, checked before any work: the body's size (in an ASGI
middleware, before the body is read) and the counts a body may carry (before tokenizing).

A body over `max_request_body_bytes` is a 413: at once when its ``Content-Length`` says
so, else as soon as the bytes received pass the limit (a chunked body is never kept whole).
Before answering, the rest of the body is read and dropped for up to `DRAIN_SECONDS`, as
web servers linger on close: most clients send the whole body before they read an answer,
and closing a socket that still holds unread bytes resets the connection, which discards
the 413 already sent on the client's side. A client that sent ``Expect: 100-continue``
waits for the answer before it sends the body: it is answered at once.
Any other limit is a 400 that names the field, the limit and the given value. Both are
counted in `pagedkv_rejected_requests_total` (reasons ``payload_too_large`` and ``limit``).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the CLI builds its flags from this module without loading the server
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from pagedkv.server.metrics import ServerMetrics


DRAIN_SECONDS = 5.0
"""How long a refused request's remaining body is read and dropped before the 413."""


def _limit(default: int, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class RequestLimits:
    """The largest request the server takes; each field is a `pagedkv serve` flag.

    Raises:
        ValueError: a limit that is not a positive int.
    """

    max_request_body_bytes: int = _limit(
        4 << 20, "bytes of a request body; a larger one is refused (413) before it is read"
    )
    max_prompts_per_request: int = _limit(64, "prompts in one /v1/completions batch")
    max_n: int = _limit(16, "n: completions per prompt")
    max_logprobs: int = _limit(20, "logprobs (completions) and top_logprobs (chat)")
    max_stop_strings: int = _limit(8, "stop strings of one request")
    max_stop_string_length: int = _limit(256, "characters of one stop string")

    def __post_init__(self) -> None:
        for spec in fields(self):
            value = getattr(self, spec.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{spec.name}: expected an int >= 1, got {value!r}")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field (`max_n` -> `--max-n`), its default in the help."""
        group = parser.add_argument_group(
            "request limits (over one: 413 for the body, else 400 naming the limit)"
        )
        for spec in fields(cls):
            group.add_argument(
                f"--{spec.name.replace('_', '-')}",
                type=int,
                default=spec.default,
                metavar="N",
                help=f"{spec.metadata['help']} (default: {spec.default})",
            )

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> RequestLimits:
        return cls(**{spec.name: getattr(namespace, spec.name) for spec in fields(cls)})


class BodyLimitMiddleware:
    """ASGI middleware: a 413 for a body over `max_bytes` (see the module)."""

    def __init__(self, app: ASGIApp, max_bytes: int, metrics: ServerMetrics) -> None:
        self.app, self.max_bytes, self.metrics = app, max_bytes, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            waits = headers.get(b"expect", b"").lower() == b"100-continue"
            await self._refuse(scope, receive, send, length.decode("latin-1"), body_left=not waits)
            return
        received = 0
        too_large = False
        body_left = True

        async def limited_receive() -> Message:
            # Past the limit the app sees a disconnect: it stops reading and its answer is
            # dropped in favour of the 413.
            nonlocal received, too_large, body_left
            if too_large:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                body_left = message.get("more_body", False)
                received += len(message.get("body", b""))
                too_large = received > self.max_bytes
                if too_large:
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not too_large:
                await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not too_large:
                raise
        if too_large:
            given = f"more than {self.max_bytes}"
            await self._refuse(scope, receive, send, given, body_left=body_left)

    async def _refuse(
        self, scope: Scope, receive: Receive, send: Send, given: str, *, body_left: bool
    ) -> None:
        from starlette.responses import JSONResponse

        from pagedkv.server.protocol import ErrorInfo, ErrorResponse

        self.metrics.rejected.labels("payload_too_large").inc()
        info = ErrorInfo(
            message=f"request body: expected at most {self.max_bytes} bytes "
            f"(max-request-body-bytes), got {given}",
            type="invalid_request_error",
            code="request_too_large",
        )
        response = JSONResponse(ErrorResponse(error=info).model_dump(), status_code=413)
        response.headers["Connection"] = "close"
        if body_left:
            await _drain(receive)
        await response(scope, receive, send)


async def _drain(receive: Receive) -> None:
    """Read and drop the request's remaining body, for at most `DRAIN_SECONDS`."""
    deadline = time.monotonic() + DRAIN_SECONDS
    while (left := deadline - time.monotonic()) > 0:
        try:
            message = await asyncio.wait_for(receive(), left)
        except asyncio.TimeoutError:
            return
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
