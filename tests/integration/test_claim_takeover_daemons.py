"""Real daemons: a decode kvmapd killed by ``kill -9`` while its pull holds a
grant's claim at the prefill restarts on the same state dir, and its retried
pull, with the same capability, lands verified bytes at once: it names its
previous NIXL agent (kept in its state store) and the prefill hands it the
dead agent's claim. A third party naming that agent without the capability,
or anyone naming an agent that holds no claim, is refused and changes
nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
from test_pending_events import GEO, _wait_until_no_lease

from kvmap.tools.launch import DaemonProc, start_daemon, start_worker
from kvmap.v1 import admin_pb2, admin_pb2_grpc, peer_pb2, peer_pb2_grpc, types_pb2

pytestmark = pytest.mark.integration

PREFILL = types_pb2.WorkerId(engine_id="prefill")


def _begin(
    prefill: DaemonProc,
    grant: dict[str, Any],
    *,
    capability: str,
    peer_agent: str,
    replaces: list[str],
) -> grpc.StatusCode:
    """Peer.BeginTransfer of blocks 5 and 6 as ``peer_agent`` sends it (a
    pull's announcement, before it posts): the status code it got."""
    req = peer_pb2.BeginTransferRequest(
        request_id="r",
        worker=PREFILL,
        generation=grant["generation"],
        agent_name=prefill.agent,
        peer_agent=peer_agent,
        lease_ms=600_000,  # outlives the test: only a take-over ends it
        blocks=2,
        capability=capability,
        groups=[types_pb2.BlockGrant(transfer_group=0, block_ids=[5, 6])],
        replaces_agents=replaces,
    )
    with prefill.channel(tcp=True) as ch:
        try:
            peer_pb2_grpc.PeerStub(ch).BeginTransfer(req, timeout=10)
        except grpc.RpcError as err:
            return err.code()
    return grpc.StatusCode.OK


def _leases(daemon: DaemonProc) -> int:
    with daemon.channel() as ch:
        stats = admin_pb2_grpc.AdminStub(ch).GetStats(admin_pb2.GetStatsRequest(), timeout=10)
    return int(stats.leases)


def test_a_decode_killed_mid_pull_takes_its_claim_over_after_restart(tmp_path: Path) -> None:
    """The decode daemon's agent claims the grant (its BeginTransfer, sent
    with that agent's name as a pull in flight sends it) and the daemon is
    killed by kill -9. A third party naming the dead agent with a forged
    capability, and the capability's holder naming an agent that holds
    nothing, are both PERMISSION_DENIED and the claim stays (the prefill
    keeps its one lease). The decode daemon restarts on its state dir; a
    new decode worker's pull with the same capability succeeds at once with
    every block verified, and the prefill is left with no lease."""
    state = tmp_path / "decode-state"
    prefill = start_daemon(tmp_path / "p", name="prefill")
    decode = start_daemon(tmp_path / "d", "--state-dir", str(state), name="decode")
    restarted: list[DaemonProc] = []
    workers = [start_worker(prefill, "prefill", *GEO, "--fill")]
    try:
        grant = workers[0].call(
            {"cmd": "grant", "request_id": "r", "groups": [{"group": 0, "blocks": [5, 6]}]}
        )
        cap = grant["capability"]
        held = _begin(prefill, grant, capability=cap, peer_agent=decode.agent, replaces=[])
        assert held == grpc.StatusCode.OK
        decode.kill()
        forged = _begin(
            prefill, grant, capability="forged", peer_agent="mallory", replaces=[decode.agent]
        )
        other = _begin(
            prefill, grant, capability=cap, peer_agent="mallory", replaces=["kvmapd-nobody"]
        )
        assert (forged, other) == (grpc.StatusCode.PERMISSION_DENIED,) * 2
        assert _leases(prefill) == 1
        restarted.append(start_daemon(tmp_path / "d", "--state-dir", str(state), name="decode"))
        workers.append(start_worker(restarted[0], "decode", *GEO))
        result = workers[1].call(
            {
                "cmd": "pull",
                "request_id": "r",
                "remote_target": prefill.tcp_target,
                "remote_worker": {"engine_id": "prefill"},
                "groups": [{"group": 0, "local": [0, 1], "remote": [5, 6]}],
                "capability": cap,
            }
        )
        assert result.get("ok") and result["bad_blocks"] == 0, result
        assert result["stats"]["bytes"] > 0
        _wait_until_no_lease(prefill)
        assert "claim_taken_over" in prefill.log()
    finally:
        for w in workers:
            w.stop()
        for d in (*restarted, decode, prefill):
            d.stop()
