"""The `pagedkv serve` flags that decide who may reach the server and how: API keys, TLS,
CORS, prefix-cache isolation, and the request limits (`RequestLimits`).

Standard library and the server's own option types only: `pagedkv --help` builds the parser
without loading the engine.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from typing import Any

from pagedkv.server.auth import (
    ISOLATION_MODES,
    METRICS_KEY_MODES,
    AccessPolicy,
    is_loopback,
    metrics_need_key,
    parse_api_keys,
)
from pagedkv.server.limits import RequestLimits

logger = logging.getLogger("pagedkv.server")

API_KEY_ENV = "PAGEDKV_API_KEY"
CERT_REQS = ("none", "optional", "required")


@dataclass(frozen=True)
class TLSOptions:
    """uvicorn's TLS settings; `keyfile` and `certfile` together turn HTTPS on.

    Raises:
        ValueError: one of keyfile / certfile without the other, or client certificates
            asked for without TLS or without CA certificates to check them.
    """

    keyfile: str | None = None
    certfile: str | None = None
    ca_certs: str | None = None
    cert_reqs: str = "none"

    def __post_init__(self) -> None:
        if (self.keyfile is None) != (self.certfile is None):
            raise ValueError(
                "ssl: expected --ssl-keyfile and --ssl-certfile together, got only "
                + ("--ssl-keyfile" if self.certfile is None else "--ssl-certfile")
            )
        if self.cert_reqs not in CERT_REQS:
            raise ValueError(f"ssl_cert_reqs: expected one of {CERT_REQS}, got {self.cert_reqs!r}")
        if (self.ca_certs is not None or self.cert_reqs != "none") and self.keyfile is None:
            raise ValueError(
                "ssl: expected --ssl-keyfile and --ssl-certfile for client certificates"
            )
        if self.cert_reqs != "none" and self.ca_certs is None:
            raise ValueError(f"ssl_cert_reqs {self.cert_reqs!r}: expected --ssl-ca-certs, got none")

    @property
    def enabled(self) -> bool:
        return self.certfile is not None

    def uvicorn_kwargs(self) -> dict[str, Any]:
        """The `uvicorn.Config` keywords (empty without TLS)."""
        import ssl

        if not self.enabled:
            return {}
        reqs = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}
        return {
            "ssl_keyfile": self.keyfile,
            "ssl_certfile": self.certfile,
            "ssl_ca_certs": self.ca_certs,
            "ssl_cert_reqs": reqs[self.cert_reqs],
        }


def _csv(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add the access, TLS and CORS flags, and `RequestLimits`' flags."""
    access = parser.add_argument_group("access (see README: exposing the server)")
    access.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every route but /health (repeatable, "
        f"or comma-separated; also read from ${API_KEY_ENV})",
    )
    access.add_argument(
        "--metrics-require-key",
        choices=METRICS_KEY_MODES,
        default="auto",
        help="whether /metrics needs a key; auto: only when keys are set and --host is not "
        "a loopback address",
    )
    access.add_argument(
        "--prefix-cache-isolation",
        choices=ISOLATION_MODES,
        default="none",
        help="per-key: each API key gets its own prefix cache (its hash salts the cache), so "
        "no tenant's cached prompt is served to, or timed by, another",
    )
    tls = parser.add_argument_group("TLS (HTTPS)")
    tls.add_argument("--ssl-keyfile", metavar="PATH", help="the server's private key (PEM)")
    tls.add_argument("--ssl-certfile", metavar="PATH", help="the server's certificate (PEM)")
    tls.add_argument(
        "--ssl-ca-certs", metavar="PATH", help="CA certificates that sign client certificates"
    )
    tls.add_argument(
        "--ssl-cert-reqs",
        choices=CERT_REQS,
        default=None,
        help="client certificates (mutual TLS): default required with --ssl-ca-certs, else none",
    )
    cors = parser.add_argument_group("CORS (off unless --allowed-origins is given)")
    cors.add_argument(
        "--allowed-origins",
        type=_csv,
        default=[],
        metavar="LIST",
        help="comma-separated origins browsers may call from, e.g. https://app.example.com",
    )
    cors.add_argument(
        "--allowed-methods", type=_csv, default=["GET", "POST"], metavar="LIST",
        help="comma-separated methods of cross-origin requests (default: GET,POST)",
    )  # fmt: skip
    cors.add_argument(
        "--allowed-headers",
        type=_csv,
        default=["Authorization", "Content-Type"],
        metavar="LIST",
        help="comma-separated request headers (default: Authorization,Content-Type)",
    )
    RequestLimits.add_cli_args(parser)


def access_policy(args: argparse.Namespace, environ: dict[str, str] | None = None) -> AccessPolicy:
    """The keys of `--api-key` and `$PAGEDKV_API_KEY`, and what they guard.

    Raises:
        ValueError: a malformed key, or an option that needs keys without any.
    """
    environ = dict(os.environ) if environ is None else environ
    values = list(args.api_key) + ([environ[API_KEY_ENV]] if environ.get(API_KEY_ENV) else [])
    keys = parse_api_keys(values)
    if args.metrics_require_key == "yes" and not keys:
        raise ValueError("--metrics-require-key yes: expected --api-key, got none")
    if args.prefix_cache_isolation == "per-key" and not keys:
        raise ValueError("--prefix-cache-isolation per-key: expected --api-key, got none")
    if not keys and not is_loopback(args.host):
        logger.warning(
            "serving on %s without --api-key: anyone who reaches it may use it", args.host
        )
    return AccessPolicy(
        api_keys=keys,
        metrics_require_key=metrics_need_key(args.metrics_require_key, args.host, bool(keys)),
        isolate_per_key=args.prefix_cache_isolation == "per-key",
    )


def tls_options(args: argparse.Namespace) -> TLSOptions:
    reqs = args.ssl_cert_reqs or ("required" if args.ssl_ca_certs else "none")
    return TLSOptions(args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs, reqs)
