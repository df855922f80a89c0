"""TLS and SuperNode-authentication files for a Flower deployment, made with ``cryptography``.

:func:`write_tls` writes a self-signed CA and a server certificate it signs (for the SuperLink's
``--ssl-ca-certfile/--ssl-certfile/--ssl-keyfile``; clients verify it with the CA as
``--root-certificates``).  :func:`write_node_key` writes one SuperNode's ECDSA key pair in the
OpenSSH formats Flower reads: the private key for ``flower-supernode
--auth-supernode-private-key``, the public key for ``flwr supernode register``.

These are for a loopback test or a first trial; on real machines the operator's own PKI issues
the server certificate, and each SuperNode makes its key pair where it runs and hands over only
the public key (docs/distributed.md, "Authenticated nodes").
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

NODE_CURVE = ec.SECP384R1()
"""The curve of SuperNode keys (Flower accepts NIST curves; its docs use P-384)."""

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class TlsFiles:
    """The PEM files of :func:`write_tls`."""

    ca_cert: Path
    server_cert: Path
    server_key: Path


@dataclass(frozen=True)
class NodeKey:
    """One SuperNode's key pair, as written by :func:`write_node_key`."""

    private_key: Path
    public_key: Path


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` readable by the owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def _san(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def write_tls(
    folder: str | Path,
    hosts: Sequence[str] = ("127.0.0.1", "localhost"),
    *,
    days: int = 7,
) -> TlsFiles:
    """Write ``ca.crt``, ``server.pem`` and ``server.key`` into ``folder``: a self-signed CA
    and a server certificate it signs, valid for ``hosts`` (IP addresses or DNS names)."""
    if not hosts:
        raise ValueError("write_tls needs at least one host name or IP address")
    if days < 1:
        raise ValueError(f"days={days}: a certificate must be valid for at least 1 day")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "protofl deployment CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )

    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(_san(hosts), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )

    files = TlsFiles(folder / "ca.crt", folder / "server.pem", folder / "server.key")
    files.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.server_cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    _write_private(
        files.server_key,
        server_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )
    return files


def write_node_key(folder: str | Path, name: str) -> NodeKey:
    """Write SuperNode ``name``'s ECDSA key pair into ``folder`` as ``NAME`` (OpenSSH private
    key, owner-only) and ``NAME.pub`` (OpenSSH public key)."""
    if not _NAME.fullmatch(name):
        raise ValueError(
            f"node name {name!r}: use letters, digits, '.', '_' and '-' (a file name is made of it)"
        )
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(NODE_CURVE)
    files = NodeKey(folder / name, folder / f"{name}.pub")
    _write_private(
        files.private_key,
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        ),
    )
    files.public_key.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
        + b"\n"
    )
    return files
