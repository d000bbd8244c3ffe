"""Request limits: 413 for a body over the size limit (read or not), 400 naming any other."""

from __future__ import annotations

import argparse
import socket
import time

import httpx
import pytest
from live_server import MODEL_NAME, start_server

from pagedkv.server import exposure
from pagedkv.server.limits import RequestLimits

BIG = 10 * 1024 * 1024
LIMITS = RequestLimits(
    max_prompts_per_request=3, max_n=2, max_logprobs=3, max_stop_strings=2, max_stop_string_length=8
)


@pytest.fixture(scope="module")
def limited(tiny_model_dir):
    with start_server(tiny_model_dir, app_kwargs={"limits": LIMITS}) as live:
        yield live


def _healthy(url: str) -> None:
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200


def _head(length: int, extra: str = "") -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            f"application/json\r\nContent-Length: {length}\r\n{extra}\r\n").encode()  # fmt: skip


def _padded_body() -> bytes:
    return b'{"prompt": "' + b"a" * BIG + b'", "max_tokens": 1}'


def test_a_10mb_body_is_413_within_a_second(limited) -> None:
    before = limited.metrics()['pagedkv_rejected_requests_total{reason="payload_too_large"}']
    started = time.monotonic()
    response = httpx.post(
        f"{limited.url}/v1/completions",
        content=_padded_body(),
        headers={"Content-Type": "application/json"},
        timeout=10,
    )
    assert time.monotonic() - started < 1.0
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["code"] == "request_too_large"
    assert str(RequestLimits().max_request_body_bytes) in error["message"]
    after = limited.metrics()['pagedkv_rejected_requests_total{reason="payload_too_large"}']
    assert after == before + 1
    _healthy(limited.url)


def test_a_client_that_sends_the_whole_body_first_still_reads_the_413(limited) -> None:
    # The answer comes as soon as the length is seen; a client that pauses, then sends the
    # rest before reading (as most do) must not meet a reset that discards the answer.
    body = _padded_body()
    with socket.create_connection(("127.0.0.1", limited.port), timeout=10) as sock:
        sock.sendall(_head(len(body)) + body[: 1 << 20])
        time.sleep(0.5)
        sock.sendall(body[1 << 20 :])
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"request_too_large" in answer


def test_a_client_that_waits_for_100_continue_gets_the_413_without_sending(limited) -> None:
    with socket.create_connection(("127.0.0.1", limited.port), timeout=10) as sock:
        started = time.monotonic()
        sock.sendall(_head(BIG, "Expect: 100-continue\r\n"))
        answer = sock.recv(65536)
    assert time.monotonic() - started < 1.0
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


def test_a_chunked_body_is_cut_off_at_the_limit(limited) -> None:
    sent = 0

    def chunks():
        nonlocal sent
        yield b'{"prompt": "'
        for _ in range(BIG // 65536):
            sent += 65536
            yield b"a" * 65536
        yield b'"}'

    started = time.monotonic()
    response = httpx.post(f"{limited.url}/v1/completions", content=chunks(), timeout=10)
    assert response.status_code == 413
    assert "max-request-body-bytes" in response.json()["error"]["message"]
    assert "content-length" not in response.request.headers
    assert time.monotonic() - started < 5.0
    assert sent >= RequestLimits().max_request_body_bytes  # no Content-Length: cut by counting
    _healthy(limited.url)


@pytest.mark.parametrize(
    ("route", "extra", "param", "name", "limit", "given"),
    [
        ("cmpl", {"prompt": ["a", "b", "c", "d"]}, "prompt", "max-prompts-per-request", 3, 4),
        ("cmpl", {"prompt": [[5], [6], [7], [8], [9]]}, "prompt", "max-prompts-per-request", 3, 5),
        ("cmpl", {"prompt": "a", "n": 3}, "n", "max-n", 2, 3),
        ("cmpl", {"prompt": "a", "logprobs": 4}, "logprobs", "max-logprobs", 3, 4),
        ("cmpl", {"prompt": "a", "stop": ["x", "y", "z"]}, "stop", "max-stop-strings", 2, 3),
        ("cmpl", {"prompt": "a", "stop": "123456789"}, "stop", "max-stop-string-length", 8, 9),
        ("chat", {"logprobs": True, "top_logprobs": 5}, "top_logprobs", "max-logprobs", 3, 5),
        ("chat", {"n": 4}, "n", "max-n", 2, 4),
    ],
)  # fmt: skip
def test_each_limit_is_a_400_naming_it(limited, route, extra, param, name, limit, given) -> None:
    if route == "chat":
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
    else:
        path, body = "/v1/completions", {}
    before = limited.metrics()
    response = httpx.post(f"{limited.url}{path}", json={**body, **extra}, timeout=10)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == "limit_exceeded"
    assert error["message"] == f"{param}: expected at most {limit} ({name}), got {given}"
    after = limited.metrics()
    reason = 'pagedkv_rejected_requests_total{reason="limit"}'
    assert after[reason] == before[reason] + 1
    # Refused before any work: nothing was looked up in the engine's prefix cache.
    key = "pagedkv_prefix_cache_queries_tokens_total"
    assert after[key] == before[key]


def test_limits_within_bounds_pass(limited) -> None:
    body = {"prompt": ["a", "b", "c"], "n": 2, "logprobs": 3, "stop": ["12345678"], "max_tokens": 2}
    response = httpx.post(f"{limited.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 200 and len(response.json()["choices"]) == 6


def test_limits_are_flags_with_their_defaults_in_the_help() -> None:
    parser = argparse.ArgumentParser()
    exposure.add_cli_args(parser)
    text = parser.format_help()
    for flag in ("--max-request-body-bytes", "--max-prompts-per-request", "--max-n",
                 "--max-logprobs", "--max-stop-strings", "--max-stop-string-length"):  # fmt: skip
        assert flag in text
    assert f"(default: {RequestLimits().max_request_body_bytes})" in text
    args = parser.parse_args(["--max-n", "3", "--max-request-body-bytes", "1000"])
    limits = RequestLimits.from_cli_args(args)
    assert (limits.max_n, limits.max_request_body_bytes) == (3, 1000)
    with pytest.raises(ValueError, match="max_n: expected an int >= 1, got 0"):
        RequestLimits(max_n=0)
