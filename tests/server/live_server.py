"""A real uvicorn server on 127.0.0.1 (free port, own thread) for the server tests."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx

MODEL_NAME = "tiny-llama"


class LiveServer:
    """uvicorn serving `app` in a background thread; `url` is its base address."""

    def __init__(self, app: Any, tls_kwargs: dict[str, Any] | None = None) -> None:
        import uvicorn

        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        scheme = "https" if tls_kwargs else "http"
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app,
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=2,
            **(tls_kwargs or {}),
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def __enter__(self) -> LiveServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._sock.close()

    def metrics(self, headers: dict[str, str] | None = None) -> dict[str, float]:
        """`/metrics` parsed into {sample name with labels: value}."""
        response = httpx.get(f"{self.url}/metrics", headers=headers, timeout=10)
        response.raise_for_status()
        text = response.text
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    def wait_all_blocks_free(
        self, timeout: float = 10.0, headers: dict[str, str] | None = None
    ) -> dict[str, float]:
        """Poll /metrics until no block is used and no request runs or waits."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics(headers)
            idle = (
                m["pagedkv_kv_blocks_used"] == 0
                and m["pagedkv_num_requests_running"] == 0
                and m["pagedkv_num_requests_waiting"] == 0
            )
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.05)


def start_server(
    model_dir: Path,
    *,
    max_waiting_requests: int | None = None,
    tool_call_parser: str | None = None,
    app_kwargs: dict[str, Any] | None = None,
    tls_kwargs: dict[str, Any] | None = None,
    **engine_kwargs: Any,
) -> LiveServer:
    """A live server on a new engine; `app_kwargs` go to `create_app` (access, limits,
    cors), `tls_kwargs` to uvicorn (``ssl_keyfile``, ...)."""
    from pagedkv.engine.engine import LLMEngine
    from pagedkv.server.api import create_app
    from pagedkv.server.async_engine import AsyncEngine

    kwargs = dict(dtype="float32", device="cpu", block_size=4, num_blocks=128, seed=0)
    kwargs.update(engine_kwargs)
    engine = LLMEngine.from_engine_args(str(model_dir), **kwargs)
    app = create_app(
        AsyncEngine(engine, max_waiting_requests),
        model_name=MODEL_NAME,
        tool_call_parser=tool_call_parser,
        **(app_kwargs or {}),
    )
    return LiveServer(app, tls_kwargs)
