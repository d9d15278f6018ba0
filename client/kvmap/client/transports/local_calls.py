"""Pull, Push, Attach, GrantTransfer and RevokeTransfer on kvmapd's local
calls socket (``<socket>.calls``, ``protos/kvmap/v1/local_calls.proto``):
the same calls as gRPC's, at what a Unix socket costs (the daemon's
``api/local_calls.py`` says why). ``LocalCallsTransport`` makes them from
their request messages; ``LocalCalls`` moves their frames.

``LocalCalls.call`` and ``unary`` (and so ``LocalCallsTransport``'s calls)
answer None when the daemon has no such
socket (an older daemon, one started with ``--no-local-calls``, one down),
no room for another connection, or (``unary``, an attach) does not know the
call: the caller then makes the call over gRPC, which answers as it always
did. Everything else is the call's own outcome: its statuses or response,
or the error gRPC would have raised (``kvmap.client.errors``).

An attach call has a connection of its own for as long as the worker stays
attached (``LocalAttachStream``); it is never kept for another call.

Connections are kept between calls (one per thread that calls at once, up
to ``MAX_IDLE`` idle), each checked before reuse: one whose daemon has gone
(a restart closes it) is dropped and a new one opened, so the first call
after a restart does not fail on the old daemon's connection.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

from kvmap.client.errors import from_status, from_status_number
from kvmap.client.transports.base import AttachStream
from kvmap.client.transports.wire import spec_request_bytes
from kvmap.core.errors import InvalidArgument, KvmapError
from kvmap.core.protowire import varint
from kvmap.tracing import current
from kvmap.v1 import local_calls_pb2, registry_pb2, transfers_pb2

LENGTH = struct.Struct("<I")
# Idle connections kept for later calls: as many as a worker makes at once
# (its pull threads'), up to this many. A worker that kept fewer than it
# uses opened and closed the rest for every round of calls, each a connect,
# an accept and a credentials check on the daemon's event loop (at 32 pulls
# at once, 2 context switches more per pull on the daemon: 18.7 against
# 16.7 with the connections kept). An idle connection costs
# the daemon a socket; its MAX_CONNECTIONS bounds them all.
MAX_IDLE = 64
# The longest reply frame accepted (a status is a few hundred bytes).
MAX_REPLY_BYTES = 1 << 20
# How long opening a connection may take (a local socket: at once, or never).
CONNECT_TIMEOUT_S = 1.0
# The daemon's reason for "no room for another connection".
FULL = "LOCAL_CALLS_FULL"
# gRPC's INVALID_ARGUMENT, as an end frame's code.
INVALID_ARGUMENT_CODE = 3
# LocalCall's fields: pull (1) and push (2) are PullRequest / PushRequest,
# whose only field (1) is the spec; traceparent is field 3.
PULL_FIELD = 1
PUSH_FIELD = 2
ATTACH_FIELD = 4
GRANT_FIELD = 5
REVOKE_FIELD = 6
_TRACEPARENT_TAG = b"\x1a"


def call_bytes(field: int, request: bytes, traceparent: str) -> bytes:
    """A LocalCall frame around ``request`` (a serialized PullRequest or
    PushRequest), built from bytes: the spec is not copied into messages."""
    head = bytes([field << 3 | 2]) + varint(len(request))
    tail = b""
    if traceparent:
        encoded = traceparent.encode()
        tail = _TRACEPARENT_TAG + varint(len(encoded)) + encoded
    # Joined once: the request (tens of KB at full scale) is copied once.
    size = len(head) + len(request) + len(tail)
    return b"".join((LENGTH.pack(size), head, request, tail))


class LocalCallsTransport:
    """The calls a worker makes on the local calls socket at ``path``, from
    their request messages: each answers None where the call must go over
    gRPC instead (the module docstring says when). A call carries the
    calling thread's traceparent (``kvmap.tracing.current``) where gRPC's
    would; an attach names no credentials (the kernel tells the daemon the
    caller's uid)."""

    def __init__(self, path: str) -> None:
        self.calls = LocalCalls(path)

    def attach(
        self, req: registry_pb2.AttachRequest, fallback: Callable[[], AttachStream]
    ) -> LocalAttachStream | None:
        """The worker's events, ``fallback`` attaching it over gRPC where the
        daemon answers that it has no room or does not know the call."""
        sock = self.calls.attach(call_bytes(ATTACH_FIELD, req.SerializeToString(), ""))
        return None if sock is None else LocalAttachStream(sock, fallback)

    def grant_transfer(
        self, req: registry_pb2.GrantTransferRequest, timeout: float
    ) -> registry_pb2.GrantTransferResponse | None:
        frame = call_bytes(GRANT_FIELD, req.SerializeToString(), current().traceparent())
        reply = self.calls.unary(frame, timeout, "granted")
        return None if reply is None else reply.granted

    def revoke_transfer(
        self, req: registry_pb2.RevokeTransferRequest, timeout: float
    ) -> registry_pb2.RevokeTransferResponse | None:
        reply = self.calls.unary(
            call_bytes(REVOKE_FIELD, req.SerializeToString(), ""), timeout, "revoked"
        )
        return None if reply is None else reply.revoked

    def pull(
        self, spec: transfers_pb2.TransferSpec, timeout: float
    ) -> list[transfers_pb2.PullResponse] | None:
        """Pull{spec}, the spec serialized once, straight into the frame."""
        statuses = self._transfer(PULL_FIELD, spec, timeout)
        if statuses is None:
            return None
        return [transfers_pb2.PullResponse(status=status) for status in statuses]

    def push(
        self, spec: transfers_pb2.TransferSpec, timeout: float
    ) -> list[transfers_pb2.PushResponse] | None:
        """Push{spec}, as ``pull``."""
        statuses = self._transfer(PUSH_FIELD, spec, timeout)
        if statuses is None:
            return None
        return [transfers_pb2.PushResponse(status=status) for status in statuses]

    def _transfer(
        self, field: int, spec: transfers_pb2.TransferSpec, timeout: float
    ) -> list[transfers_pb2.TransferStatus] | None:
        frame = call_bytes(field, spec_request_bytes(spec), current().traceparent())
        return self.calls.call(frame, timeout)

    def close(self) -> None:
        self.calls.close()


class LocalCalls:
    """Frames to and from the local calls socket at ``path``, on kept
    connections."""

    def __init__(self, path: str, connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        self.path = path
        self._connect_timeout_s = connect_timeout_s
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def call(self, frame: bytes, timeout: float) -> list[transfers_pb2.TransferStatus] | None:
        """Send one transfer call (``call_bytes``) and read its statuses to
        the end, within ``timeout``; None when the call must go over gRPC."""
        replies = self.replies(frame, timeout)
        if replies is None:
            return None
        if any(r.WhichOneof("reply") != "status" for r in replies):
            raise from_status("UNAVAILABLE", "kvmapd local calls socket: a reply that is no status")
        return [r.status for r in replies]

    def unary(self, frame: bytes, timeout: float, field: str) -> local_calls_pb2.LocalReply | None:
        """Send one Registry call whose answer is one reply with ``field``
        set; None when the call must go over gRPC: no socket, no room, or a
        daemon that predates the call (it answers INVALID_ARGUMENT, since
        the frame names no call it knows: a call the daemon finds invalid
        is refused over gRPC again, with nothing changed, as it must be)."""
        try:
            replies = self.replies(frame, timeout)
        except InvalidArgument:
            return None
        if replies is None:
            return None
        if len(replies) != 1 or replies[0].WhichOneof("reply") != field:
            raise from_status("UNAVAILABLE", f"kvmapd local calls socket: no {field} reply")
        return replies[0]

    def replies(self, frame: bytes, timeout: float) -> list[local_calls_pb2.LocalReply] | None:
        """Send one call and read its replies to the end, within
        ``timeout``: those before the end frame, or the error the end frame
        names; None when the call must go over gRPC instead."""
        deadline = time.monotonic() + timeout
        sock = self._connection()
        if sock is None:
            return None
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                sock.sendall(frame)
            except (BrokenPipeError, ConnectionResetError):
                # A daemon with no room says so and closes at once, which
                # can be before the call is all sent: its answer is read.
                if _told_full(sock, deadline):
                    sock.close()
                    return None
                raise
            replies: list[local_calls_pb2.LocalReply] = []
            while True:
                reply = _read_reply(sock, deadline)
                if reply.WhichOneof("reply") != "end":
                    replies.append(reply)
                    continue
                end = reply.end
                if end.reason == FULL and not replies:
                    sock.close()
                    return None
                self._keep(sock)  # the call ended as the protocol says
                if end.code == 0:
                    return replies
                raise from_status_number(end.code, end.message)
        except TimeoutError:
            sock.close()  # the daemon cancels the call, as for gRPC's deadline
            raise from_status("DEADLINE_EXCEEDED", "Deadline Exceeded") from None
        except (OSError, _Broken) as err:
            sock.close()
            raise from_status("UNAVAILABLE", f"kvmapd local calls socket: {err}") from None
        except KvmapError:
            raise
        except BaseException:
            sock.close()
            raise

    def attach(self, request: bytes) -> socket.socket | None:
        """A new connection that has sent an attach call (``call_bytes`` of a
        serialized AttachRequest), for a ``LocalAttachStream``; None when
        the daemon has no local calls socket or the send failed (the
        caller attaches over gRPC)."""
        sock = self._connect()
        if sock is None:
            return None
        try:
            sock.sendall(request)
        except OSError:
            # A daemon with no room that has already said so and closed (its
            # answer is not worth reading here).
            sock.close()
            return None
        return sock

    def _connection(self) -> socket.socket | None:
        """An idle connection that still has its daemon, else a new one;
        None when nothing accepts connections on the socket."""
        if os.getpid() != self._pid:
            # A forked child must not share its parent's connections.
            self._idle, self._pid = [], os.getpid()
        while True:
            with self._lock:
                sock = self._idle.pop() if self._idle else None
            if sock is None:
                break
            if _alive(sock):
                return sock
            sock.close()
        return self._connect()

    def _connect(self) -> socket.socket | None:
        """A new connection; None when nothing accepts connections on the socket."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self._connect_timeout_s)
        try:
            sock.connect(self.path)
        except OSError:
            sock.close()
            return None
        return sock

    def _keep(self, sock: socket.socket) -> None:
        with self._lock:
            if len(self._idle) < MAX_IDLE:
                self._idle.append(sock)
                return
        sock.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()


class LocalAttachStream:
    """A worker's events read from its attach call's connection, as gRPC's
    Attach stream gives them: the daemon's refusal is raised while
    iterating (never by ``attach``), the stream's end ends the iteration,
    ``cancel`` (from any thread) ends it from the worker's side. A daemon
    with no room for the connection (``FULL``) or that predates attach calls
    answers before any event: the worker is then attached over gRPC
    (``fallback``), whose stream this one reads and cancels from then on."""

    def __init__(self, sock: socket.socket, fallback: Callable[[], AttachStream]) -> None:
        self._sock = sock
        self._fallback = fallback
        self._cancelled = threading.Event()
        # Whether the daemon has answered (a FULL end is only ever first).
        self._started = False
        # The gRPC stream attached instead, once there is one (guarded by
        # _lock: ``cancel`` may come from another thread at any time).
        self._lock = threading.Lock()
        self._instead: AttachStream | None = None

    def __iter__(self) -> Iterator[registry_pb2.AttachResponse]:
        # The connection is closed where the stream ends (its end, an error,
        # ``cancel``), not when an iterator over it is dropped: a worker that
        # took one event and let go of the iterator stays attached, as with
        # gRPC's stream.
        try:
            while True:
                reply = _read_reply(self._sock, None)
                kind = reply.WhichOneof("reply")
                if not self._started and kind == "end" and _over_grpc(reply.end):
                    self._sock.close()
                    yield from self._attached_instead()
                    return
                self._started = True
                if kind == "event":
                    yield reply.event
                    continue
                self._sock.close()
                if kind != "end":
                    raise _Broken(f"a {kind} frame on an attach call")
                if reply.end.code == 0:
                    return
                raise from_status_number(reply.end.code, reply.end.message)
        except (OSError, _Broken) as err:
            self._sock.close()
            if self._cancelled.is_set():
                return  # the worker's side ended it, as a cancelled gRPC stream
            raise from_status("UNAVAILABLE", f"kvmapd local calls socket: {err}") from None

    def _attached_instead(self) -> Iterator[registry_pb2.AttachResponse]:
        with self._lock:
            if self._cancelled.is_set():
                return
            self._instead = instead = self._fallback()
        yield from instead

    def cancel(self) -> None:
        """End the stream: a reader blocked on it wakes to the end at once."""
        with self._lock:
            self._cancelled.set()
            instead = self._instead
        if instead is not None:
            instead.cancel()
        # Not connected any more (OSError): the stream is over already.
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)


def _over_grpc(end: local_calls_pb2.LocalCallEnd) -> bool:
    """Whether a first answer sends an attach call to gRPC: a daemon with
    no room (``FULL``), or one that predates the call (INVALID_ARGUMENT: the
    frame names no call it knows; a new daemon's gRPC answers the same)."""
    return end.reason == FULL or end.code == INVALID_ARGUMENT_CODE


class _Broken(Exception):
    """The daemon broke the protocol or went away in the middle of a call."""


def _alive(sock: socket.socket) -> bool:
    """Whether an idle connection's daemon is still there (no EOF, nothing unasked)."""
    # Non-blocking: with a timeout set, Python would wait for bytes first.
    sock.settimeout(0.0)
    try:
        sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True  # nothing to read: the daemon holds it open
    except OSError:
        return False
    return False  # EOF, or bytes no call asked for


def _told_full(sock: socket.socket, deadline: float) -> bool:
    """Whether what the daemon sent before it closed the connection is the
    end frame of a socket with no room (``FULL``)."""
    try:
        reply = _read_reply(sock, deadline)
    except (OSError, _Broken):
        return False
    return reply.WhichOneof("reply") == "end" and reply.end.reason == FULL


def _read_reply(sock: socket.socket, deadline: float | None) -> local_calls_pb2.LocalReply:
    (size,) = LENGTH.unpack(_read(sock, LENGTH.size, deadline))
    if size > MAX_REPLY_BYTES:
        raise _Broken(f"a reply frame of {size} bytes")
    try:
        return local_calls_pb2.LocalReply.FromString(_read(sock, size, deadline))
    except Exception as err:  # protobuf's DecodeError and kin
        raise _Broken(f"an unreadable reply: {err}") from None


def _read(sock: socket.socket, size: int, deadline: float | None) -> bytes:
    """``size`` bytes, by ``deadline`` (None: however long they take)."""
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        if deadline is None:
            sock.settimeout(None)
        else:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            sock.settimeout(left)
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise _Broken("the daemon closed the connection during the call")
        got += n
    return bytes(buf)
