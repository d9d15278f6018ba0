"""A worker that dies (kill -9) leaves nothing behind in its daemon: no
mapping, no file descriptor, no NIXL registration, no region map; and a
daemon told to stop drains in-flight transfers and exits 0."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmap.tools.grants import grant, granted
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
    needle = f"/memfd:kvmap-kv-{worker_pid}-"  # kvmap.client.shm_export's sealed memfds
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


def wait_for(predicate: Callable[[], object], timeout: float, what: str) -> None:
    """Wait for ``predicate`` (an event the test observes), failing after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_kill9_worker_releases_everything(tmp_path: Path) -> None:
    """After kill -9 of its worker, the daemon forgets it (the test waits for
    that event) and holds nothing of it: no mapping or fd of its memory, no
    NIXL registration, no mapped bytes; peers get NOT_FOUND for it."""
    daemon = start_daemon(tmp_path / "d")
    worker = start_worker(daemon, "victim", *GEO)
    held = daemon_holds(daemon.proc.pid, worker.pid)
    # One mapping per allocation; fds: the mapping's own and Python mmap's dup.
    assert len(held["maps"]) == 2 and len(held["fds"]) >= 2, held
    s = stats(daemon)
    assert (s.workers, s.mapped_allocations, s.nixl_registrations) == (1, 2, 2)

    worker.kill()

    def released() -> bool:
        # The worker leaves the table first (no new transfer finds it), and
        # its registrations and mappings go once no transfer pins them.
        s = stats(daemon)
        return (s.workers, s.mapped_allocations, s.nixl_registrations, s.mapped_bytes) == (
            0, 0, 0, 0,
        )  # fmt: skip

    wait_for(released, 30, "the daemon to forget the killed worker and release its memory")
    assert daemon_holds(daemon.proc.pid, worker.pid) == {"maps": [], "fds": []}
    with daemon.channel(tcp=True) as ch, pytest.raises(grpc.RpcError) as err:
        peer_pb2_grpc.PeerStub(ch).GetAgentMetadata(
            peer_pb2.GetAgentMetadataRequest(worker=types_pb2.WorkerId(engine_id="victim")),
            timeout=10,
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert daemon.terminate() == 0, daemon.log()


def bytes_unread_at(port: int) -> int:
    """Bytes that arrived on established TCP connections to local ``port`` and
    that the process owning them has not read (``rx_queue`` in /proc/net)."""
    total = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            fields = row.split()
            local, state, queues = fields[1], fields[3], fields[4]
            if state == "01" and int(local.rsplit(":", 1)[1], 16) == port:  # ESTABLISHED
                total += int(queues.split(":")[1], 16)
    return total


# More than any HTTP/2 control frame (PING 17, WINDOW_UPDATE 13 bytes), less
# than a BeginTransfer call (HEADERS, then DATA with agent names and ids).
REQUEST_BYTES = 64


def peer_health(daemon: DaemonProc) -> int:
    with grpc.insecure_channel(daemon.tcp_target) as ch:
        return int(
            health_pb2_grpc.HealthStub(ch)
            .Check(health_pb2.HealthCheckRequest(service="kvmap.v1.Peer"), timeout=5)
            .status
        )


def test_sigterm_drains_in_flight_transfers_and_exits_0(tmp_path: Path) -> None:
    """SIGTERM with a pull in flight (its owner frozen mid-request): the daemon
    stops serving (health NOT_SERVING, new pulls refused as shutting down) but
    stays up until the in-flight pull has finished with verified bytes, then
    exits 0."""
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
    assert dw.call(granted(pw, {**pull, "request_id": "warm-up"}))["ok"]
    # Granted before the owner is frozen (a frozen daemon grants nothing).
    in_flight = granted(pw, {**pull, "request_id": "in-flight"})
    late = grant(pw, "late", [{"group": 0, "blocks": [0]}])
    prefill_port = int(prefill.tcp_target.rsplit(":", 1)[1])
    results: list[dict[str, Any]] = []
    # Freeze the owner so the next pull is caught in flight.
    os.kill(prefill.proc.pid, signal.SIGSTOP)
    try:
        unread = bytes_unread_at(prefill_port)
        thread = threading.Thread(target=lambda: results.append(dw.call(in_flight)))
        thread.start()
        # The pull's BeginTransfer reached the frozen owner: it is in flight.
        wait_for(
            lambda: bytes_unread_at(prefill_port) >= unread + REQUEST_BYTES,
            30,
            "the in-flight pull's request to reach the frozen owner",
        )
        os.kill(decode.proc.pid, signal.SIGTERM)
        wait_for(
            lambda: peer_health(decode) == health_pb2.HealthCheckResponse.NOT_SERVING,
            30,
            "the daemon to start draining",
        )
        # New transfers are refused while draining, by the daemon itself.
        with decode.channel() as ch:
            spec = transfers_pb2.TransferSpec(
                request_id="late",
                local_worker=types_pb2.WorkerId(engine_id="decode"),
                remote_target=prefill.tcp_target,
                remote_worker=types_pb2.WorkerId(engine_id="prefill"),
                capability=late,
            )
            spec.groups.add(transfer_group=0, local_block_ids=[0], remote_block_ids=[0])
            with pytest.raises(grpc.RpcError) as err:
                list(
                    transfers_pb2_grpc.TransfersStub(ch).Pull(
                        transfers_pb2.PullRequest(spec=spec), timeout=5
                    )
                )
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in (err.value.details() or ""), err.value
        assert decode.proc.poll() is None, "exited with a transfer in flight"
        assert not results, "the in-flight pull ended while its owner was frozen"
    finally:
        os.kill(prefill.proc.pid, signal.SIGCONT)
    thread.join(30)
    assert decode.proc.wait(30) == 0, decode.log()
    assert results and results[0]["ok"] and results[0]["bad_blocks"] == 0, results
    dw.kill()
    pw.stop()
    assert prefill.terminate() == 0, prefill.log()
