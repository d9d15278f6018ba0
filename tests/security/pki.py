"""Certificates made in the test: one CA, and leaf certificates it signs with
chosen SANs (always IP 127.0.0.1, so gRPC's host-name check passes locally),
usable as server and client certificates."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

TRUST_DOMAIN = "kvmap.test"


def spiffe(name: str) -> str:
    return f"spiffe://{TRUST_DOMAIN}/ns/kvmap/sa/{name}"


@dataclass(frozen=True)
class Leaf:
    cert: Path
    key: Path

    def pem(self) -> tuple[bytes, bytes]:
        """(private key, certificate chain) as gRPC's credentials take them."""
        return self.key.read_bytes(), self.cert.read_bytes()


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _validity(builder: x509.CertificateBuilder) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return builder.not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(
        now + datetime.timedelta(days=1)
    )


class Ca:
    def __init__(self, directory: Path, label: str = "kvmap") -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._cert = (
            _validity(x509.CertificateBuilder())
            .subject_name(_name(f"{label} CA"))
            .issuer_name(_name(f"{label} CA"))
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.path = directory / "ca.pem"
        self.path.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, uris: tuple[str, ...] = (), dns: tuple[str, ...] = ()) -> Leaf:
        key = ec.generate_private_key(ec.SECP256R1())
        sans: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        sans += [x509.UniformResourceIdentifier(u) for u in uris]
        sans += [x509.DNSName(d) for d in dns]
        cert = (
            _validity(x509.CertificateBuilder())
            .subject_name(_name(name))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )
        leaf = Leaf(self.directory / f"{name}.pem", self.directory / f"{name}.key")
        leaf.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        leaf.key.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return leaf

    def daemon_args(self, leaf: Leaf, *identities: str) -> tuple[str, ...]:
        """``kvmapd serve`` flags: mutual TLS with this CA, allowing ``identities``."""
        args = ["--tls-cert", str(leaf.cert), "--tls-key", str(leaf.key)]
        args += ["--tls-client-ca", str(self.path)]
        for identity in identities:
            args += ["--peer-identity", identity]
        return tuple(args)
