"""A bounded shutdown: SIGTERM to `pagedkv serve` with streams in flight."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from helpers import make_hf_model, make_tokenizer

SHUTDOWN_TIMEOUT = 2.0
LONG = 12_000
"""New tokens of a request that cannot finish before the deadline on any CPU (a tiny model
decodes a few hundred tokens a second per sequence)."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_healthy(url: str, process: subprocess.Popen[bytes], timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("server did not become healthy")


def _stream(url: str, max_tokens: int, events: list[dict], started: threading.Event) -> None:
    body = {"prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    buffer = b""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        # Split on b"\n" only, as SSE does (str.splitlines would also split on U+2028).
        for part in response.iter_bytes():
            buffer += part
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if line.startswith(b"data: "):
                    data = line[len(b"data: ") :]
                    events.append({"done": True} if data == b"[DONE]" else json.loads(data))
                    started.set()


@pytest.mark.slow
def test_sigterm_drains_then_aborts_and_exits_zero(tmp_path):
    model_dir = make_hf_model(tmp_path, "llama", max_position_embeddings=2 * LONG)
    make_tokenizer(model_dir)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    command = [
        sys.executable,
        "-m",
        "pagedkv.cli",
        "serve",
        "--model",
        str(model_dir),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--block-size",
        "4",
        "--num-blocks",
        str(3 * LONG // 4 + 64),
        "--port",
        str(port),
        "--shutdown-timeout",
        str(SHUTDOWN_TIMEOUT),
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_healthy(url, process)
        streams = []
        for max_tokens in (LONG, LONG, LONG, 2):
            events: list[dict] = []
            started = threading.Event()
            thread = threading.Thread(target=_stream, args=(url, max_tokens, events, started))
            thread.start()
            streams.append((thread, events, started))
        for _, _, started in streams:
            assert started.wait(60), "every stream sends a first chunk"
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.HTTPError):  # no longer admitting: the socket is closed
            httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=5).raise_for_status()
        returncode = process.wait(timeout=SHUTDOWN_TIMEOUT + 30)
        elapsed = time.monotonic() - sent
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert returncode == 0, process.stderr.read().decode()[-2000:] if process.stderr else ""
    assert elapsed <= SHUTDOWN_TIMEOUT + 5, elapsed
    endings = []
    for thread, events, _ in streams:
        thread.join(10)
        assert events[-1] == {"done": True}, events[-3:]
        last = events[-2]
        if "error" in last:
            assert "shut down" in last["error"]["message"]
            endings.append("error")
        else:
            assert last["choices"][0]["finish_reason"] == "length", last
            endings.append("length")
    assert endings[3] == "length"  # the short request finished before the deadline
    assert "error" in endings[:3], endings  # a long one was aborted at the deadline
