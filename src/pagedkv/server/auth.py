"""Who may use the server: API keys checked before a request reaches any route, and the
prefix-cache salt a key implies.

With keys configured every path needs ``Authorization: Bearer KEY`` except `/health` (and
`/metrics` when the policy leaves it open). The key is compared in constant time: the
SHA-256 of the given key against the SHA-256 of every configured key, all of them, so
neither which key matched nor how much of it did shows in the time taken (fixed-length
digests also hide the keys' lengths). A missing or wrong key is a 401 with OpenAI's error
body and a ``WWW-Authenticate: Bearer`` header, counted in `pagedkv_auth_failures_total`;
its body is never read and the engine never sees it.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the CLI builds its flags from this module without loading the server
    from starlette.responses import JSONResponse
    from starlette.types import ASGIApp, Receive, Scope, Send

    from pagedkv.server.metrics import ServerMetrics

logger = logging.getLogger("pagedkv.server")

METRICS_KEY_MODES = ("auto", "yes", "no")
ISOLATION_MODES = ("none", "per-key")
# Where a key's digest waits for the routes (`request.state`, Starlette's per-request dict).
_DIGEST_STATE = "api_key_digest"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def parse_api_keys(values: Iterable[str]) -> tuple[str, ...]:
    """Keys from flags and the environment: each value may hold several, comma-separated.

    Raises:
        ValueError: a key that is empty or holds whitespace (an HTTP header cannot carry it).
    """
    keys: list[str] = []
    for value in values:
        for key in value.split(","):
            if not key or key != key.strip() or any(c.isspace() for c in key):
                raise ValueError(
                    "api key: expected a non-empty key without spaces, "
                    f"got one of {len(key)} characters"
                )
            if key not in keys:
                keys.append(key)
    return tuple(keys)


def is_loopback(host: str) -> bool:
    """Whether binding `host` reaches only this machine (``localhost``, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # another host name: it may resolve to any interface
        return False


@dataclass(frozen=True)
class AccessPolicy:
    """Which requests need a key, and whether a key partitions the prefix cache.

    Args:
        api_keys: the accepted keys (none: the server is open).
        metrics_require_key: `/metrics` needs a key too (see `metrics_need_key`).
        isolate_per_key: a request's prefix-cache salt derives from its key (its own
            `cache_salt`, if any, further partitions that key's cache).

    Raises:
        ValueError: an option that needs keys without any.
    """

    api_keys: tuple[str, ...] = ()
    metrics_require_key: bool = False
    isolate_per_key: bool = False
    _digests: tuple[bytes, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        for name in ("metrics_require_key", "isolate_per_key"):
            if getattr(self, name) and not self.api_keys:
                raise ValueError(f"{name}: expected API keys to check, got none")
        object.__setattr__(self, "_digests", tuple(_digest(k) for k in self.api_keys))

    def match(self, authorization: str | None) -> bytes | None:
        """The digest of the bearer key in an ``Authorization`` header value, if it is one
        of the configured keys; else None. Every configured key is compared."""
        scheme, _, token = (authorization or "").partition(" ")
        given = _digest(token.strip())
        found = False
        for digest in self._digests:
            found |= hmac.compare_digest(given, digest)
        return given if found and scheme.lower() == "bearer" else None

    def needs_key(self, path: str) -> bool:
        if not self.api_keys or path == "/health":
            return False
        return path != "/metrics" or self.metrics_require_key


def metrics_need_key(mode: str, host: str, has_keys: bool) -> bool:
    """`--metrics-require-key`: "yes", "no", or "auto" (a key when keys are configured and
    the server binds a host other than loopback).

    Raises:
        ValueError: a mode not in `METRICS_KEY_MODES`.
    """
    if mode not in METRICS_KEY_MODES:
        raise ValueError(f"metrics_require_key: expected one of {METRICS_KEY_MODES}, got {mode!r}")
    if mode == "auto":
        return has_keys and not is_loopback(host)
    return mode == "yes"


def request_salt(policy: AccessPolicy, request: Any, cache_salt: str | None) -> str | None:
    """The prefix-cache salt of a request: its `cache_salt`, under its key's digest when the
    cache is isolated per key (the raw key never enters the cache's keys)."""
    if not policy.isolate_per_key:
        return cache_salt
    digest: bytes = getattr(request.state, _DIGEST_STATE)
    tenant = f"key:{digest.hex()}"
    return tenant if cache_salt is None else f"{tenant}/{cache_salt}"


class AccessMiddleware:
    """ASGI middleware: a 401 for a request without a configured key (see the module)."""

    def __init__(self, app: ASGIApp, policy: AccessPolicy, metrics: ServerMetrics) -> None:
        self.app, self.policy, self.metrics = app, policy, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.policy.needs_key(scope["path"]):
            await self.app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"authorization")
        digest = self.policy.match(None if header is None else header.decode("latin-1"))
        if digest is None:
            self.metrics.auth_failures.inc()
            await _unauthorized(header is not None)(scope, receive, send)
            return
        scope.setdefault("state", {})[_DIGEST_STATE] = digest
        await self.app(scope, receive, send)


def _unauthorized(was_given: bool) -> JSONResponse:
    from starlette.responses import JSONResponse

    from pagedkv.server.protocol import ErrorInfo, ErrorResponse

    message = (
        "invalid API key: expected a configured key in 'Authorization: Bearer KEY'"
        if was_given
        else "missing API key: expected 'Authorization: Bearer KEY'"
    )
    info = ErrorInfo(message=message, type="invalid_request_error", code="invalid_api_key")
    challenge = 'Bearer realm="pagedkv"' + (', error="invalid_token"' if was_given else "")
    return JSONResponse(
        ErrorResponse(error=info).model_dump(),
        status_code=401,
        headers={"WWW-Authenticate": challenge},
    )
