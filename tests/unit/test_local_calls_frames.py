"""The local calls socket, both ends: the daemon's ``api.local_calls``
server (on a real Unix socket, its own event loop in a thread) and the
client's ``transports.local_calls.LocalCalls``. The transfer behind a call
is scripted (``Scripted``: what the socket carries, not a transfer, is what
is tested here; real daemons' pulls over it are in
tests/integration/test_local_calls_pulls.py). Raw sockets try what a hostile
socket-group member would send."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmap.client.errors import from_status
from kvmap.client.transports.local_calls import (
    PULL_FIELD,
    PUSH_FIELD,
    LocalCalls,
    call_bytes,
)
from kvmap.client.transports.wire import spec_request_bytes
from kvmap.core.errors import DeadlineExceeded, NotFound, PermissionDenied, Unavailable
from kvmap.daemon.adapters.metrics import Metrics
from kvmap.daemon.api import local_calls
from kvmap.daemon.api.local_calls import AttachEvents, LocalCallsServer, RegistryCalls
from kvmap.daemon.api.services import Caller, TransfersService
from kvmap.v1 import local_calls_pb2, registry_pb2, transfers_pb2

pytestmark = pytest.mark.timeout(60)

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
LENGTH = struct.Struct("<I")


class Scripted:
    """Stands in for ``TransfersService.reports``: the spec's request id
    says what the transfer does."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []
        self.cancelled = threading.Event()
        # "held": DONE was taken from the transfer, which then waits for
        # ``release`` before it ends.
        self.done_taken = threading.Event()
        self.release = threading.Event()

    async def reports(
        self, spec: transfers_pb2.TransferSpec, kind: str, parent: str
    ) -> AsyncIterator[transfers_pb2.TransferStatus]:
        self.calls.append((spec.request_id, kind, parent))
        rid = spec.request_id
        if rid == "missing":
            raise NotFound("worker w is not registered")
        if rid == "refused":
            raise PermissionDenied("no capability")
        if rid == "crash":
            raise RuntimeError("a bug")
        if rid == "hang":
            yield transfers_pb2.TransferStatus(state=transfers_pb2.TRANSFER_STATE_HANDSHAKING)
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        if rid in ("held", "fails-after-done"):
            yield transfers_pb2.TransferStatus(state=transfers_pb2.TRANSFER_STATE_HANDSHAKING)
        yield transfers_pb2.TransferStatus(
            state=transfers_pb2.TRANSFER_STATE_DONE, transfer_id=f"t-{rid}"
        )
        if rid == "held":
            self.done_taken.set()
            while not self.release.is_set():
                await asyncio.sleep(0.01)
        if rid == "fails-after-done":
            raise Unavailable("the owner went away after DONE")


async def _no_workers(
    request: registry_pb2.AttachRequest, caller: Caller
) -> AsyncIterator[registry_pb2.AttachResponse]:
    """An attach for a daemon that knows no worker."""
    raise NotFound(f"worker {request.worker.engine_id}")
    yield registry_pb2.AttachResponse()  # an async generator, as the daemon's


def _no_grant(
    request: registry_pb2.GrantTransferRequest, caller: Caller, parent: str
) -> registry_pb2.GrantTransferResponse:
    raise NotFound(f"worker {request.worker.engine_id}")


def _no_revoke(
    request: registry_pb2.RevokeTransferRequest, caller: Caller
) -> registry_pb2.RevokeTransferResponse:
    raise NotFound(f"worker {request.worker.engine_id}")


def registry_calls(
    attach: AttachEvents = _no_workers,
    grant: Callable[
        [registry_pb2.GrantTransferRequest, Caller, str], registry_pb2.GrantTransferResponse
    ] = _no_grant,
    revoke: Callable[
        [registry_pb2.RevokeTransferRequest, Caller], registry_pb2.RevokeTransferResponse
    ] = _no_revoke,
) -> RegistryCalls:
    """Registry calls for a daemon that knows no worker, but those given."""
    return RegistryCalls(attach=attach, grant=grant, revoke=revoke)


