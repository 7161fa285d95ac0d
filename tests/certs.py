"""Certificates the TLS tests make for themselves: a CA, a server certificate for the
loopback addresses and a client certificate, written as PEM files."""

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
class Certificates:
    ca: str  # the CA's certificate (what clients and the server trust)
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> tuple[str, str]:
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.with_suffix(".key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(path.with_suffix(".crt")), str(path.with_suffix(".key"))


def make_certificates(directory: Path, ca_name: str = "slicewise test CA") -> Certificates:
    now = datetime.datetime.now(datetime.UTC)
    valid = (now - datetime.timedelta(hours=1), now + datetime.timedelta(days=1))
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name(ca_name))
        .issuer_name(_name(ca_name))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid[0])
        .not_valid_after(valid[1])
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    ca_path, _ = _write(directory / "ca", ca, ca_key)

    def issue(name: str, usage: x509.ObjectIdentifier, san: list[x509.GeneralName] | None):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(valid[0])
            .not_valid_after(valid[1])
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return _write(directory / name, builder.sign(ca_key, hashes.SHA256()), key)

    loopback = [
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    ]
    server = issue("server", ExtendedKeyUsageOID.SERVER_AUTH, loopback)
    client = issue("client", ExtendedKeyUsageOID.CLIENT_AUTH, None)
    return Certificates(ca_path, *server, *client)
