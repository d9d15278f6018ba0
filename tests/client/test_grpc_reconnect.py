"""``GrpcTransport``'s unary calls across a daemon restart on the same Unix
socket. A real gRPC server stands in for kvmapd's Admin service (only the
service is a stand-in: the channel, the socket and the client are real)."""

from __future__ import annotations

import os
import socket as sockets
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from kvmap.client.transports.grpc import GrpcTransport, daemon_listening
from kvmap.core.errors import Unavailable
from kvmap.v1 import admin_pb2, admin_pb2_grpc

pytestmark = pytest.mark.timeout(60)


class Admin(admin_pb2_grpc.AdminServicer):
    """Counts GetStats calls; ``draining`` answers them UNAVAILABLE, as a
    kvmapd that is shutting down does."""

    def __init__(self, *, draining: bool = False) -> None:
        self.calls = 0
        self.draining = draining
        self._lock = threading.Lock()

    def GetStats(  # noqa: N802  (the gRPC method's name)
        self, request: admin_pb2.GetStatsRequest, context: grpc.ServicerContext
    ) -> admin_pb2.GetStatsResponse:
        with self._lock:
            self.calls += 1
        if self.draining:
            context.abort(grpc.StatusCode.UNAVAILABLE, "kvmapd is shutting down")
        return admin_pb2.GetStatsResponse(workers=3)


def serve(socket: str, service: Admin) -> grpc.Server:
    if os.path.exists(socket):
        os.unlink(socket)  # what a restarted kvmapd does with its predecessor's
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    admin_pb2_grpc.add_AdminServicer_to_server(service, server)
    server.add_insecure_port(f"unix://{socket}")
    server.start()
    return server


@pytest.fixture
def socket(tmp_path: Path) -> Iterator[str]:
    yield str(tmp_path / "kvmapd.sock")


def test_a_call_at_once_after_the_daemon_is_back_succeeds(socket: str) -> None:
    """Calls fail (UNAVAILABLE) while the daemon is down; the first call
    after a new daemon listens on the socket is answered by it, though the
    channel was still waiting out the reconnect backoff those failures
    built up."""
    first = serve(socket, Admin())
    transport = GrpcTransport(socket)
    try:
        assert transport.get_stats(10).workers == 3
        first.stop(None).wait()
        for _ in range(12):
            with pytest.raises(Unavailable):
                transport.get_stats(10)
            threading.Event().wait(0.05)
        back = Admin()
        second = serve(socket, back)
        try:
            assert transport.get_stats(10).workers == 3
            assert back.calls == 1
        finally:
            second.stop(None)
    finally:
        transport.close()


def test_a_call_to_a_daemon_that_is_down_fails_at_once(socket: str) -> None:
    """Nobody listening: UNAVAILABLE straight away, never a wait for the
    channel until the deadline (DEADLINE_EXCEEDED): vLLM's scheduler calls
    these and must not stall on a missing sidecar."""
    transport = GrpcTransport(socket)
    try:
        assert not daemon_listening(socket)
        with pytest.raises(Unavailable):
            transport.get_stats(30)
        Path(socket).touch()  # a stale file where the socket was: still down
        assert not daemon_listening(socket)
        with pytest.raises(Unavailable):
            transport.get_stats(30)
    finally:
        transport.close()


def test_a_daemon_that_answers_unavailable_is_asked_once_more_only(socket: str) -> None:
    """A listening daemon's own UNAVAILABLE (it is draining) is retried once,
    and the caller then gets the daemon's status and message."""
    draining = Admin(draining=True)
    server = serve(socket, draining)
    transport = GrpcTransport(socket)
    try:
        assert daemon_listening(socket)
        with pytest.raises(Unavailable, match="kvmapd is shutting down"):
            transport.get_stats(10)
        assert draining.calls == 2
    finally:
        transport.close()
        server.stop(None)


def test_a_daemon_that_listens_but_does_not_answer_yet_is_unavailable(socket: str) -> None:
    """A socket that accepts connections but speaks no gRPC yet (a daemon
    between binding and serving, or too busy to shake hands): the retry waits
    boundedly for a connection and then reports the daemon UNAVAILABLE, as
    the first attempt found it, never DEADLINE_EXCEEDED while the caller's
    own deadline (30 s) is far from spent."""
    transport = GrpcTransport(socket)
    listener = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
    try:
        with pytest.raises(Unavailable):
            transport.get_stats(30)  # nobody there: the channel now backs off
        listener.bind(socket)
        listener.listen(8)  # connections queue in the backlog, never accepted
        assert daemon_listening(socket)
        with pytest.raises(Unavailable):
            transport.get_stats(30)
    finally:
        listener.close()
        transport.close()