class Served:
    """A LocalCallsServer on its own loop in a thread."""

    def __init__(self, path: Path, registry: RegistryCalls | None = None, **limits: int) -> None:
        self.path = str(path)
        self.script = Scripted()
        self.metrics = Metrics()
        self.failures: list[tuple[str, ...]] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = LocalCallsServer(
            cast(TransfersService, self.script),
            self.metrics,
            lambda *f: self.failures.append(f),
            registry=registry or registry_calls(),
            **limits,
        )
        self.run(self.server.start(self.path))

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def connections(self) -> int:
        async def count() -> int:
            return len(self.server.connections)

        return int(self.run(count()))

    def stop(self) -> None:
        async def close() -> None:
            await self.server.close()
            await asyncio.sleep(0.05)

        self.run(close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    def rpcs(self, method: str, code: str, service: str = "kvmap.v1.Transfers") -> float:
        """Calls of ``method`` counted with ``code``, read on the server's
        loop: a call is counted in the loop step that wrote its end, which a
        client can read before that step is over."""

        async def count() -> float:
            labels = {"grpc_service": service, "grpc_method": method, "grpc_code": code}
            return self.metrics.registry.get_sample_value("kvmap_rpcs_total", labels) or 0.0

        return float(self.run(count()))


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    s = Served(tmp_path / "d.sock.calls")
    yield s
    s.stop()


def pull(request_id: str, traceparent: str = "") -> bytes:
    spec = transfers_pb2.TransferSpec(request_id=request_id)
    return call_bytes(PULL_FIELD, spec_request_bytes(spec), traceparent)


def raw(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(5)
    sock.connect(path)
    return sock


def read_reply(sock: socket.socket) -> local_calls_pb2.LocalReply | None:
    """The next reply frame, or None at EOF."""
    head = sock.recv(4, socket.MSG_WAITALL)
    if not head:
        return None
    (size,) = LENGTH.unpack(head)
    return local_calls_pb2.LocalReply.FromString(sock.recv(size, socket.MSG_WAITALL))


def eof(sock: socket.socket) -> bool:
    return sock.recv(1) == b""


def test_a_call_returns_its_statuses_and_reuses_its_connection(served: Served) -> None:
    """A pull's statuses come back as the transfer made them; two calls in a
    row use one connection; the call is counted OK under gRPC's Pull series."""
    calls = LocalCalls(served.path)
    first = calls.call(pull("r1"), 5)
    second = calls.call(pull("r2"), 5)
    assert first is not None and second is not None
    assert [(s.state, s.transfer_id) for s in first] == [
        (transfers_pb2.TRANSFER_STATE_DONE, "t-r1")
    ]
    assert second[0].transfer_id == "t-r2"
    assert served.connections() == 1
    assert served.rpcs("Pull", "OK") == 2
    assert [c[:2] for c in served.script.calls] == [("r1", "pull"), ("r2", "pull")]
    calls.close()


def test_as_many_connections_as_calls_at_once_are_kept_for_the_next_round(
    served: Served,
) -> None:
    """A worker that makes 32 calls at once keeps all 32 connections when
    they end, and its next 32 calls at once open none: a worker keeping
    fewer than it uses would connect (and the daemon accept and check) again
    for every call past them, round after round."""
    calls = LocalCalls(served.path)
    at_once = 32

    def round_of_calls() -> None:
        served.script.release.clear()
        threads = [
            threading.Thread(target=calls.call, args=(pull("held"), 10)) for _ in range(at_once)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        # Every call holds its connection until released ("held").
        while len([c for c in served.script.calls if c[0] == "held"]) < at_once:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        served.script.calls.clear()
        served.script.release.set()
        for t in threads:
            t.join(10)

    round_of_calls()
    assert len(calls._idle) == at_once
    kept = set(calls._idle)
    round_of_calls()
    assert set(calls._idle) == kept  # the same connections, no new one
    assert served.connections() == at_once
    calls.close()


def test_push_and_the_callers_span_reach_the_transfer(served: Served) -> None:
    """A push is a push; a well-formed traceparent is the transfer's parent,
    a malformed one is dropped (as gRPC's metadata is)."""
    calls = LocalCalls(served.path)
    spec = transfers_pb2.TransferSpec(request_id="p")
    assert calls.call(call_bytes(PUSH_FIELD, spec_request_bytes(spec), TRACEPARENT), 5)
    assert calls.call(pull("q", traceparent="00-not-a-trace"), 5)
    assert served.script.calls == [("p", "push", TRACEPARENT), ("q", "pull", "")]
    assert served.rpcs("Push", "OK") == 1
    calls.close()


@pytest.mark.parametrize(
    ("request_id", "error", "code"),
    [
        ("missing", NotFound, "NOT_FOUND"),
        ("refused", PermissionDenied, "PERMISSION_DENIED"),
        ("crash", None, "INTERNAL"),
    ],
)
def test_a_failed_call_raises_what_grpc_would(
    served: Served, request_id: str, error: type | None, code: str
) -> None:
    """A transfer's error reaches the caller as the gRPC call's would (same
    class, same "<STATUS>: <details>" message); the daemon counts and
    reports it under the local calls listener; the connection serves on."""
    calls = LocalCalls(served.path)
    with pytest.raises(Exception) as raised:
        calls.call(pull(request_id), 5)
    if error is not None:
        assert type(raised.value) is error
        expected = from_status(code, str(raised.value).split(": ", 1)[1])
        assert str(raised.value) == str(expected)
    assert str(raised.value).startswith(f"{code}: ")
    assert served.rpcs("Pull", code) == 1
    assert served.failures[-1][:3] == ("local_calls", "Pull", code)
    assert calls.call(pull("after"), 5)
    assert served.connections() == 1
    calls.close()


def test_a_deadline_ends_the_call_and_cancels_the_transfer(served: Served) -> None:
    """A call past its timeout raises DEADLINE_EXCEEDED (gRPC's words) at
    about the timeout; the connection is closed, which cancels the transfer
    in the daemon, and nothing of it is kept."""
    calls = LocalCalls(served.path)
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match=r"^DEADLINE_EXCEEDED: Deadline Exceeded$"):
        calls.call(pull("hang"), 0.3)
    assert 0.25 < time.monotonic() - started < 3
    assert served.script.cancelled.wait(5)
    deadline = time.monotonic() + 5
    while served.connections() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert served.connections() == 0
    calls.close()


def test_a_daemon_gone_mid_call_is_unavailable(served: Served) -> None:
    """The daemon closing the connection under a call (it died) raises UNAVAILABLE."""
    calls = LocalCalls(served.path)
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            calls.call(pull("hang"), 10)
        except BaseException as err:
            outcome.append(err)

    t = threading.Thread(target=call)
    t.start()
    deadline = time.monotonic() + 5
    while not served.script.calls and time.monotonic() < deadline:
        time.sleep(0.01)
    served.run(_close(served.server))
    t.join(10)
    assert len(outcome) == 1 and isinstance(outcome[0], Unavailable), outcome
    assert str(outcome[0]).startswith("UNAVAILABLE: kvmapd local calls socket: ")


async def _close(server: LocalCallsServer) -> None:
    await server.close()


def test_a_restarted_daemon_is_reached_on_a_new_connection(tmp_path: Path) -> None:
    """An idle connection whose daemon went away is dropped before use: the
    first call after a restart succeeds on a new connection."""
    path = tmp_path / "d.sock.calls"
    first = Served(path)
    calls = LocalCalls(str(path))
    assert calls.call(pull("before"), 5)
    first.stop()
    second = Served(path)
    try:
        assert calls.call(pull("after"), 5)
        assert [c[0] for c in second.script.calls] == ["after"]
    finally:
        calls.close()
        second.stop()


def test_no_socket_or_a_full_one_means_grpc(tmp_path: Path) -> None:
    """No daemon on the path, or one whose connections are all taken:
    ``call`` answers None (the transport then calls over gRPC), also when
    the daemon closed the connection before the call was all sent, and the
    full daemon ran nothing; the refused connection heard why."""
    assert LocalCalls(str(tmp_path / "nobody.calls")).call(pull("r"), 5) is None
    s = Served(tmp_path / "d.sock.calls", max_connections=1)
    try:
        holder = raw(s.path)
        deadline = time.monotonic() + 5
        while s.connections() < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert LocalCalls(s.path).call(pull("r"), 5) is None
        # A call too large to be sent before the daemon closes the connection
        # (the send fails, the daemon's answer is in the socket) likewise.
        assert LocalCalls(s.path).call(pull("r" * (4 << 20)), 5) is None
        refused = raw(s.path)
        reply = read_reply(refused)
        assert reply is not None and reply.end.reason == local_calls.FULL
        assert reply.end.code == 14 and eof(refused)
        assert s.script.calls == []
        holder.close()
        refused.close()
    finally:
        s.stop()


def test_an_oversized_frame_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """A length over the limit: RESOURCE_EXHAUSTED naming both sizes, the
    connection ends, nothing ran, and the daemon serves the next caller."""
    s = Served(tmp_path / "d.sock.calls", max_frame_bytes=1024)
    try:
        sock = raw(s.path)
        sock.sendall(LENGTH.pack(1025) + b"x" * 100)
        reply = read_reply(sock)
        assert reply is not None and reply.end.code == 8
        assert "1025" in reply.end.message and "1024" in reply.end.message
        assert eof(sock) and s.script.calls == []
        assert LocalCalls(s.path).call(pull("next"), 5)
    finally:
        s.stop()


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"\xff\xff\xff", "not a LocalCall"),
        (b"", "names no call"),
        (local_calls_pb2.LocalCall(traceparent="x").SerializeToString(), "names no call"),
    ],
)
def test_a_frame_that_is_no_call_is_invalid_and_the_connection_serves_on(
    served: Served, body: bytes, words: str
) -> None:
    """Garbage, an empty frame or a call naming no method: INVALID_ARGUMENT,
    nothing ran, and the same connection then carries a good call."""
    sock = raw(served.path)
    sock.sendall(LENGTH.pack(len(body)) + body)
    reply = read_reply(sock)
    assert reply is not None and reply.end.code == 3 and words in reply.end.message
    sock.sendall(pull("good"))
    good = read_reply(sock)
    assert good is not None and good.status.transfer_id == "t-good"
    assert [c[0] for c in served.script.calls] == ["good"]
    sock.close()


