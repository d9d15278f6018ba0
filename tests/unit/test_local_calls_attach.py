"""Attach on the local calls socket, both ends: the daemon's
``api.local_calls`` server (a real Unix socket, its own event loop in a
thread) and the client's ``LocalAttachStream``. The worker's events come
from a scripted stream (``Events``): what the socket carries, its flow
control, who the daemon is told calls, and how either side ends it are
tested here; real daemons' Attach over it is in
tests/integration/test_local_calls_events.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import ClassVar

import pytest
from test_local_calls_frames import Served, registry_calls

from kvmap.client.transports.base import AttachStream
from kvmap.client.transports.local_calls import (
    ATTACH_FIELD,
    LocalAttachStream,
    LocalCalls,
    call_bytes,
)
from kvmap.core.errors import NotFound, Unavailable
from kvmap.daemon.adapters.fd_handoff import PeerCred
from kvmap.daemon.api import local_calls
from kvmap.v1 import registry_pb2, types_pb2

pytestmark = pytest.mark.timeout(60)

STREAM_END = -1


class Events:
    """A worker's Attach stream as the daemon's ``attach_events`` gives it:
    ``attached``, then whatever ``put`` queues, until ``STREAM_END``. Records
    who it was told calls, how many events the server took, and whether its
    ``finally`` ran (the daemon's "worker gone")."""

    def __init__(self) -> None:
        self.callers: list[PeerCred | None] = []
        self.taken = 0
        self.ended = threading.Event()
        self.queue: asyncio.Queue[int] | None = None
        self.refuse: Exception | None = None

    async def __call__(
        self, request: registry_pb2.AttachRequest, caller: Callable[[], PeerCred | None]
    ) -> AsyncIterator[registry_pb2.AttachResponse]:
        self.callers.append(caller())
        if self.refuse is not None:
            raise self.refuse
        self.queue = asyncio.Queue()
        try:
            yield registry_pb2.AttachResponse(attached=registry_pb2.AttachedEvent(generation=1))
            while (n := await self.queue.get()) != STREAM_END:
                self.taken += 1
                yield _finished(n)
        finally:
            self.ended.set()

    def put(self, served: Served, *values: int) -> None:
        async def put() -> None:
            assert self.queue is not None
            for v in values:
                self.queue.put_nowait(v)

        served.run(put())


def _finished(n: int, pad: int = 0) -> registry_pb2.AttachResponse:
    event = registry_pb2.TransferFinishedEvent(request_id=f"r{n}" + "x" * pad)
    return registry_pb2.AttachResponse(transfer_finished=event)


def _attach(path: str, fallback: Callable[[], AttachStream] | None = None) -> LocalAttachStream:
    request = registry_pb2.AttachRequest(worker=types_pb2.WorkerId(engine_id="w"))
    sock = LocalCalls(path).attach(call_bytes(ATTACH_FIELD, request.SerializeToString(), ""))
    assert sock is not None
    return LocalAttachStream(sock, fallback or GrpcStandIn)


def _wait(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Served, Events]]:
    events = Events()
    s = Served(tmp_path / "d.sock.calls", registry=registry_calls(attach=events))
    try:
        yield s, events
    finally:
        s.stop()


def test_events_arrive_in_order_and_the_daemon_knows_the_callers_uid(
    served: tuple[Served, Events],
) -> None:
    """The daemon is told the connecting process's pid and uid (the kernel's,
    not a claim); events arrive in order after ``attached``; the daemon's end
    of the stream ends the iteration without an error, and counts OK."""
    s, events = served
    stream = iter(_attach(s.path))
    assert next(stream).WhichOneof("event") == "attached"
    assert events.callers == [PeerCred(pid=os.getpid(), uid=os.getuid(), gid=os.getgid())]
    events.put(s, 1, 2, 3, STREAM_END)
    got = [e.transfer_finished.request_id for e in stream]
    assert got == ["r1", "r2", "r3"]
    assert s.rpcs("Attach", "OK", "kvmap.v1.Registry") == 1


