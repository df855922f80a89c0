"""TLS and SuperNode-key files for a Flower deployment (no Flower process started)."""

from __future__ import annotations

import ipaddress
import stat
from pathlib import Path

import pytest

pytest.importorskip("cryptography")  # comes with the flower extra

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from protofl.engine.flower.credentials import write_node_key, write_tls


def test_the_server_certificate_is_signed_by_the_ca_for_the_loopback_names(tmp_path: Path) -> None:
    files = write_tls(tmp_path / "tls")
    ca = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
    cert = x509.load_pem_x509_certificate(files.server_cert.read_bytes())
    cert.verify_directly_issued_by(ca)  # raises if the CA did not sign it
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    key = serialization.load_pem_private_key(files.server_key.read_bytes(), None)
    assert key.public_key() == cert.public_key()
    assert stat.S_IMODE(files.server_key.stat().st_mode) == 0o600


def test_a_node_key_is_an_openssh_ecdsa_pair_flower_can_read(tmp_path: Path) -> None:
    files = write_node_key(tmp_path / "keys", "supernode-0")
    private = serialization.load_ssh_private_key(files.private_key.read_bytes(), None)
    public = serialization.load_ssh_public_key(files.public_key.read_bytes())
    assert isinstance(private, ec.EllipticCurvePrivateKey)
    assert isinstance(public, ec.EllipticCurvePublicKey) and public.curve.name == "secp384r1"
    assert private.public_key() == public
    assert stat.S_IMODE(files.private_key.stat().st_mode) == 0o600


def test_bad_input_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one host"):
        write_tls(tmp_path, ())
    with pytest.raises(ValueError, match="at least 1 day"):
        write_tls(tmp_path, days=0)
    with pytest.raises(ValueError, match=r"node name '\.\./x'"):
        write_node_key(tmp_path, "../x")
