"""Pull and Push over ``GrpcTransport``: the client serializes the request
straight from the spec and reads the answer stream on its own thread; what
reaches the daemon, and what the caller gets back, must be exactly what
building a ``PullRequest``/``PushRequest`` gave. A real gRPC server on a
Unix socket stands in for the daemon's Transfers service (only the service
is fake: the channel, the wire and the client are the real ones)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmap.client.client import KvmapClient
from kvmap.client.errors import OtherStatus
from kvmap.client.transports.wire import spec_request_bytes
from kvmap.core.errors import DeadlineExceeded, PermissionDenied
from kvmap.v1 import transfers_pb2, transfers_pb2_grpc, types_pb2

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)


@st.composite
def specs(draw: st.DrawFn) -> transfers_pb2.TransferSpec:
    spec = transfers_pb2.TransferSpec(
        request_id=draw(st.text(max_size=40)),
        remote_target=draw(st.text(max_size=20)),
        capability=draw(st.text(max_size=300)),
        local_worker=types_pb2.WorkerId(engine_id=draw(st.text(max_size=10))),
    )
    for _ in range(draw(st.integers(0, 3))):
        spec.groups.add(
            transfer_group=draw(st.integers(0, 2**31 - 1)),
            local_block_ids=draw(st.lists(INT64, max_size=300)),
            remote_block_ids=draw(st.lists(INT64, max_size=300)),
        )
    return spec


@given(specs())
def test_spec_request_bytes_are_the_request_messages_bytes(
    spec: transfers_pb2.TransferSpec,
) -> None:
    """The bytes sent for a spec are those of PullRequest(spec=spec) and of
    PushRequest(spec=spec), for any spec (empty, long, negative ids, bodies
    whose length needs a multi-byte varint), and parse back to that spec."""
    wire = spec_request_bytes(spec)
    assert wire == transfers_pb2.PullRequest(spec=spec).SerializeToString()
    assert wire == transfers_pb2.PushRequest(spec=spec).SerializeToString()
    assert transfers_pb2.PullRequest.FromString(wire).spec == spec


def _status(state: int, nbytes: int = 0) -> transfers_pb2.TransferStatus:
    return transfers_pb2.TransferStatus(
        state=state, stats=transfers_pb2.TransferStats(bytes=nbytes)
    )


class Transfers(transfers_pb2_grpc.TransfersServicer):
    """Records each request; request_id "hold" answers POSTED, then waits
    until ``release`` is set; Push is refused."""

    def __init__(self) -> None:
        self.requests: list[object] = []
        self.holding = threading.Event()
        self.release = threading.Event()

    def Pull(  # noqa: N802  (the gRPC method's name)
        self, request: transfers_pb2.PullRequest, context: grpc.ServicerContext
    ) -> Iterator[transfers_pb2.PullResponse]:
        self.requests.append(request)
        yield transfers_pb2.PullResponse(status=_status(transfers_pb2.TRANSFER_STATE_POSTED))
        if request.spec.request_id == "hold":
            self.holding.set()
            self.release.wait()
            return
        done = _status(transfers_pb2.TRANSFER_STATE_DONE, 4096 * len(request.spec.groups))
        yield transfers_pb2.PullResponse(status=done)

    def Push(  # noqa: N802
        self, request: transfers_pb2.PushRequest, context: grpc.ServicerContext
    ) -> Iterator[transfers_pb2.PushResponse]:
        self.requests.append(request)
        context.abort(grpc.StatusCode.PERMISSION_DENIED, "no grant for this push")
        yield transfers_pb2.PushResponse()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[tuple[Transfers, str]]:
    service = Transfers()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    transfers_pb2_grpc.add_TransfersServicer_to_server(service, server)
    socket = str(tmp_path / "kvmapd.sock")
    server.add_insecure_port(f"unix://{socket}")
    server.start()
    yield service, socket
    service.release.set()
    server.stop(0)


def _spec(request_id: str) -> transfers_pb2.TransferSpec:
    spec = transfers_pb2.TransferSpec(request_id=request_id, capability="cap")
    spec.groups.add(transfer_group=0, local_block_ids=[5, 2**40], remote_block_ids=[7, 0])
    spec.groups.add(
        transfer_group=3, local_block_ids=list(range(4096)), remote_block_ids=[1] * 4096
    )
    return spec


def test_pull_sends_the_pull_request_and_answers_done(daemon: tuple[Transfers, str]) -> None:
    """The daemon receives exactly PullRequest(spec=spec), the caller's spec
    is left as it was, and the DONE status's stats come back."""
    service, socket = daemon
    client = KvmapClient.connect(socket)
    spec = _spec("r1")
    before = spec.SerializeToString()
    result = client.pull(spec, timeout_s=30)
    client.close()
    assert service.requests == [transfers_pb2.PullRequest(spec=_spec("r1"))]
    assert spec.SerializeToString() == before
    assert result.bytes == 2 * 4096


def test_push_sends_the_push_request_and_maps_its_status(daemon: tuple[Transfers, str]) -> None:
    """Push sends PushRequest(spec=spec); the daemon's status becomes the
    typed error with the daemon's message."""
    service, socket = daemon
    client = KvmapClient.connect(socket)
    with pytest.raises(PermissionDenied, match=r"^PERMISSION_DENIED: no grant for this push$"):
        client.push(_spec("w1"), timeout_s=30)
    client.close()
    assert service.requests == [transfers_pb2.PushRequest(spec=_spec("w1"))]


def test_pull_past_its_deadline_is_deadline_exceeded(daemon: tuple[Transfers, str]) -> None:
    """A transfer still running at the caller's deadline ends in
    DeadlineExceeded, not a hang."""
    _, socket = daemon
    client = KvmapClient.connect(socket)
    with pytest.raises(DeadlineExceeded, match=r"^DEADLINE_EXCEEDED: "):
        client.pull(_spec("hold"), timeout_s=0.5)
    client.close()


def test_closing_the_client_ends_a_pull_in_flight(daemon: tuple[Transfers, str]) -> None:
    """Closing the client while another thread waits in pull ends that pull
    with CANCELLED, as a shutting-down connector needs."""
    service, socket = daemon
    client = KvmapClient.connect(socket)
    errors: list[BaseException] = []

    def pull() -> None:
        try:
            client.pull(_spec("hold"), timeout_s=60)
        except OtherStatus as err:
            errors.append(err)

    puller = threading.Thread(target=pull)
    puller.start()
    assert service.holding.wait(timeout=30)
    client.close()
    puller.join(timeout=30)
    assert not puller.is_alive()
    assert [e.status for e in errors if isinstance(e, OtherStatus)] == ["CANCELLED"]