def test_a_refusal_is_raised_while_iterating_not_by_attach(
    served: tuple[Served, Events],
) -> None:
    """A worker the daemon does not know: ``attach`` returns a stream, and
    its iteration raises NOT_FOUND (as gRPC's stream does, which is what the
    session's re-registration relies on)."""
    s, events = served
    events.refuse = NotFound("worker w")
    stream = _attach(s.path)
    with pytest.raises(NotFound, match="worker w"):
        next(iter(stream))


def test_cancel_wakes_a_blocked_reader_and_the_daemon_ends_the_stream(
    served: tuple[Served, Events],
) -> None:
    """``cancel`` from another thread ends a reader blocked on the next
    event without an error, and the daemon's side of the stream ends (the
    worker's "gone"), as a cancelled gRPC stream does."""
    s, events = served
    stream = _attach(s.path)
    got: list[str] = []
    errors: list[BaseException] = []

    def read() -> None:
        try:
            got.extend(e.WhichOneof("event") or "" for e in stream)
        except BaseException as err:  # reported below
            errors.append(err)

    reader = threading.Thread(target=read)
    reader.start()
    _wait(lambda: got == ["attached"])
    stream.cancel()
    reader.join(10)
    assert not reader.is_alive() and not errors, errors
    assert events.ended.wait(10)


def test_a_daemon_gone_mid_stream_is_unavailable(served: tuple[Served, Events]) -> None:
    """The daemon's connection ends without an end frame (it stopped past
    its grace, or died): the iteration raises UNAVAILABLE, so the session
    attaches again."""
    s, _ = served
    stream = iter(_attach(s.path))
    next(stream)

    async def abort() -> None:
        for conn in list(s.server.connections):
            conn.abort()

    s.run(abort())
    with pytest.raises(Unavailable, match="local calls socket"):
        next(stream)


def test_stopping_lets_the_stream_end_then_ends_connections(
    served: tuple[Served, Events],
) -> None:
    """Stopping: a stream the daemon tells to end within the grace ends with
    its end frame (the iteration ends cleanly), not with a cut connection."""
    s, events = served
    stream = iter(_attach(s.path))
    next(stream)

    async def stop() -> None:
        assert events.queue is not None
        events.queue.put_nowait(STREAM_END)  # what end_streams does
        await s.server.close()

    s.run(stop())
    assert list(stream) == []


def test_a_stream_that_does_not_end_is_cut_after_the_grace(
    served: tuple[Served, Events],
) -> None:
    """A stream still open when the grace runs out is cut: the worker sees
    UNAVAILABLE and the daemon's side of it ends."""
    s, events = served
    stream = iter(_attach(s.path))
    next(stream)
    started = time.monotonic()
    s.run(s.server.close(grace_s=0.2))
    assert time.monotonic() - started >= 0.2
    with pytest.raises(Unavailable):
        next(stream)
    assert events.ended.wait(10)


def test_a_worker_that_does_not_read_holds_the_daemons_stream_back(
    tmp_path: Path,
) -> None:
    """Flow control: while the worker reads nothing, the daemon stops taking
    events once the connection is full (they stay queued, unacknowledged),
    instead of buffering them all in its memory; once the worker reads,
    every event arrives, in order."""
    events = Events()
    pad = 60_000

    async def big(
        request: registry_pb2.AttachRequest, caller: Callable[[], PeerCred | None]
    ) -> AsyncIterator[registry_pb2.AttachResponse]:
        async for event in events(request, caller):
            if not event.HasField("transfer_finished"):
                yield event
                continue
            yield _finished(int(event.transfer_finished.request_id[1:]), pad)

    s = Served(tmp_path / "d.sock.calls", registry=registry_calls(attach=big))
    try:
        stream = iter(_attach(s.path))
        next(stream)
        total = 400  # 24 MB of events: far beyond what the sockets hold
        events.put(s, *range(total), STREAM_END)
        time.sleep(0.5)
        held_back = events.taken
        assert held_back < total // 2, held_back
        got = [int(e.transfer_finished.request_id[1:].rstrip("x")) for e in stream]
        assert got == list(range(total))
        assert events.taken == total
    finally:
        s.stop()


