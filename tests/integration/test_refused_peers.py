"""A daemon whose peers are refused says so where its operator looks, with
real daemons: ``kvmapctl status`` (Admin.GetStatus) on the daemon that
refuses (no peer authentication configured, or callers without its secret:
how many, the latest and why) and on the daemon refused (its pulls, among
the recent errors), and the connector's failed-load warning, which names
the cause and the fix for the error the decode daemon really returns."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvmap.client.connector.fixes import fix_for
from kvmap.core.peer_policy import INBOUND_DENIED, OUTBOUND_DENIED
from kvmap.tools.grants import granted
from kvmap.tools.launch import DaemonProc, start_daemon, start_worker
from kvmap.tools.peers import peer_channel
from kvmap.v1 import peer_pb2, peer_pb2_grpc, types_pb2

pytestmark = pytest.mark.integration

GEO = ("--blocks", "8", "--block-tokens", "16", "--mla-layers", "2", "--indexer-layers", "1")
CTL = [sys.executable, "-m", "kvmap.daemon.cli.kvmapctl"]


def ctl(daemon: DaemonProc, *args: str) -> str:
    out = subprocess.run(
        [*CTL, "status", "--target", daemon.socket, *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout


def status(daemon: DaemonProc) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(ctl(daemon, "-o", "json"))
    return body


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[list[DaemonProc]]:
    started: list[DaemonProc] = []
    yield started
    for d in started:
        assert d.terminate() == 0, d.log()


def test_a_daemon_without_peer_authentication_says_so_and_its_peers_hear_the_fix(
    tmp_path: Path, daemons: list[DaemonProc]
) -> None:
    """A prefill daemon started as docs/vllm.md once showed it (no --peer-secret-file, no
    mutual TLS) refuses a decode daemon's pull: the pull fails PERMISSION_DENIED with the
    refusal; the connector's warning for that very error names --peer-secret-file; the
    prefill's status reports no peer authentication, the refused calls and the fix; the decode
    daemon's status reports that a remote daemon refused it, with the same fix."""
    prefill = start_daemon(tmp_path / "p", "--peer-secret-file", "", name="prefill")
    daemons.append(prefill)
    decode = start_daemon(tmp_path / "d", name="decode")  # the harness's shared secret
    daemons.append(decode)
    pw = start_worker(prefill, "prefill", *GEO, "--fill")
    dw = start_worker(decode, "decode", *GEO)
    try:
        answer = dw.call(
            granted(
                pw,
                {
                    "cmd": "pull",
                    "request_id": "refused-1",
                    "remote_target": prefill.tcp_target,
                    "remote_worker": {"engine_id": "prefill"},
                    "groups": [{"group": 0, "local": [1], "remote": [2]}],
                },
            )
        )
    finally:
        pw.stop()
        dw.stop()
    assert not answer["ok"] and answer["code"] == "PERMISSION_DENIED", answer
    assert INBOUND_DENIED in answer["message"], answer
    fix = fix_for(answer["message"])
    assert "does not accept this pod's kvmapd as a peer" in fix
    assert "--peer-secret-file" in fix and "mutual TLS" in fix

    owner = status(prefill)
    assert owner["peer_authentication"] == "PEER_AUTHENTICATION_NONE"
    assert int(owner["peer_calls_refused"]) >= 1
    assert owner["last_peer_refusal"]["reason"].startswith("no peer authentication")
    assert owner["last_peer_refusal"]["peer"].startswith("ipv4:127.0.0.1:")
    table = ctl(prefill)
    assert "peers: NO PEER AUTHENTICATION" in table, table
    assert "fix: start every kvmapd with the same --peer-secret-file" in table, table
    assert "peer_refused" in prefill.log() and "no peer authentication" in prefill.log()

    puller = status(decode)
    assert puller["peer_authentication"] == "PEER_AUTHENTICATION_PEER_SECRET"
    assert puller["peer_calls_refused"] in (None, "0") or "peer_calls_refused" not in puller
    table = ctl(decode)
    assert "peers: authenticated by peer secret; 0 calls refused" in table, table
    assert "peers: remote daemons refused 1 recent calls of this daemon" in table, table
    assert "fix: start every kvmapd with the same --peer-secret-file" in table, table


def _metadata(target: str, secret: str) -> grpc.StatusCode:
    with peer_channel(target, secret) as ch:
        try:
            peer_pb2_grpc.PeerStub(ch).GetAgentMetadata(
                peer_pb2.GetAgentMetadataRequest(worker=types_pb2.WorkerId(engine_id="none")),
                timeout=10,
            )
        except grpc.RpcError as err:
            return err.code()
    return grpc.StatusCode.OK


def test_a_daemon_with_a_secret_counts_refused_callers_and_says_why(
    tmp_path: Path, daemons: list[DaemonProc]
) -> None:
    """A daemon with a peer secret reports it and no refusal at first; a caller without a secret
    and one with another secret are each refused and counted, the status naming the latest
    caller and why, with the fix; an authorized caller is not counted."""
    d = start_daemon(tmp_path / "s", name="s")
    daemons.append(d)
    assert "peers: authenticated by peer secret; 0 calls refused" in ctl(d)

    assert _metadata(d.tcp_target, "") is grpc.StatusCode.PERMISSION_DENIED
    assert status(d)["last_peer_refusal"]["reason"] == "presented no peer secret"
    assert _metadata(d.tcp_target, "x" * 43) is grpc.StatusCode.PERMISSION_DENIED
    # Authorized: past the check (no such worker), not counted.
    assert _metadata(d.tcp_target, d.secret) is grpc.StatusCode.NOT_FOUND

    st = status(d)
    assert st["peer_authentication"] == "PEER_AUTHENTICATION_PEER_SECRET"
    assert st["peer_calls_refused"] == "2"
    assert st["last_peer_refusal"]["reason"] == "presented another peer secret"
    table = ctl(d)
    assert "peers: authenticated by peer secret; 2 calls refused; last " in table, table
    assert "presented another peer secret" in table, table
    assert "a refused peer daemon cannot load from this one: start every kvmapd" in table, table


def test_the_connector_names_the_fix_only_for_peer_configuration() -> None:
    """The cause and fix the connector appends: for an owner's refusal of this daemon as a
    peer, as the decode daemon words it; for a target this daemon may not dial; nothing for
    any other failure."""
    refused = f"PERMISSION_DENIED: remote daemon 10.0.0.7:50051: {INBOUND_DENIED}"
    assert "--peer-secret-file" in fix_for(refused)
    assert "--peer-allow" in fix_for(f"PERMISSION_DENIED: {OUTBOUND_DENIED}")
    assert fix_for("PERMISSION_DENIED: the capability does not grant this transfer") == ""
    assert fix_for("UNAVAILABLE: remote daemon 10.0.0.7:50051: no connection") == ""
