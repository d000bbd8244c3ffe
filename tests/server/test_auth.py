"""API keys: 401 without the right key (before any work), /health open, /metrics per policy."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time

import httpx
import openai
import pytest
from live_server import MODEL_NAME, LiveServer, start_server

from pagedkv.server import exposure
from pagedkv.server.api import CorsOptions
from pagedkv.server.auth import AccessPolicy, metrics_need_key, parse_api_keys

KEYS = ("key-one-0123456789", "key-two-abcdefghij")
PROMPT = "The quick brown fox jumps over the lazy dog."
BAD_KEY_REQUESTS = 1000


@pytest.fixture(scope="module")
def keyed(tiny_model_dir):
    access = AccessPolicy(api_keys=KEYS, metrics_require_key=True)
    with start_server(tiny_model_dir, app_kwargs={"access": access}) as live:
        yield live


def _client(server: LiveServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _complete(client: openai.OpenAI, **kwargs):
    return client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, **kwargs
    )


def test_no_key_and_wrong_key_are_authentication_errors(keyed) -> None:
    # The client always sends a key: drop its header on the way out.
    no_header = httpx.Client(event_hooks={"request": [lambda r: r.headers.pop("Authorization")]})
    keyless = openai.OpenAI(
        base_url=f"{keyed.url}/v1", api_key="x", max_retries=0, http_client=no_header
    )
    with pytest.raises(openai.AuthenticationError) as missing:
        _complete(keyless)
    assert "missing API key" in missing.value.body["message"]
    with pytest.raises(openai.AuthenticationError) as wrong:
        _complete(_client(keyed, "key-one-0123456788"))
    for error in (missing.value, wrong.value):
        assert error.status_code == 401
        assert error.body["code"] == "invalid_api_key"
        assert error.body["type"] == "invalid_request_error" and error.body["param"] is None
    assert "key-one" not in str(wrong.value.body)  # the given key is never echoed


def test_401_body_and_header_on_every_guarded_route(keyed) -> None:
    routes = [
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", {"prompt": "x"}),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ("POST", "/tokenize", {"prompt": "x"}),
        ("POST", "/detokenize", {"tokens": [5]}),
        ("GET", "/metrics", None),
    ]
    for method, path, body in routes:
        for headers in ({}, _auth("nope"), {"Authorization": f"Basic {KEYS[0]}"}):
            response = httpx.request(method, keyed.url + path, json=body, headers=headers)
            assert response.status_code == 401, (path, headers)
            assert response.headers["www-authenticate"].startswith("Bearer")
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["code"] == "invalid_api_key"
    assert httpx.get(f"{keyed.url}/health").json() == {"status": "ok"}


def test_right_keys_get_the_usual_answers(keyed) -> None:
    texts = []
    for key in KEYS:
        client = _client(keyed, key)
        result = _complete(client, seed=1)
        assert result.choices[0].finish_reason in ("length", "stop")
        streamed = "".join(c.choices[0].text for c in _complete(client, seed=1, stream=True))
        assert streamed == result.choices[0].text
        texts.append(streamed)
        chat = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert chat.choices[0].message.role == "assistant"
        assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert texts[0] == texts[1]
    tokens = httpx.post(f"{keyed.url}/tokenize", json={"prompt": "hi"}, headers=_auth(KEYS[1]))
    assert tokens.status_code == 200 and tokens.json()["tokens"]


def test_metrics_need_the_key_when_the_policy_says_so(keyed) -> None:
    before = keyed.metrics(_auth(KEYS[0]))["pagedkv_auth_failures_total"]
    assert httpx.get(f"{keyed.url}/metrics").status_code == 401
    after = keyed.metrics(_auth(KEYS[1]))["pagedkv_auth_failures_total"]
    assert after == before + 1


async def _bad_key_flood(url: str, body: dict, deadline: float) -> list[int]:
    """`BAD_KEY_REQUESTS` posts with wrong keys over 16 connections (loopback only)."""
    limit = asyncio.Semaphore(16)
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:

        async def one(i: int) -> int:
            async with limit:
                if time.monotonic() > deadline:
                    return 0
                headers = _auth(f"guess-{i}")
                return (
                    await client.post("/v1/completions", json=body, headers=headers)
                ).status_code

        return await asyncio.gather(*(one(i) for i in range(BAD_KEY_REQUESTS)))


def test_bad_keys_leave_no_trace_in_the_engine(keyed) -> None:
    headers = _auth(KEYS[0])
    before = keyed.wait_all_blocks_free(headers=headers)
    body = {"model": MODEL_NAME, "prompt": PROMPT * 20, "max_tokens": 64, "ignore_eos": True}
    codes = asyncio.run(_bad_key_flood(keyed.url, body, time.monotonic() + 120))
    assert codes == [401] * BAD_KEY_REQUESTS, f"{codes.count(0)} not sent in the time bound"
    after = keyed.metrics(headers)
    assert after["pagedkv_auth_failures_total"] - before["pagedkv_auth_failures_total"] == (
        BAD_KEY_REQUESTS
    )
    for name in (
        "pagedkv_kv_blocks_used",
        "pagedkv_kv_blocks_cached",
        "pagedkv_num_requests_waiting",
        "pagedkv_num_requests_running",
        "pagedkv_prefix_cache_queries_tokens_total",
        "pagedkv_prompt_tokens_total",
    ):
        assert after[name] == before[name], name
    assert after["pagedkv_kv_blocks_used"] == after["pagedkv_num_requests_waiting"] == 0


def test_metrics_stay_open_on_loopback_and_cors_is_off_by_default(tiny_model_dir) -> None:
    origin = "https://app.example.com"
    access = AccessPolicy(api_keys=KEYS)
    cors = CorsOptions(allowed_origins=(origin,))
    with start_server(tiny_model_dir, app_kwargs={"access": access, "cors": cors}) as live:
        assert live.metrics()["pagedkv_auth_failures_total"] == 0
        preflight = {"Origin": origin, "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization,content-type"}  # fmt: skip
        response = httpx.options(f"{live.url}/v1/completions", headers=preflight)
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == origin
        assert "authorization" in response.headers["access-control-allow-headers"].lower()
        other = httpx.options(f"{live.url}/v1/completions", headers={**preflight, "Origin": "x"})
        assert other.status_code == 400
        denied = httpx.get(f"{live.url}/v1/models", headers={"Origin": origin})
        assert denied.status_code == 401  # CORS admits the origin, not the request
        assert denied.headers["access-control-allow-origin"] == origin
    with start_server(tiny_model_dir) as live:  # no keys, no CORS
        response = httpx.get(f"{live.url}/v1/models", headers={"Origin": origin})
        assert response.status_code == 200
        assert "access-control-allow-origin" not in response.headers


def test_metrics_rule_and_key_parsing() -> None:
    assert not metrics_need_key("auto", "127.0.0.1", True)
    assert not metrics_need_key("auto", "localhost", True)
    assert not metrics_need_key("auto", "::1", True)
    assert metrics_need_key("auto", "0.0.0.0", True)
    assert metrics_need_key("auto", "example.com", True)
    assert not metrics_need_key("auto", "0.0.0.0", False)
    assert metrics_need_key("yes", "127.0.0.1", True)
    assert not metrics_need_key("no", "0.0.0.0", True)
    assert parse_api_keys(["a,b", "b", "c"]) == ("a", "b", "c")
    for bad in ("a,,b", "a b", " a"):
        with pytest.raises(ValueError, match="api key: expected a non-empty key"):
            parse_api_keys([bad])
    with pytest.raises(ValueError, match="isolate_per_key: expected API keys"):
        AccessPolicy(isolate_per_key=True)


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    exposure.add_cli_args(parser)
    return parser.parse_args(list(argv))


def test_keys_come_from_flags_and_the_environment() -> None:
    args = _serve_args("--api-key", "f1", "--api-key", "f2,f3", "--host", "0.0.0.0")
    policy = exposure.access_policy(args, {exposure.API_KEY_ENV: "e1,e2"})
    assert policy.api_keys == ("f1", "f2", "f3", "e1", "e2")
    assert policy.metrics_require_key and not policy.isolate_per_key
    for key in policy.api_keys:
        assert policy.match(f"Bearer {key}") is not None
        assert policy.match(f"bearer {key}") is not None
    assert policy.match("Bearer e3") is None and policy.match(None) is None
    open_policy = exposure.access_policy(_serve_args(), {})
    assert open_policy.api_keys == () and not open_policy.needs_key("/v1/models")
    with pytest.raises(ValueError, match="per-key: expected --api-key, got none"):
        exposure.access_policy(_serve_args("--prefix-cache-isolation", "per-key"), {})
    with pytest.raises(ValueError, match="--metrics-require-key yes: expected --api-key"):
        exposure.access_policy(_serve_args("--metrics-require-key", "yes"), {})


def test_the_serve_flags_load_no_server_stack() -> None:
    code = (
        "import sys; from pagedkv.cli import build_parser; build_parser(); "
        "loaded = [m for m in ('starlette', 'pydantic', 'prometheus_client') if m in sys.modules]; "
        "print(loaded); sys.exit(1 if loaded else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
