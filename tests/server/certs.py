"""Certificates for the TLS tests, made on the spot with `cryptography`: a CA, a server
certificate for 127.0.0.1 and localhost, and a client certificate, all signed by the CA."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class CertFiles:
    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return path


def _issue(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
    usage: list[x509.ObjectIdentifier] | None,
) -> x509.Certificate:
    """A certificate for `key`; self-signed (a CA) when `issuer` is None."""
    now = datetime.datetime.now(datetime.timezone.utc)
    issuer_name, issuer_key = issuer or (_name(subject), key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    if usage == [ExtendedKeyUsageOID.SERVER_AUTH]:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_certs(directory: Path) -> CertFiles:
    """Write a CA, a server certificate and a client certificate (PEM) to `directory`."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _issue("pagedkv test CA", ca_key, None, None)
    paths = {}
    for role, usage in (
        ("server", ExtendedKeyUsageOID.SERVER_AUTH),
        ("client", ExtendedKeyUsageOID.CLIENT_AUTH),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _issue(f"pagedkv test {role}", key, (ca.subject, ca_key), [usage])
        paths[f"{role}_key"] = _write_key(key, directory / f"{role}.key")
        paths[f"{role}_cert"] = directory / f"{role}.pem"
        paths[f"{role}_cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    ca_path = directory / "ca.pem"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    return CertFiles(ca_cert=ca_path, **paths)


def make_self_signed(directory: Path) -> tuple[Path, Path]:
    """A self-signed server certificate for 127.0.0.1 and localhost: (cert, key) paths."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _issue("pagedkv test server", key, None, [ExtendedKeyUsageOID.SERVER_AUTH])
    cert_path = directory / "self-signed.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, _write_key(key, directory / "self-signed.key")
