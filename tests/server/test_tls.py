"""HTTPS: `pagedkv serve` with a certificate made here, API keys from the flag and the
environment, and client certificates (mutual TLS)."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from certs import make_certs, make_self_signed
from live_server import MODEL_NAME, start_server

from pagedkv.server.exposure import API_KEY_ENV, TLSOptions

FLAG_KEY, ENV_KEYS = "flag-key-123", ("env-key-1", "env-key-2")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_healthy(url: str, verify: ssl.SSLContext, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", verify=verify, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError("server did not become healthy")


@pytest.fixture(scope="module")
def tls_server(tiny_model_dir, tmp_path_factory):
    """`pagedkv serve` over HTTPS with a self-signed certificate: (url, its SSL context)."""
    directory = tmp_path_factory.mktemp("tls")
    cert, key = make_self_signed(directory)
    port = _free_port()
    command = [sys.executable, "-m", "pagedkv.cli", "serve", "--model", str(tiny_model_dir),
               "--dtype", "float32", "--device", "cpu", "--block-size", "4", "--num-blocks",
               "64", "--port", str(port), "--served-model-name", MODEL_NAME, "--ssl-keyfile",
               str(key), "--ssl-certfile", str(cert), "--api-key", FLAG_KEY]  # fmt: skip
    env = {**os.environ, API_KEY_ENV: ",".join(ENV_KEYS)}
    log = (directory / "serve.log").open("wb")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"https://127.0.0.1:{port}"
    context = ssl.create_default_context(cafile=str(cert))
    try:
        _wait_healthy(url, context, process)
        yield url, context, cert
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def test_openai_client_over_https_with_every_key(tls_server) -> None:
    url, context, cert = tls_server
    for key in (FLAG_KEY, *ENV_KEYS):
        client = openai.OpenAI(
            base_url=f"{url}/v1",
            api_key=key,
            max_retries=0,
            http_client=httpx.Client(verify=context),
        )
        result = client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=3, seed=1)
        streamed = client.completions.create(
            model=MODEL_NAME, prompt="hi", max_tokens=3, seed=1, stream=True
        )
        assert "".join(c.choices[0].text for c in streamed) == result.choices[0].text
    wrong = openai.OpenAI(
        base_url=f"{url}/v1",
        api_key="nope",
        max_retries=0,
        http_client=httpx.Client(verify=context),
    )
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_plain_http_and_unverified_https_fail(tls_server) -> None:
    url, context, _ = tls_server
    with pytest.raises(httpx.TransportError):
        httpx.get(url.replace("https://", "http://") + "/health", timeout=5)
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{url}/health", timeout=5)  # the system's CAs do not know this certificate
    assert httpx.get(f"{url}/health", verify=context, timeout=5).status_code == 200
    # Bound to loopback: /metrics stays open even with keys.
    assert httpx.get(f"{url}/metrics", verify=context, timeout=5).status_code == 200


def test_client_certificates_are_required_with_ca_certs(tiny_model_dir, tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    tls = TLSOptions(str(certs.server_key), str(certs.server_cert), str(certs.ca_cert), "required")
    with start_server(tiny_model_dir, tls_kwargs=tls.uvicorn_kwargs()) as live:
        anonymous = ssl.create_default_context(cafile=str(certs.ca_cert))
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{live.url}/health", verify=anonymous, timeout=5)
        known = ssl.create_default_context(cafile=str(certs.ca_cert))
        known.load_cert_chain(str(certs.client_cert), str(certs.client_key))
        assert httpx.get(f"{live.url}/health", verify=known, timeout=5).status_code == 200


def test_tls_options_are_checked() -> None:
    assert TLSOptions().uvicorn_kwargs() == {}
    with pytest.raises(ValueError, match="--ssl-keyfile and --ssl-certfile together"):
        TLSOptions(keyfile="k.pem")
    with pytest.raises(ValueError, match="expected --ssl-ca-certs"):
        TLSOptions("k.pem", "c.pem", cert_reqs="required")
    with pytest.raises(ValueError, match="for client certificates"):
        TLSOptions(ca_certs="ca.pem")
    kwargs = TLSOptions("k.pem", "c.pem", "ca.pem", "optional").uvicorn_kwargs()
    assert kwargs["ssl_cert_reqs"] == ssl.CERT_OPTIONAL and kwargs["ssl_ca_certs"] == "ca.pem"
