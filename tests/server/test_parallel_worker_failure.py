"""A tensor-parallel worker that dies takes the server down loudly: the stream in flight
ends with an error naming the rank, /health turns unhealthy and later requests get a 500,
all within 10 s. (Its own module: one tensor-parallel engine per process at a time.)"""

from __future__ import annotations

import json
import threading
import time

import httpx
from live_server import MODEL_NAME, start_server


def test_dead_worker_fails_requests_with_its_rank(tiny_model_dir):
    with start_server(tiny_model_dir, tensor_parallel_size=2) as live:
        url = f"{live.url}/v1/completions"
        body = {"model": MODEL_NAME, "prompt": "hello there", "max_tokens": 4}
        assert httpx.post(url, json=body, timeout=60).status_code == 200
        events: list[str] = []
        stream_body = {**body, "max_tokens": 400, "stream": True, "ignore_eos": True}

        def read_stream() -> None:
            with httpx.stream("POST", url, json=stream_body, timeout=60) as response:
                events.extend(line for line in response.iter_lines() if line)

        reader = threading.Thread(target=read_stream)
        reader.start()
        while len(events) < 3:
            time.sleep(0.01)
        app = live._server.config.app
        app.state.server.engine.engine.runner.workers[0].process.kill()
        killed = time.monotonic()
        reader.join(10)
        assert not reader.is_alive()
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert "tensor-parallel rank 1 failed" in error["message"]
        assert events[-1] == "data: [DONE]"
        while httpx.get(f"{live.url}/health", timeout=5).status_code == 200:
            assert time.monotonic() - killed < 10, "/health still healthy"
            time.sleep(0.1)
        health = httpx.get(f"{live.url}/health", timeout=5)
        assert health.status_code == 503 and "rank 1" in health.text
        response = httpx.post(url, json=body, timeout=10)
        assert response.status_code == 500
        assert "tensor-parallel rank 1 failed" in response.json()["error"]["message"]
        assert time.monotonic() - killed < 10
