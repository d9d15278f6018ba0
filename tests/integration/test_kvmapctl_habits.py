"""kvmapctl against a real daemon, used the way kubectl is: options after
the command, a bare socket path or $KVMAP_TARGET for the target, -o
json|wide, one clear line for the Admin commands over TCP, a closed pipe
that ends it quietly, and TLS to a daemon's TCP port."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvmap.tools.launch import DaemonProc, WorkerProc, start_daemon, start_worker
from kvmap.tools.peers import new_peer_secret

pytestmark = pytest.mark.integration

CTL = [sys.executable, "-m", "kvmap.daemon.cli.kvmapctl"]
GEO = ("--blocks", "16", "--mla-layers", "4")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProc, WorkerProc]]:
    daemon = start_daemon(tmp_path_factory.mktemp("habits") / "d")
    try:
        worker = start_worker(daemon, "engine-x", *GEO)
    except BaseException:
        daemon.kill()
        raise
    yield daemon, worker
    worker.stop()
    assert daemon.terminate() == 0, daemon.log()


def ctl(*args: str, target: str | None = None) -> subprocess.CompletedProcess[str]:
    """kvmapctl with $KVMAP_TARGET set to ``target`` (unset when None)."""
    env = {k: v for k, v in os.environ.items() if k != "KVMAP_TARGET"}
    if target is not None:
        env["KVMAP_TARGET"] = target
    return subprocess.run(
        [*CTL, *args], capture_output=True, text=True, timeout=60, check=False, env=env
    )


def test_options_anywhere_and_the_target_as_a_path_or_variable(
    served: tuple[DaemonProc, WorkerProc],
) -> None:
    """`workers --json` and `workers -o json` after the command print the workers as JSON,
    `--target` takes a bare socket path and $KVMAP_TARGET a bare path or unix:// form, `-o wide`
    adds columns, `regions` takes the id `workers` prints, and a target nobody serves is one
    UNAVAILABLE line naming it."""
    daemon, _ = served
    for args in (["workers", "--json"], ["workers", "-o", "json", "--target", daemon.socket]):
        out = ctl(*args, target=daemon.socket)
        assert out.returncode == 0, out.stderr
        assert [w["worker"]["engine_id"] for w in json.loads(out.stdout)["workers"]] == ["engine-x"]
    plain = ctl("workers", target=f"unix://{daemon.socket}")
    wide = ctl("-o", "wide", "workers", target=daemon.socket)
    assert plain.returncode == wide.returncode == 0, plain.stderr + wide.stderr
    assert "baseline" not in plain.stdout and "baseline" in wide.stdout
    printed = plain.stdout.splitlines()[-1].split()[0]
    assert printed == "engine-x/dp0/tp0/pp0"
    regions = ctl("regions", printed, target=daemon.socket)
    assert regions.returncode == 0 and "descriptors  32 in 2 regions" in regions.stdout, regions
    other = ctl("regions", printed, "--tp-rank", "1", target=daemon.socket)
    assert other.returncode == 1 and "NOT_FOUND" in other.stderr and "tp1" in other.stderr

    nowhere = str(daemon.workdir / "nobody.sock")
    gone = ctl("workers", target=nowhere)
    assert gone.returncode == 1 and gone.stderr.startswith("kvmapctl: UNAVAILABLE"), gone
    assert nowhere in gone.stderr and len(gone.stderr.splitlines()) == 1


def test_admin_commands_over_tcp_say_they_need_the_socket(
    served: tuple[DaemonProc, WorkerProc],
) -> None:
    """status, stats and replan given a TCP target exit 2 with one line saying the Admin service is
    served on the Unix socket only, instead of the daemon's UNIMPLEMENTED."""
    daemon, _ = served
    for command in ("status", "stats", "replan", "transfers"):
        out = ctl(command, "--target", daemon.tcp_target)
        assert out.returncode == 2, out
        assert out.stderr.startswith(f"kvmapctl: {command} needs the daemon's Unix socket")
        assert "UNIMPLEMENTED" not in out.stderr and len(out.stderr.splitlines()) == 1


def test_a_closed_pipe_ends_kvmapctl_quietly(served: tuple[DaemonProc, WorkerProc]) -> None:
    """`kvmapctl status -o wide | head -1` with the reader gone before kvmapctl writes: exit 0 and
    nothing on stderr (no BrokenPipe traceback)."""
    daemon, _ = served
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before kvmapctl writes a byte
    proc = subprocess.run(
        [*CTL, "status", "-o", "wide", "--target", daemon.socket],
        stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60, check=False,
    )  # fmt: skip
    os.close(write_end)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_tls_flags_reach_a_daemon_serving_tls(tmp_path: Path) -> None:
    """Against a daemon serving TLS on its TCP port, kvmapctl with --tls-ca (and the peer secret
    that port asks for) lists the workers; without --tls-ca it cannot connect (UNAVAILABLE), and
    TLS flags with a Unix socket target are refused as a usage error."""
    ca, cert, key = _tls_files(tmp_path)
    secret = new_peer_secret(tmp_path)
    daemon = start_daemon(
        tmp_path / "d",
        *("--peer-secret-file", str(secret), "--tls-cert", str(cert), "--tls-key", str(key)),
    )
    try:
        auth = ["--target", daemon.tcp_target, "--peer-secret-file", str(secret)]
        ok = ctl("workers", *auth, "--tls-ca", str(ca), "-o", "json")
        assert ok.returncode == 0, ok.stderr
        assert json.loads(ok.stdout)["daemon_instance"] == daemon.instance
        plain = ctl("workers", *auth, "--timeout", "3")
        assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr, plain
        local = ctl("workers", "--target", daemon.socket, "--tls-ca", str(ca))
        assert local.returncode == 2 and "for TCP targets" in local.stderr, local
    finally:
        assert daemon.terminate() == 0, daemon.log()


def _tls_files(directory: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 it signed: (ca, cert, key) PEM paths."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key, leaf_key = (
        ec.generate_private_key(ec.SECP256R1()),
        ec.generate_private_key(ec.SECP256R1()),
    )
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvmapctl test CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvmapd")]))
        .issuer_name(ca_name).public_key(leaf_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    paths = directory / "ca.pem", directory / "cert.pem", directory / "key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        leaf_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return paths
