"""Serve an app with uvicorn and a bounded shutdown.

On SIGTERM (or a first Ctrl-C) the server stops admitting at once: the listening socket
closes and requests on open connections get 503. Running requests go on for
`shutdown_timeout` seconds; then the engine aborts the rest, each stream ending with an
error event and ``data: [DONE]`` (a non-streaming request gets a 503), and the process
exits with status 0.

    SIGTERM ─▶ handle_exit: engine.begin_shutdown(timeout) ; uvicorn closes the socket
            ─▶ engine thread: steps on ... deadline ─▶ aborts the rest (error events)
            ─▶ connections close ─▶ lifespan shutdown (engine thread joined) ─▶ exit 0
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any

# uvicorn's own wait for connections is only a backstop: the engine aborts at the timeout.
_BACKSTOP_S = 3.0


def serve(
    app: Any,
    *,
    host: str,
    port: int,
    shutdown_timeout: float = 30.0,
    tls_kwargs: dict[str, Any] | None = None,
) -> None:
    """Run `app` (from `create_app`) until SIGTERM or SIGINT, then shut down in bounded time.

    Args:
        app: the FastAPI app; `app.state.server.engine` is its `AsyncEngine`.
        shutdown_timeout: seconds running requests may take after the signal.
        tls_kwargs: uvicorn's ``ssl_*`` keywords (`exposure.TLSOptions.uvicorn_kwargs`).

    Raises:
        ValueError: a negative `shutdown_timeout`.
    """
    import uvicorn

    if not shutdown_timeout >= 0:
        raise ValueError(f"shutdown_timeout: expected >= 0 seconds, got {shutdown_timeout}")
    engine = app.state.server.engine

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            engine.begin_shutdown(shutdown_timeout)  # only assigns: safe in a signal handler
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=int(shutdown_timeout + _BACKSTOP_S),
        **(tls_kwargs or {}),
    )
    # uvicorn re-raises the signal it caught once it is done, under the handler that was
    # installed before it: make that a no-op for SIGTERM, so a drained server exits 0.
    previous = signal.signal(signal.SIGTERM, lambda sig, frame: None)
    try:
        _Server(config).run()
    finally:
        signal.signal(signal.SIGTERM, previous)
