"""A daemon whose fd hand-off listener died says so: health, liveness and
readiness alike, turns NOT_SERVING (the real ``Daemon`` in this process,
health asked over its real TCP port), so that the kubelet restarts it
instead of leaving registrations to hang behind a SERVING probe."""

from __future__ import annotations

import errno
import os
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from inproc_daemon import InprocNetwork, daemon_loop

pytestmark = pytest.mark.timeout(60)

Status = health_pb2.HealthCheckResponse


def _statuses(stub: health_pb2_grpc.HealthStub) -> dict[str, int]:
    names = ("", "kvmap.v1.Peer", "kvmap.v1.RegionMaps")
    return {
        n: stub.Check(health_pb2.HealthCheckRequest(service=n), timeout=10).status for n in names
    }


def test_a_dead_fd_handoff_listener_turns_health_not_serving() -> None:
    """SERVING for all three health names until the fd hand-off server reports its accept loop
    dead (as FdHandoffServer does when accept() fails for good), then NOT_SERVING for all three.
    (Pins the daemon's on_listener_dead wiring; tests/unit/test_fd_handoff_accept.py pins the
    report.)"""
    with InprocNetwork() as net:
        d = net.daemon()
        daemon = d._running()  # the real Daemon: its fd hand-off server reports to it
        with grpc.insecure_channel(d.target) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            assert set(_statuses(stub).values()) == {Status.SERVING}

            async def listener_dies() -> None:
                report = daemon.app.fds.on_listener_dead
                assert report is not None, "the daemon does not listen for a dead listener"
                report(OSError(errno.EBADF, os.strerror(errno.EBADF)))

            daemon_loop().run(listener_dies())
            deadline = time.monotonic() + 10
            while set(_statuses(stub).values()) != {Status.NOT_SERVING}:
                assert time.monotonic() < deadline, _statuses(stub)
                time.sleep(0.05)
