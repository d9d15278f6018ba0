"""TLS and mutual TLS on the TCP port, with certificates made in the test:
a peer daemon without a valid client certificate is refused, one with it
transfers."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmap.tools.grants import granted
from kvmap.tools.launch import start_daemon, start_worker

pytestmark = pytest.mark.integration

GEO = ("--blocks", "16", "--block-tokens", "32", "--mla-layers", "3", "--indexer-layers", "1")


@dataclass(frozen=True)
class Pki:
    ca: Path
    cert: Path
    key: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def spiffe_id(label: str) -> str:
    return f"spiffe://kvmap.test/{label}"


def make_pki(directory: Path, label: str) -> Pki:
    """A CA and one certificate it signed, valid for 127.0.0.1 as server and client."""
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name(f"{label} CA"))
        .issuer_name(_name(f"{label} CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(f"{label} kvmapd"))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    x509.UniformResourceIdentifier(spiffe_id(label)),
                ]
            ),
            critical=False,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [x509.oid.ExtendedKeyUsageOID.SERVER_AUTH, x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pki = Pki(directory / "ca.pem", directory / "cert.pem", directory / "key.pem")
    pki.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    pki.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pki.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return pki


def tls_args(pki: Pki, client_ca: Path) -> tuple[str, ...]:
    return (
        "--tls-cert", str(pki.cert), "--tls-key", str(pki.key),
        "--tls-client-ca", str(client_ca), "--peer-ca", str(pki.ca),
        # Mutual TLS authorizes by identity: the daemons of this CA are "kvmap".
        "--peer-identity", spiffe_id("kvmap"),
    )  # fmt: skip


def test_mutual_tls_between_daemons(tmp_path: Path) -> None:
    """With mutual TLS, a daemon holding a certificate from the shared CA pulls and verifies, one
    signed by another CA or without TLS gets UNAVAILABLE, a plaintext client gets no health
    answer and a CA-signed client sees SERVING."""
    good = make_pki(tmp_path / "pki", "kvmap")
    rogue = make_pki(tmp_path / "rogue", "rogue")
    prefill = start_daemon(tmp_path / "p", *tls_args(good, good.ca), name="prefill")
    pw = start_worker(prefill, "prefill", *GEO, "--fill")
    trusted = start_daemon(tmp_path / "q", *tls_args(good, good.ca), name="trusted")
    tw = start_worker(trusted, "trusted", *GEO)
    # A daemon whose certificate another CA signed (it trusts the server).
    untrusted = start_daemon(
        tmp_path / "r",
        "--tls-cert", str(rogue.cert), "--tls-key", str(rogue.key), "--peer-ca", str(good.ca),
        name="untrusted",
    )  # fmt: skip
    uw = start_worker(untrusted, "untrusted", *GEO)
    plain = start_daemon(tmp_path / "s", name="plain")
    plw = start_worker(plain, "plain", *GEO)
    try:
        pull = {
            "cmd": "pull",
            "request_id": "tls",
            "remote_target": prefill.tcp_target,
            "remote_worker": {"engine_id": "prefill"},
            "groups": [{"group": 0, "local": [1, 2, 3], "remote": [7, 8, 9]}],
        }
        ok = tw.call(granted(pw, pull))
        assert ok["ok"] and ok["bad_blocks"] == 0, ok
        for refused in (uw, plw):
            # UNAVAILABLE is retried until the deadline, then passed on.
            out = refused.call(granted(pw, {**pull, "timeout_ms": 5000}))
            assert (out["ok"], out["code"]) == (False, "UNAVAILABLE"), out

        # Operators: a plaintext client gets nothing; a client with a
        # certificate from the CA gets health.
        with grpc.insecure_channel(prefill.tcp_target) as ch, pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        creds = grpc.ssl_channel_credentials(
            good.ca.read_bytes(), good.key.read_bytes(), good.cert.read_bytes()
        )
        with grpc.secure_channel(prefill.tcp_target, creds) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        for w in (pw, tw, uw, plw):
            w.stop()
        for d in (prefill, trusted, untrusted, plain):
            assert d.terminate() == 0, d.log()
