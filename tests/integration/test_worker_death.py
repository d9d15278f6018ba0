"""A worker that dies (kill -9) leaves nothing behind in its daemon: no
mapping, no file descriptor, no NIXL registration, no region map; and a
daemon told to stop drains in-flight transfers and exits 0."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmap.tools.launch import DaemonProc, start_daemon, start_worker
from kvmap.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    peer_pb2,
    peer_pb2_grpc,
    transfers_pb2,
    transfers_pb2_grpc,
    types_pb2,
)

pytestmark = pytest.mark.integration

GEO = ("--blocks", "32", "--block-tokens", "32", "--mla-layers", "4", "--indexer-layers", "2")


def stats(daemon: DaemonProc) -> admin_pb2.GetStatsResponse:
    with daemon.channel() as ch:
        return admin_pb2_grpc.AdminStub(ch).GetStats(admin_pb2.GetStatsRequest(), timeout=10)


def daemon_holds(daemon_pid: int, worker_pid: int) -> dict[str, list[str]]:
    needle = f"/torch_{worker_pid}_"
    with open(f"/proc/{daemon_pid}/maps") as f:
        maps = [line.strip() for line in f if needle in line]
    fds = []
    for name in os.listdir(f"/proc/{daemon_pid}/fd"):
        try:
            target = os.readlink(f"/proc/{daemon_pid}/fd/{name}")
        except OSError:
            continue
        if needle in target:
            fds.append(target)
    return {"maps": maps, "fds": fds}


def test_kill9_worker_releases_everything(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path / "d")
    worker = start_worker(daemon, "victim", *GEO)
    held = daemon_holds(daemon.proc.pid, worker.pid)
    # One mapping per allocation; fds: the mapping's own and Python mmap's dup.
    assert len(held["maps"]) == 2 and len(held["fds"]) >= 2, held
    s = stats(daemon)
    assert (s.workers, s.mapped_allocations, s.nixl_registrations) == (1, 2, 2)

    worker.kill()
    deadline = time.monotonic() + 10
    while stats(daemon).workers:
        assert time.monotonic() < deadline, "worker still registered 10 s after kill -9"
        time.sleep(0.05)
    s = stats(daemon)
    assert (s.workers, s.mapped_allocations, s.nixl_registrations, s.mapped_bytes) == (0, 0, 0, 0)
    assert daemon_holds(daemon.proc.pid, worker.pid) == {"maps": [], "fds": []}
    with daemon.channel(tcp=True) as ch, pytest.raises(grpc.RpcError) as err:
        peer_pb2_grpc.PeerStub(ch).GetAgentMetadata(
            peer_pb2.GetAgentMetadataRequest(worker=types_pb2.WorkerId(engine_id="victim")),
            timeout=10,
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert daemon.terminate() == 0, daemon.log()


def test_sigterm_drains_in_flight_transfers_and_exits_0(tmp_path: Path) -> None:
    prefill = start_daemon(tmp_path / "p", name="prefill")
    pw = start_worker(prefill, "prefill", *GEO, "--fill")
    decode = start_daemon(tmp_path / "q", "--drain-seconds", "20", name="decode")
    dw = start_worker(decode, "decode", *GEO)
    pull: dict[str, Any] = {
        "cmd": "pull",
        "remote_target": prefill.tcp_target,
        "remote_worker": {"engine_id": "prefill"},
        "groups": [{"group": 0, "local": list(range(32)), "remote": list(range(32))}],
    }
    assert dw.call({**pull, "request_id": "warm-up"})["ok"]
    results: list[dict[str, Any]] = []
    # Freeze the owner so the next pull is caught in flight.
    os.kill(prefill.proc.pid, signal.SIGSTOP)
    try:
        thread = threading.Thread(
            target=lambda: results.append(dw.call({**pull, "request_id": "in-flight"}))
        )
        thread.start()
        time.sleep(0.3)
        os.kill(decode.proc.pid, signal.SIGTERM)
        time.sleep(0.3)
        assert decode.proc.poll() is None, "exited with a transfer in flight"
        with grpc.insecure_channel(decode.tcp_target) as ch:
            status = (
                health_pb2_grpc.HealthStub(ch)
                .Check(health_pb2.HealthCheckRequest(service="kvmap.v1.Peer"), timeout=5)
                .status
            )
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        # New transfers are refused while draining.
        with decode.channel() as ch:
            spec = transfers_pb2.TransferSpec(
                request_id="late",
                local_worker=types_pb2.WorkerId(engine_id="decode"),
                remote_target=prefill.tcp_target,
                remote_worker=types_pb2.WorkerId(engine_id="prefill"),
            )
            spec.groups.add(transfer_group=0, local_block_ids=[0], remote_block_ids=[0])
            with pytest.raises(grpc.RpcError) as err:
                list(
                    transfers_pb2_grpc.TransfersStub(ch).Pull(
                        transfers_pb2.PullRequest(spec=spec), timeout=5
                    )
                )
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        os.kill(prefill.proc.pid, signal.SIGCONT)
    thread.join(30)
    assert decode.proc.wait(30) == 0, decode.log()
    assert results and results[0]["ok"] and results[0]["bad_blocks"] == 0, results
    dw.kill()
    pw.stop()
    assert prefill.terminate() == 0, prefill.log()