def test_bytes_after_a_frame_end_the_connection(served: Served) -> None:
    """A frame followed by more bytes (pipelined calls are not the protocol):
    INVALID_ARGUMENT, the connection ends, nothing ran."""
    sock = raw(served.path)
    sock.sendall(pull("a") + pull("b"))
    reply = read_reply(sock)
    assert reply is not None and reply.end.code == 3 and "after" in reply.end.message
    assert eof(sock) and served.script.calls == []


def test_a_frame_while_a_call_runs_ends_the_connection_and_the_call(served: Served) -> None:
    """A second frame sent before the first call ended: the connection is
    closed and the running call cancelled."""
    sock = raw(served.path)
    sock.sendall(pull("hang"))
    first = read_reply(sock)
    assert first is not None and first.status.state == transfers_pb2.TRANSFER_STATE_HANDSHAKING
    sock.sendall(pull("again"))
    assert read_reply(sock) is None
    assert served.script.cancelled.wait(5)
    assert [c[0] for c in served.script.calls] == ["hang"]


def test_a_frame_left_unfinished_ends_the_connection(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer that starts a frame and stalls holds its connection only
    ``FRAME_TIMEOUT_S``; an idle connection between calls is not timed out."""
    monkeypatch.setattr(local_calls, "FRAME_TIMEOUT_S", 0.3)
    idle = raw(served.path)
    stalled = raw(served.path)
    stalled.sendall(LENGTH.pack(100) + b"\x0a")
    started = time.monotonic()
    assert eof(stalled)
    assert 0.2 < time.monotonic() - started < 4
    time.sleep(0.3)
    idle.sendall(pull("idle"))
    reply = read_reply(idle)
    assert reply is not None and reply.status.transfer_id == "t-idle"


def test_the_socket_is_for_owner_and_group(served: Served) -> None:
    """The socket file is 0660, as the gRPC socket beside it."""
    assert Path(served.path).stat().st_mode & 0o777 == 0o660


@given(
    st.text(max_size=300),
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=300),
    st.sampled_from(["", TRACEPARENT]),
    st.booleans(),
)
def test_a_call_built_from_bytes_is_the_message_protobuf_would_write(
    request_id: str, ids: list[int], traceparent: str, push: bool
) -> None:
    """``call_bytes`` (the spec serialized once, framed by hand) is the
    length and the bytes of the LocalCall protobuf itself would serialize,
    for pulls and pushes, long and short fields alike."""
    spec = transfers_pb2.TransferSpec(request_id=request_id)
    spec.groups.add(local_block_ids=ids, remote_block_ids=ids)
    field = PUSH_FIELD if push else PULL_FIELD
    framed = call_bytes(field, spec_request_bytes(spec), traceparent)
    if push:
        call = local_calls_pb2.LocalCall(push=transfers_pb2.PushRequest(spec=spec))
    else:
        call = local_calls_pb2.LocalCall(pull=transfers_pb2.PullRequest(spec=spec))
    call.traceparent = traceparent
    body = call.SerializeToString()
    assert framed == LENGTH.pack(len(body)) + body


def test_done_goes_out_with_the_end_frame_other_statuses_at_once(served: Served) -> None:
    """A status before DONE reaches the caller while the transfer runs;
    DONE is held until the call ends and goes out with the end frame, so
    the caller reads both at one wake-up."""
    sock = raw(served.path)
    sock.sendall(pull("held"))
    first = read_reply(sock)
    assert first is not None and first.status.state == transfers_pb2.TRANSFER_STATE_HANDSHAKING
    assert served.script.done_taken.wait(5)
    time.sleep(0.05)  # what the daemon would have written by now, it has
    sock.setblocking(False)
    with pytest.raises(BlockingIOError):
        sock.recv(1)  # DONE is not out yet
    sock.settimeout(5)
    served.script.release.set()
    done, end = read_reply(sock), read_reply(sock)
    assert done is not None and done.status.state == transfers_pb2.TRANSFER_STATE_DONE
    assert done.status.transfer_id == "t-held"
    assert end is not None and end.WhichOneof("reply") == "end" and end.end.code == 0
    sock.close()


def test_a_failure_after_done_sends_done_then_the_failure(served: Served) -> None:
    """A transfer that fails after it reported DONE: the caller still gets
    every status, DONE included, then the failure's status, as over gRPC."""
    sock = raw(served.path)
    sock.sendall(pull("fails-after-done"))
    replies = [read_reply(sock) for _ in range(3)]
    states = [r.status.state for r in replies[:2] if r is not None]
    assert states == [
        transfers_pb2.TRANSFER_STATE_HANDSHAKING,
        transfers_pb2.TRANSFER_STATE_DONE,
    ]
    end = replies[2]
    assert end is not None and end.WhichOneof("reply") == "end"
    assert end.end.code == 14  # UNAVAILABLE
    assert served.rpcs("Pull", "UNAVAILABLE") == 1
    sock.close()