class Answering:
    """A stand-in daemon on a real Unix socket that reads each call's frame
    whole and answers it with ``answer`` (an end frame), then closes the
    connection if ``close``: a full daemon, or one that predates a call."""

    def __init__(self, path: Path, answer: bytes, close: bool) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen()
        self.answer, self.close, self.calls = answer, close, 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            head = conn.recv(4, socket.MSG_WAITALL)
            conn.recv(int.from_bytes(head, "little"), socket.MSG_WAITALL)
            self.calls += 1
            # A client that gave up first (cancelled) is gone, as for a daemon.
            with contextlib.suppress(OSError):
                conn.sendall(self.answer)
            if self.close:
                conn.close()

    def stop(self) -> None:
        self.listener.close()


class GrpcStandIn:
    """The gRPC stream a transport attaches instead: ``attached`` (generation
    7), then it blocks until cancelled, as a live gRPC stream does."""

    made: ClassVar[list[GrpcStandIn]] = []

    def __init__(self) -> None:
        self.cancelled = threading.Event()
        GrpcStandIn.made.append(self)

    def __iter__(self) -> Iterator[registry_pb2.AttachResponse]:
        yield registry_pb2.AttachResponse(attached=registry_pb2.AttachedEvent(generation=7))
        self.cancelled.wait(30)

    def cancel(self) -> None:
        self.cancelled.set()


# What a daemon that cannot serve a call here answers, before anything else
# (the end frame, and whether it then closes the connection): it has no
# room, or it predates the call (an older daemon's words for it).
CANNOT_SERVE_HERE = pytest.mark.parametrize(
    ("answer", "close"),
    [
        (local_calls.end_frame(14, "local calls socket full", local_calls.FULL), True),
        (local_calls.end_frame(3, "local calls: a LocalCall with neither pull nor push"), False),
    ],
    ids=["full", "predates-the-call"],
)


@CANNOT_SERVE_HERE
def test_a_daemon_that_cannot_serve_it_here_is_attached_over_grpc(
    tmp_path: Path, answer: bytes, close: bool
) -> None:
    """A daemon with no room for the connection, or one that predates attach
    calls (it answers INVALID_ARGUMENT: the frame names no call it knows),
    answers before any event: the stream attaches through its fallback
    (gRPC) and gives that stream's events, instead of failing for good; and
    ``cancel`` then cancels the gRPC stream, which ends the iteration (a
    stopped session must not leave a reader blocked on it)."""
    daemon = Answering(tmp_path / "d.sock.calls", answer, close)
    try:
        GrpcStandIn.made.clear()
        stream = _attach(str(tmp_path / "d.sock.calls"))
        events = iter(stream)
        assert next(events).attached.generation == 7
        assert daemon.calls == 1
        [instead] = GrpcStandIn.made
        ended = threading.Event()
        reader = threading.Thread(target=lambda: (list(events), ended.set()))
        reader.start()
        stream.cancel()
        reader.join(10)
        assert instead.cancelled.is_set() and ended.is_set()
    finally:
        daemon.stop()


def test_a_stream_cancelled_before_its_first_answer_attaches_nowhere(tmp_path: Path) -> None:
    """Cancelled before the daemon's "attach over gRPC instead" is read: the
    iteration ends with nothing, and no gRPC stream is opened."""
    full = local_calls.end_frame(14, "local calls socket full", local_calls.FULL)
    daemon = Answering(tmp_path / "d.sock.calls", full, True)
    try:
        GrpcStandIn.made.clear()
        stream = _attach(str(tmp_path / "d.sock.calls"))
        stream.cancel()
        assert list(stream) == []
        assert GrpcStandIn.made == []
    finally:
        daemon.stop()


def test_no_socket_means_no_local_stream(tmp_path: Path) -> None:
    """Nothing listening: ``LocalCalls.attach`` answers None (the transport
    then attaches over gRPC)."""
    request = registry_pb2.AttachRequest(worker=types_pb2.WorkerId(engine_id="w"))
    frame = call_bytes(ATTACH_FIELD, request.SerializeToString(), "")
    assert LocalCalls(str(tmp_path / "none.calls")).attach(frame) is None
