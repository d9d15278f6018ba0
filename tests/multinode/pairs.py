"""An owner (a prefill kvmapd and its worker, blocks filled with the known
pattern) and decode peers, each on a node of a test bed, and the pulls
between them, for the multi-node tests."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmap.tools.churn import BED_PEER_FLAGS, GEOMETRY, pull_command
from kvmap.tools.grants import granted
from kvmap.tools.launch import DaemonProc, WorkerProc, start_daemon, start_worker
from kvmap.tools.netbed import NetBed, Node
from kvmap.v1 import admin_pb2, admin_pb2_grpc

# The decode daemons' transfer deadline: every failed pull ends within it.
TIMEOUT_S = 4.0
# Slack on top of a deadline for the answer's way back (processes on 2
# cores): less than the 3 s a failed pull once spent telling the vanished
# owner it was over (peer_client.end), so that such a wait fails the test.
SLACK_S = 2.0
# The owner's TCP port: a node's namespace has its ports to itself.
OWNER_PORT = 47000
# Bytes a pull of churn.pull_command moves at this rate take a few seconds:
# a fault can be made while the read is in flight.
SLOW_KBIT = 2000
FAILED_CODES = ("UNAVAILABLE", "DEADLINE_EXCEEDED")
# The phases a transfer's error names (engine/transfers.py, its stages).
PHASES = ("handshake", "BeginTransfer", "NIXL", "planning", "starting", "release")


@dataclass
class Peer:
    node: Node
    daemon: DaemonProc
    worker: WorkerProc

    def stop(self) -> None:
        self.worker.kill()
        self.daemon.kill()


@dataclass
class Pulls:
    """Pulls from ``owner`` by ``peer`` commands, with the owner's grants."""

    owner: Peer
    rng: random.Random = field(default_factory=lambda: random.Random(7))
    count: int = 0

    def command(self, timeout_s: float = 0.0) -> dict[str, Any]:
        self.count += 1
        cmd = pull_command(self.rng, f"mn-{self.count}", self.owner.daemon)
        if timeout_s:
            cmd["timeout_ms"] = int(timeout_s * 1000)
        return granted(self.owner.worker, cmd)

    def pull(self, peer: Peer, timeout_s: float = 0.0) -> tuple[dict[str, Any], float]:
        """The answer and the seconds it took."""
        cmd = self.command(timeout_s)
        started = time.monotonic()
        answer = peer.worker.call(cmd, timeout=TIMEOUT_S + 60)
        return answer, time.monotonic() - started


def start_owner(bed: NetBed, tmp: Path, name: str = "owner", *flags: str) -> Peer:
    node = bed.nodes.get(name) or bed.add_node(name)
    daemon = start_daemon(
        tmp / name, *BED_PEER_FLAGS, *flags, name="p", node=node, listen=f"0.0.0.0:{OWNER_PORT}"
    )
    return Peer(node, daemon, start_worker(daemon, "prefill", *GEOMETRY, "--fill"))


def start_decode(bed: NetBed, tmp: Path, name: str, *flags: str) -> Peer:
    node = bed.add_node(name)
    daemon = start_daemon(
        tmp / name,
        *BED_PEER_FLAGS,
        "--transfer-timeout-s",
        str(TIMEOUT_S),
        *flags,
        name="d",
        node=node,
    )
    return Peer(node, daemon, start_worker(daemon, name, *GEOMETRY))


class InFlight(threading.Thread):
    """A pull in a thread of its own: ``answer`` and ``seconds`` once joined."""

    def __init__(self, peer: Peer, cmd: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.peer, self.cmd = peer, cmd
        self.answer: dict[str, Any] = {}
        self.seconds = 0.0
        self.start()

    def run(self) -> None:
        started = time.monotonic()
        self.answer = self.peer.worker.call(self.cmd, timeout=TIMEOUT_S + 60)
        self.seconds = time.monotonic() - started

    def result(self) -> tuple[dict[str, Any], float]:
        self.join(TIMEOUT_S + 70)
        assert not self.is_alive(), "the pull never answered"
        return self.answer, self.seconds


def wait_reading(owner: Peer, bound_s: float = 10.0) -> None:
    """Until the owner holds a lease: it accepted the pull's BeginTransfer,
    so the read is posted or about to be (bounded)."""
    deadline = time.monotonic() + bound_s
    while leases(owner.daemon) == 0:
        assert time.monotonic() < deadline, "the owner never began the transfer"
        time.sleep(0.01)


def health(daemon: DaemonProc, timeout_s: float = 2.0) -> str:
    """The daemon's gRPC health, on its Unix socket, within ``timeout_s``."""
    with grpc.insecure_channel(daemon.unix_target) as ch:
        answer = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(), timeout=timeout_s
        )
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status))


def leases(daemon: DaemonProc) -> int:
    with grpc.insecure_channel(daemon.unix_target) as ch:
        status = admin_pb2_grpc.AdminStub(ch).GetStatus(admin_pb2.GetStatusRequest(), timeout=5)
    return int(status.leases_total)


def wait_no_lease(daemon: DaemonProc, bound_s: float) -> bool:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if leases(daemon) == 0:
            return True
        time.sleep(0.1)
    return False


def failed_naming(answer: dict[str, Any], owner: Peer) -> None:
    """The pull failed with a network status naming the owner and a phase."""
    assert not answer.get("ok"), answer
    assert answer["code"] in FAILED_CODES, answer
    assert owner.daemon.tcp_target in answer["message"], answer
    assert any(p in answer["message"] for p in PHASES), answer


def loaded(answer: dict[str, Any]) -> bool:
    return bool(answer.get("ok")) and answer.get("bad_blocks") == 0
