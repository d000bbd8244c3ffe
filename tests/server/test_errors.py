"""Bad input, disconnects and overload: OpenAI-style errors, and every block comes back."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
from live_server import MODEL_NAME, start_server

GOOD = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4}
LONG_FOR_POOL = [5] * 600  # 150 blocks of 4 > the 128-block pool, < the 1024 context
LONG_FOR_CONTEXT = [5] * 1100

BAD_REQUESTS = [
    ("completions", {**GOOD, "prompt": LONG_FOR_CONTEXT}, "1100"),
    ("completions", {**GOOD, "prompt": LONG_FOR_POOL}, "600"),
    ("completions", {**GOOD, "max_tokens": -3}, "max_tokens"),
    ("completions", {**GOOD, "temperature": "hot"}, "temperature"),
    ("completions", {**GOOD, "n": 0}, "n"),
    ("completions", {**GOOD, "top_p": 1.5}, "top_p"),
    ("completions", {**GOOD, "top_k": 0}, "top_k"),
    ("completions", {**GOOD, "logprobs": 50}, "logprobs"),
    ("completions", {**GOOD, "prompt": []}, "prompt"),
    ("completions", {**GOOD, "stop": [""]}, "stop"),
    ("completions", {"model": MODEL_NAME}, "prompt"),
    ("chat/completions", {"model": MODEL_NAME, "messages": []}, "messages"),
    (
        "chat/completions",
        {"model": MODEL_NAME, "messages": [{"role": "wizard", "content": "x"}]},
        "role",
    ),
    ("completions", {**GOOD, "temperature": float("inf")}, "temperature"),
    ("completions", {**GOOD, "top_p": float("nan")}, "top_p"),
    ("completions", {**GOOD, "seed": 2**64}, "seed"),
    ("completions", {**GOOD, "seed": -(2**63) - 1}, "seed"),
    ("completions", {**GOOD, "max_tokens": 10**12}, "1000000000000"),
    ("completions", {**GOOD, "prompt": [5] * 1000, "max_tokens": 100}, "1024"),
    ("completions", {**GOOD, "max_tokens": 0}, "max_tokens"),
    ("completions", {**GOOD, "suffix": "tail"}, "suffix"),
    ("completions", {**GOOD, "best_of": 3}, "best_of"),
    ("completions", {**GOOD, "logit_bias": {"5": 101}}, "logit_bias"),
    ("completions", {**GOOD, "logit_bias": {"999999": 1}}, "logit_bias"),
    ("completions", {**GOOD, "logit_bias": {"x": 1}}, "logit_bias"),
    ("completions", {**GOOD, "frobnicate": 1}, "frobnicate"),
    (
        "chat/completions",
        {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2000},
        "2000",
    ),
]


@pytest.mark.parametrize(
    ("endpoint", "body", "named"), BAD_REQUESTS, ids=[f"{e}-{n}" for e, _, n in BAD_REQUESTS]
)
def test_bad_request_is_400(server, endpoint, body, named):
    # json.dumps writes Infinity and NaN, as some clients do (httpx's json= refuses them).
    response = httpx.post(
        f"{server.url}/v1/{endpoint}",
        content=json.dumps(body),
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert named in error["message"], error["message"]
    assert len(error["message"]) < 400, "the message must not echo the request"


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        ("completions", {**GOOD, "model": "gpt-9"}),
        ("chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}),
    ],
)
def test_unknown_model_is_404(server, endpoint, body):
    before = server.metrics()['pagedkv_rejected_requests_total{reason="model_not_found"}']
    response = httpx.post(f"{server.url}/v1/{endpoint}", json=body, timeout=30)
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and "gpt-9" in error["message"]
    after = server.metrics()['pagedkv_rejected_requests_total{reason="model_not_found"}']
    assert after == before + 1


def test_error_message_does_not_echo_the_prompt(server):
    secret = "confidential " * 50
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": secret}],
        "top_logprobs": 2,
    }
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "top_logprobs" in message and "logprobs" in message
    assert "confidential" not in message


def test_rejections_are_counted_by_reason(server):
    def count(reason: str) -> float:
        return server.metrics()[f'pagedkv_rejected_requests_total{{reason="{reason}"}}']

    before = {r: count(r) for r in ("invalid_json", "schema", "context_length")}
    url = f"{server.url}/v1/completions"
    httpx.post(url, content=b"{oops", headers={"Content-Type": "application/json"})
    httpx.post(url, json={**GOOD, "n": 0})
    httpx.post(url, json={**GOOD, "max_tokens": 5000})
    assert {r: count(r) - before[r] for r in before} == {
        "invalid_json": 1,
        "schema": 1,
        "context_length": 1,
    }


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2", b""])
def test_invalid_json_is_400(server, raw):
    response = httpx.post(
        f"{server.url}/v1/completions",
        content=raw,
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_server_answers_after_bad_input(server):
    response = httpx.post(f"{server.url}/v1/completions", json=GOOD, timeout=30)
    assert response.status_code == 200
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert server.wait_all_blocks_free()["pagedkv_kv_blocks_used"] == 0
    unknown = httpx.get(f"{server.url}/v1/nothing-here")
    assert unknown.status_code == 404 and "error" in unknown.json()


def _aborted(server) -> float:
    return server.metrics().get('pagedkv_requests_total{finish_reason="abort"}', 0.0)


def test_stream_disconnect_aborts_and_frees_blocks(server):
    before = _aborted(server)
    body = {**GOOD, "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        chunks = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in chunks)
        assert server.metrics()["pagedkv_kv_blocks_used"] > 0
    # The request would run ~900 steps more; closing the connection must abort it now.
    metrics = server.wait_all_blocks_free()
    assert metrics["pagedkv_kv_blocks_used"] == 0
    assert metrics["pagedkv_kv_blocks_free"] == metrics["pagedkv_kv_blocks_total"]
    assert _aborted(server) == before + 1


def test_unstreamed_disconnect_aborts(server):
    before = _aborted(server)
    body = json.dumps({**GOOD, "max_tokens": 900, "ignore_eos": True}).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
        f"\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    # The client leaves while the request runs (hundreds of steps), whatever the speed.
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as client:
        client.sendall(request)
        deadline = time.monotonic() + 10
        while server.metrics()["pagedkv_num_requests_running"] < 1:
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.002)
    deadline = time.monotonic() + 10
    while _aborted(server) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    finished = {k: v for k, v in server.metrics().items() if k.startswith("pagedkv_requests_total")}
    assert _aborted(server) == before + 1, finished
    assert server.wait_all_blocks_free()["pagedkv_kv_blocks_used"] == 0


def test_overload_is_503(tiny_model_dir):
    async def burst(url: str) -> list[int]:
        body = {**GOOD, "max_tokens": 64, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=60) as client:
            responses = await asyncio.gather(
                *(client.post(f"{url}/v1/completions", json=body) for _ in range(8))
            )
        for r in responses:
            if r.status_code == 503:
                assert r.json()["error"]["type"] == "server_overloaded"
                assert int(r.headers["Retry-After"]) >= 1
        return [r.status_code for r in responses]

    # One request runs at a time and one may wait: a burst of 8 must be partly refused.
    with start_server(tiny_model_dir, max_num_seqs=1, max_waiting_requests=1) as live:
        statuses = asyncio.run(burst(live.url))
        assert statuses.count(200) >= 1 and statuses.count(503) >= 1, statuses
        assert set(statuses) == {200, 503}
        assert live.wait_all_blocks_free()["pagedkv_kv_blocks_used"] == 0
        assert httpx.post(f"{live.url}/v1/completions", json=GOOD, timeout=30).status_code == 200
