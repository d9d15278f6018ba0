"""GrantTransfer and RevokeTransfer on the local calls socket, both ends:
the daemon's ``api.local_calls`` server (a real Unix socket, its own event
loop in a thread) and the client's ``LocalCalls.unary``. The grants behind
them are scripted (``Granting``): who the daemon is told calls, what it is
handed, what comes back and when the client must call over gRPC instead
are tested here; real daemons' grants over the socket are in
tests/security/test_socket_group.py and every pull test."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_local_calls_attach import CANNOT_SERVE_HERE, Answering
from test_local_calls_frames import Served, registry_calls

from kvmap.client.transports.local_calls import (
    GRANT_FIELD,
    PULL_FIELD,
    REVOKE_FIELD,
    LocalCalls,
    call_bytes,
)
from kvmap.core.errors import PermissionDenied, Unavailable
from kvmap.daemon.adapters.fd_handoff import PeerCred
from kvmap.daemon.api import local_calls
from kvmap.daemon.api.services import Caller
from kvmap.v1 import registry_pb2, types_pb2

pytestmark = pytest.mark.timeout(60)

WORKER = types_pb2.WorkerId(engine_id="w")
REGISTRY = "kvmap.v1.Registry"
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class Granting:
    """Grants for worker "w" only (anyone else's: PERMISSION_DENIED), each
    call recorded with the caller it was told of and the traceparent."""

    def __init__(self) -> None:
        self.grants: list[tuple[registry_pb2.GrantTransferRequest, PeerCred | None, str]] = []
        self.revokes: list[tuple[registry_pb2.RevokeTransferRequest, PeerCred | None]] = []

    def grant(
        self, request: registry_pb2.GrantTransferRequest, caller: Caller, parent: str
    ) -> registry_pb2.GrantTransferResponse:
        if request.worker.engine_id != "w":
            raise PermissionDenied(
                f"worker {request.worker.engine_id} was registered by another uid"
            )
        self.grants.append((request, caller(), parent))
        return registry_pb2.GrantTransferResponse(
            capability=f"cap-{request.request_id}", generation=3
        )

    def revoke(
        self, request: registry_pb2.RevokeTransferRequest, caller: Caller
    ) -> registry_pb2.RevokeTransferResponse:
        self.revokes.append((request, caller()))
        return registry_pb2.RevokeTransferResponse()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Served, Granting]]:
    granting = Granting()
    s = Served(
        tmp_path / "d.sock.calls",
        registry=registry_calls(grant=granting.grant, revoke=granting.revoke),
    )
    try:
        yield s, granting
    finally:
        s.stop()


def _grant(worker: types_pb2.WorkerId, request_id: str, traceparent: str = "") -> bytes:
    request = registry_pb2.GrantTransferRequest(
        worker=worker,
        request_id=request_id,
        groups=[types_pb2.BlockGrant(transfer_group=0, block_ids=[4, 9])],
        ttl_ms=5000,
    )
    return call_bytes(GRANT_FIELD, request.SerializeToString(), traceparent)


def test_a_grant_is_made_as_the_connecting_uid_and_answered(
    served: tuple[Served, Granting],
) -> None:
    """The daemon's grant is handed the request as sent, the caller's pid
    and uid as the kernel reports them and the caller's traceparent; the
    client gets the response, and the call counts as GrantTransfer OK."""
    s, granting = served
    reply = LocalCalls(s.path).unary(_grant(WORKER, "r1", TRACEPARENT), 10, "granted")
    assert reply is not None and reply.granted.capability == "cap-r1"
    assert reply.granted.generation == 3
    [(request, caller, parent)] = granting.grants
    assert request.request_id == "r1" and list(request.groups[0].block_ids) == [4, 9]
    assert request.ttl_ms == 5000
    assert caller == PeerCred(pid=os.getpid(), uid=os.getuid(), gid=os.getgid())
    assert parent == TRACEPARENT
    assert s.rpcs("GrantTransfer", "OK", REGISTRY) == 1


def test_a_refused_grant_raises_its_status_and_the_connection_serves_on(
    served: tuple[Served, Granting],
) -> None:
    """A grant the daemon refuses raises that status (PERMISSION_DENIED
    here), counted under GrantTransfer; the same connection then carries the
    next call (a revoke), which is made as the same caller."""
    s, granting = served
    calls = LocalCalls(s.path)
    stranger = types_pb2.WorkerId(engine_id="someone-else")
    with pytest.raises(PermissionDenied, match="registered by another uid"):
        calls.unary(_grant(stranger, "r2"), 10, "granted")
    assert s.rpcs("GrantTransfer", "PERMISSION_DENIED", REGISTRY) == 1
    assert granting.grants == []
    revoke = registry_pb2.RevokeTransferRequest(worker=WORKER, request_id="r2")
    frame = call_bytes(REVOKE_FIELD, revoke.SerializeToString(), "")
    reply = calls.unary(frame, 10, "revoked")
    assert reply is not None and reply.WhichOneof("reply") == "revoked"
    [(request, caller)] = granting.revokes
    assert request.request_id == "r2" and caller is not None and caller.uid == os.getuid()
    assert s.connections() == 1


@CANNOT_SERVE_HERE
def test_a_daemon_that_cannot_serve_it_here_sends_the_grant_to_grpc(
    tmp_path: Path, answer: bytes, close: bool
) -> None:
    """A daemon with no room, or one that predates grants on this socket
    (INVALID_ARGUMENT: the frame names no call it knows): ``unary`` answers
    None, and the transport then grants over gRPC."""
    daemon = Answering(tmp_path / "d.sock.calls", answer, close)
    try:
        assert (
            LocalCalls(str(tmp_path / "d.sock.calls")).unary(_grant(WORKER, "r"), 10, "granted")
            is None
        )
        assert daemon.calls == 1
    finally:
        daemon.stop()


def test_a_reply_that_is_not_the_calls_is_unavailable(tmp_path: Path) -> None:
    """A daemon that answers a grant with anything but one ``granted`` reply
    broke the protocol: UNAVAILABLE, never a made-up response."""
    wrong = local_calls.frame(
        local_calls.local_calls_pb2.LocalReply(revoked=registry_pb2.RevokeTransferResponse())
    )
    daemon = Answering(tmp_path / "d.sock.calls", wrong + local_calls.end_frame(0), False)
    try:
        with pytest.raises(Unavailable, match="no granted reply"):
            LocalCalls(str(tmp_path / "d.sock.calls")).unary(_grant(WORKER, "r"), 10, "granted")
    finally:
        daemon.stop()


def test_no_socket_sends_the_grant_to_grpc(tmp_path: Path) -> None:
    """Nothing listening: ``unary`` answers None."""
    assert (
        LocalCalls(str(tmp_path / "none.calls")).unary(_grant(WORKER, "r"), 10, "granted") is None
    )


def test_a_pull_frame_is_not_taken_for_a_grant(served: tuple[Served, Granting]) -> None:
    """The kind of call is the frame's, not the caller's expectation: a pull
    frame sent through ``unary`` runs as a pull (the scripted transfer), and
    its statuses are not a ``granted`` reply: UNAVAILABLE, nothing granted."""
    s, granting = served
    frame = call_bytes(PULL_FIELD, b"", "")
    with pytest.raises(Unavailable, match="no granted reply"):
        LocalCalls(s.path).unary(frame, 10, "granted")
    assert granting.grants == []
