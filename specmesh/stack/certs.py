"""Throwaway certificates for TLS on every hop: `specmesh certs --out DIR`, `specmesh up --tls`.

One run writes, into DIR:

    ca.pem                                 the CA that signed everything below (its key is not kept)
    server.pem, server-key.pem             every server's certificate: localhost, 127.0.0.1, ::1 and
                                           the --host names (docker compose: drafter, verifier, gateway)
    gateway-client.pem, -client-key.pem    the gateway's client certificate, for the replicas' mTLS
    client.pem, client-key.pem             a client certificate for you (grpcurl, a replica's Info)

The server certificate is also valid for client authentication, so that a server's own health
probe can pass its mutual TLS (docker compose healthchecks, Kubernetes exec probes). The CA's key
is never written: nothing more can be signed, and replacing everything is `--force`. Keys are
ECDSA P-256, readable by the owner only.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["CertFiles", "cert_files", "write_certs"]

LOOPBACK = ("localhost", "127.0.0.1", "::1")
VALID_DAYS = 365
_SKEW = datetime.timedelta(minutes=5)  # a node whose clock is a little behind still accepts them


@dataclass(frozen=True)
class CertFiles:
    """The paths of one set (module docstring); `dir` holds them all."""

    dir: Path
    ca: Path
    server_cert: Path
    server_key: Path
    gateway_cert: Path
    gateway_key: Path
    client_cert: Path
    client_key: Path

    def all(self) -> list[Path]:
        return [getattr(self, f.name) for f in fields(self) if f.name != "dir"]


def cert_files(directory: str | os.PathLike[str]) -> CertFiles:
    d = Path(directory)
    return CertFiles(
        d, d / "ca.pem", d / "server.pem", d / "server-key.pem", d / "gateway-client.pem",
        d / "gateway-client-key.pem", d / "client.pem", d / "client-key.pem",
    )  # fmt: skip


def write_certs(
    directory: str | os.PathLike[str],
    hosts: Sequence[str] = (),
    *,
    force: bool = False,
    days: int = VALID_DAYS,
) -> CertFiles:
    """A new CA and the certificates it signs, in `directory` (created). A complete set already
    there is kept as it is unless `force`: servers that loaded it keep trusting each other."""
    files = cert_files(directory)
    if not force and all(p.is_file() for p in files.all()):
        return files
    files.dir.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _ca_certificate(ca_key, days)
    leaves = (
        (files.server_cert, files.server_key, "specmesh server", [*LOOPBACK, *hosts], True),
        (files.gateway_cert, files.gateway_key, "specmesh gateway", [], False),
        (files.client_cert, files.client_key, "specmesh client", [], False),
    )
    for cert_path, key_path, name, names, server in leaves:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _leaf_certificate(key, name, names, server, ca, ca_key, days)
        _write(key_path, _key_pem(key), private=True)
        _write(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    _write(files.ca, ca.public_bytes(serialization.Encoding.PEM))  # last: a set with a CA is complete
    return files


def _ca_certificate(key: ec.EllipticCurvePrivateKey, days: int) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "specmesh throwaway CA")])
    usage = x509.KeyUsage(
        digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
        key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False,
    )  # fmt: skip
    builder = _builder(name, name, key.public_key(), days)
    builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
    builder = builder.add_extension(usage, critical=True)
    builder = builder.add_extension(
        x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
    )
    return builder.sign(key, hashes.SHA256())


def _leaf_certificate(
    key: ec.EllipticCurvePrivateKey,
    common_name: str,
    names: Iterable[str],
    server: bool,
    ca: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    days: int,
) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    usage = x509.KeyUsage(
        digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
        key_agreement=False, key_cert_sign=False, crl_sign=False, encipher_only=False, decipher_only=False,
    )  # fmt: skip
    purposes = [ExtendedKeyUsageOID.SERVER_AUTH] if server else []
    purposes.append(ExtendedKeyUsageOID.CLIENT_AUTH)
    ca_ski = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    builder = _builder(subject, ca.subject, key.public_key(), days)
    builder = builder.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
    builder = builder.add_extension(usage, critical=True)
    builder = builder.add_extension(x509.ExtendedKeyUsage(purposes), critical=False)
    builder = builder.add_extension(_alt_names([*names] or [common_name.replace(" ", "-")]), critical=False)
    builder = builder.add_extension(
        x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
    )
    aki = x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski)
    builder = builder.add_extension(aki, critical=False)
    return builder.sign(ca_key, hashes.SHA256())


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey, days: int
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _SKEW)
        .not_valid_after(now + datetime.timedelta(days=days))
    )


def _alt_names(names: Iterable[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in dict.fromkeys(names):
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _write(path: Path, data: bytes, private: bool = False) -> None:
    """Written whole or not at all (a reader never sees half a file); keys mode 0600."""
    tmp = path.with_name(f".{path.name}.tmp")
    with contextlib.suppress(FileNotFoundError):  # a leftover would keep its old mode
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
