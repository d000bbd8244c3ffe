"""Nothing of a request outlives it: after mixed traffic the server holds no per-request state."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from live_server import MODEL_NAME, LiveServer, start_server

from pagedkv.engine.request import Request, Sequence


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path) -> Iterator[LiveServer]:
    with start_server(tiny_model_dir, max_num_seqs=16, max_waiting_requests=64) as server:
        yield server


def _traffic(url: str) -> None:
    """Completions and chat, streamed and not, n = 2, and streams closed after one chunk."""
    completion = {"model": MODEL_NAME, "prompt": "the cache holds", "ignore_eos": True}
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hello there"}]}
    with httpx.Client(timeout=60) as client:
        for i in range(6):
            seeded = {"temperature": 0.8, "seed": i, "n": 2, "max_tokens": 5 + i}
            client.post(f"{url}/v1/completions", json={**completion, **seeded}).raise_for_status()
            client.post(f"{url}/v1/chat/completions", json={**chat, "max_tokens": 3})
            body = {**completion, **seeded, "max_tokens": 200, "stream": True}
            with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        break  # closing mid-stream aborts the request


def test_no_request_state_is_kept_after_requests_leave(live: LiveServer) -> None:
    _traffic(live.url)
    live.wait_all_blocks_free()
    state = live._server.config.app.state.server
    async_engine = state.engine
    engine = async_engine.engine
    deadline = time.monotonic() + 10
    while async_engine._streams and time.monotonic() < deadline:
        time.sleep(0.05)  # the engine thread drops an aborted stream on its next turn
    assert async_engine._streams == {}
    assert engine.scheduler.requests == {}
    assert engine.runner._generators == {}
    assert engine.kv_manager._seqs == {}
    gc.collect()
    alive = [o for o in gc.get_objects() if type(o) in (Request, Sequence)]
    assert alive == [], f"{len(alive)} request objects outlive their requests"
