"""The local calls socket (``<socket>.calls``): Transfers.Pull and Push, and
Registry.Attach, GrantTransfer and RevokeTransfer, as length-prefixed
protobuf frames (``protos/kvmap/v1/local_calls.proto``), for the workers
(and the scheduler) that make these calls on every request.

Why it exists: on this socket a pull's call and answer cost what a Unix
socket costs (~0.06 ms and ~0.02 ms of the caller's CPU), where a gRPC call
on the same machine costs 1-1.7 ms at the median and 4 ms at p95, with 0.6 ms
of the caller's CPU (measured on the bench's 2-vCPU machine). The
transfer itself is the gRPC servicer's (``TransfersService.reports``), so a
call is checked, run, tracked, logged, counted and refused exactly as the
same gRPC call is (``rpc.refused``, under the method's gRPC metric series).

Who may call: whoever may open the gRPC Unix socket (the socket is made
``0660`` beside it; Pull and Push ask for no credential token there
either). Registry calls act as the uid the kernel reports for the
connection (SO_PEERCRED), which is what a gRPC caller's credential token
proves: only the uid that registered a worker hears its events, grants or
revokes its blocks. They run the gRPC servicer's own functions
(``services.attach_events``, ``grant_transfer``, ``revoke_transfer``). An
attach call holds its connection while the worker stays attached; its
events are written as the connection takes them (the next one waits while
the client's socket is full), and the client ends it by closing the
connection, which, as a cancelled gRPC stream, leaves a worker with no
other stream gone.

What a caller can do to the daemon is bounded: a frame over the
gRPC socket's message limit is refused before it is read
(RESOURCE_EXHAUSTED), a frame begun must arrive whole within
``FRAME_TIMEOUT_S``, a frame while a call runs or bytes after a frame end
the connection, and at most ``MAX_CONNECTIONS`` are open (one more is told
UNAVAILABLE with the reason ``LOCAL_CALLS_FULL``, on which the client calls
over gRPC). A connection that closes under a call cancels it, as a
cancelled gRPC call does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Literal

import structlog
from google.protobuf.message import DecodeError

from kvmap.core.config import MAX_MESSAGE_BYTES
from kvmap.core.errors import InvalidArgument, KvmapError, ResourceExhausted, Unavailable
from kvmap.daemon.adapters.fd_handoff import PeerCred
from kvmap.daemon.adapters.grpc_codes import status_number
from kvmap.daemon.adapters.metrics import Metrics
from kvmap.daemon.api.rpc import MethodSeries, OnFailure, new_rpc_id, refused
from kvmap.daemon.api.services import Caller, TransfersService
from kvmap.daemon.api.status import grpc_status
from kvmap.tracing import traceparent_of
from kvmap.v1 import local_calls_pb2, registry_pb2, transfers_pb2

log = structlog.get_logger("kvmapd.local_calls")

LENGTH = struct.Struct("<I")
# Connections open at once (each worker thread that pulls keeps one).
MAX_CONNECTIONS = 256
# A frame begun must be whole within this (a stalled writer holds a buffer).
FRAME_TIMEOUT_S = 10.0
# The end frame's reason when the socket has no room: call over gRPC.
FULL = "LOCAL_CALLS_FULL"
# The listener that recent errors name (gRPC's are "unix" and "tcp").
LISTENER = "local_calls"

Transfer = Literal["pull", "push"]
Kind = Literal["pull", "push", "attach", "grant", "revoke"]
# A worker's Attach stream (``services.attach_events`` bound to the app).
AttachEvents = Callable[
    [registry_pb2.AttachRequest, Caller], AsyncIterator[registry_pb2.AttachResponse]
]


@dataclass(frozen=True)
class RegistryCalls:
    """The Registry calls this socket serves (``services``' functions bound
    to the app; a unit test's stand-ins)."""

    attach: AttachEvents
    # The request, the caller, the caller's traceparent ("" for none).
    grant: Callable[
        [registry_pb2.GrantTransferRequest, Caller, str], registry_pb2.GrantTransferResponse
    ]
    revoke: Callable[
        [registry_pb2.RevokeTransferRequest, Caller], registry_pb2.RevokeTransferResponse
    ]


# Each call's method, as gRPC names it (its metric series and log lines).
_METHODS: dict[Kind, str] = {
    "pull": "/kvmap.v1.Transfers/Pull",
    "push": "/kvmap.v1.Transfers/Push",
    "attach": "/kvmap.v1.Registry/Attach",
    "grant": "/kvmap.v1.Registry/GrantTransfer",
    "revoke": "/kvmap.v1.Registry/RevokeTransfer",
}
# How long stopping waits for attach calls to send their end frame (the
# daemon has told every stream to end), as gRPC's servers wait for theirs.
CLOSE_GRACE_S = 1.0
_PEERCRED = struct.Struct("3i")


def frame(reply: local_calls_pb2.LocalReply) -> bytes:
    body = reply.SerializeToString()
    return LENGTH.pack(len(body)) + body


def end_frame(code: int, message: str = "", reason: str = "") -> bytes:
    end = local_calls_pb2.LocalCallEnd(code=code, message=message, reason=reason)
    return frame(local_calls_pb2.LocalReply(end=end))


def error_frame(err: KvmapError) -> bytes:
    """The end frame of a call that fails with ``err`` (its status and
    bounded message as ``api.status`` makes them for every listener)."""
    code, message = grpc_status(err)
    return end_frame(status_number(code), message, err.reason)


class LocalCallsServer:
    """The socket's listener and its open connections."""

    def __init__(
        self,
        transfers: TransfersService,
        metrics: Metrics,
        on_failure: OnFailure | None,
        *,
        registry: RegistryCalls,
        max_frame_bytes: int = MAX_MESSAGE_BYTES,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.transfers = transfers
        self.registry = registry
        self.on_failure = on_failure
        self.max_frame_bytes = max_frame_bytes
        self.max_connections = max_connections
        self.series = {kind: MethodSeries(metrics, m) for kind, m in _METHODS.items()}
        self.connections: set[_Connection] = set()
        self._server: asyncio.AbstractServer | None = None

    async def start(self, path: str) -> None:
        """Listen on ``path`` (a stale file there is replaced), ``0660``."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _Connection(self), path)
        os.chmod(path, 0o660)

    async def close(self, grace_s: float = CLOSE_GRACE_S) -> None:
        """Stop accepting; give attach calls up to ``grace_s`` to end (the
        daemon has told their streams to), then end every connection: a
        call still running is cancelled."""
        if self._server is not None:
            self._server.close()
        attached = [c.call for c in self.connections if c.attached and c.call is not None]
        if attached:
            await asyncio.wait(attached, timeout=grace_s)
        for conn in list(self.connections):
            conn.end()


class _Connection(asyncio.Protocol):
    """One client connection: frames in, a call at a time, frames out."""

    def __init__(self, server: LocalCallsServer) -> None:
        self._server = server
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self.call: asyncio.Task[None] | None = None
        # Whether the running call is an attach call (stopping waits for it).
        self.attached = False
        self._stalled: asyncio.TimerHandle | None = None
        # A transfer's DONE frame, held to go out with the end frame.
        self._held = b""
        # The calling process, as the kernel reports it (None: unknown).
        self._peer: PeerCred | None = None
        # Cleared while the client's socket is full (pause_writing).
        self._writable = asyncio.Event()
        self._writable.set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._peer = _peer_cred(transport)
        server = self._server
        if len(server.connections) >= server.max_connections:
            full = Unavailable(f"local calls socket full ({server.max_connections} connections)")
            full.reason = FULL
            transport.write(error_frame(full))
            transport.close()
            return
        server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.connections.discard(self)
        self._disarm()
        self._writable.set()
        if self.call is not None:
            self.call.cancel()  # as gRPC cancels the call of a client gone

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def end(self) -> None:
        """The daemon is stopping: a connection between calls is closed once
        what it was sent is written; one with a call still running is
        aborted (the call cancelled)."""
        if self._transport is None:
            return
        if self.call is None:
            self._transport.close()
        else:
            self._transport.abort()

    def data_received(self, data: bytes) -> None:
        if self.call is not None:
            # One call at a time: a client that does not wait for the end is
            # not the library's; its call is cancelled with the connection.
            log.warning("local_call_refused", error="a frame while a call runs")
            self.abort()
            return
        self._buffer += data
        if len(self._buffer) < LENGTH.size:
            self._arm()
            return
        (size,) = LENGTH.unpack_from(self._buffer)
        if size > self._server.max_frame_bytes:
            self._refuse(
                ResourceExhausted(
                    f"local calls: frame of {size} bytes, over {self._server.max_frame_bytes}"
                )
            )
            return
        end = LENGTH.size + size
        if len(self._buffer) < end:
            self._arm()
            return
        if len(self._buffer) > end:
            self._refuse(InvalidArgument("local calls", "bytes after a call's frame"))
            return
        body = bytes(memoryview(self._buffer)[LENGTH.size :])
        self._buffer.clear()
        self._disarm()
        self.call = asyncio.get_running_loop().create_task(self._serve(body))

    def _arm(self) -> None:
        if self._stalled is None:
            loop = asyncio.get_running_loop()
            self._stalled = loop.call_later(FRAME_TIMEOUT_S, self._timed_out)

    def _disarm(self) -> None:
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None

    def _timed_out(self) -> None:
        self._stalled = None
        log.warning("local_call_stalled", after_s=FRAME_TIMEOUT_S, buffered=len(self._buffer))
        self.abort()

    def _refuse(self, err: InvalidArgument | ResourceExhausted) -> None:
        """A frame the protocol does not allow: its status, then the connection ends."""
        log.warning("local_call_refused", code=err.code.name, error=err.message)
        assert self._transport is not None
        self._transport.write(error_frame(err))
        self._buffer.clear()
        self._disarm()
        self._transport.close()

    async def _serve(self, body: bytes) -> None:
        structlog.contextvars.bind_contextvars(rpc="Pull", rpc_id=new_rpc_id(), listener=LISTENER)
        started = time.perf_counter()
        kind: Kind = "pull"
        try:
            call = _parsed(body)
            kind = _kind(call)
            if kind == "attach":
                self.attached = True
                await self._serve_attach(call.attach)
            elif kind in ("grant", "revoke"):
                self._serve_unary(call, kind)
            else:
                await self._serve_transfer(call, "push" if kind == "push" else "pull")
        except Exception as err:  # every failure becomes its status, as in rpc
            server = self._server
            code, message, reason = refused(err, server.series[kind], LISTENER, server.on_failure)
            del err
            assert self._transport is not None
            self._transport.write(self._held + end_frame(status_number(code), message, reason))
        finally:
            self._server.series[kind].seconds.observe(time.perf_counter() - started)
            self._held = b""
            self.call = None
            self.attached = False

    async def _serve_transfer(self, call: local_calls_pb2.LocalCall, kind: Transfer) -> None:
        transport = self._transport
        assert transport is not None
        server = self._server
        spec = call.push.spec if kind == "push" else call.pull.spec
        parent = traceparent_of(call.traceparent) if call.traceparent else ""
        structlog.contextvars.bind_contextvars(rpc=kind.capitalize())
        # DONE goes out with the end frame, in one write: the caller reads
        # both at one wake-up instead of being woken for each.
        self._held = b""
        async for state in server.transfers.reports(spec, kind, parent):
            if self._held:  # a status after DONE: nothing is held back any more
                transport.write(self._held)
                self._held = b""
            reply = frame(local_calls_pb2.LocalReply(status=state))
            if state.state == transfers_pb2.TRANSFER_STATE_DONE:
                self._held = reply
            else:
                transport.write(reply)
        transport.write(self._held + end_frame(0))
        self._held = b""
        server.series[kind].count("OK")

    async def _serve_attach(self, request: registry_pb2.AttachRequest) -> None:
        """The worker's events, each written once the connection has room
        for it (its acknowledgement follows the write, as gRPC's follows
        the stream's), until the daemon ends the stream (OK) or refuses it."""
        transport = self._transport
        assert transport is not None
        structlog.contextvars.bind_contextvars(rpc="Attach")
        async for event in self._server.registry.attach(request, self._caller):
            await self._writable.wait()
            transport.write(frame(local_calls_pb2.LocalReply(event=event)))
        transport.write(end_frame(0))
        self._server.series["attach"].count("OK")

    def _serve_unary(self, call: local_calls_pb2.LocalCall, kind: Kind) -> None:
        """GrantTransfer or RevokeTransfer: its response and the end frame, in one write."""
        transport = self._transport
        assert transport is not None
        registry = self._server.registry
        if kind == "grant":
            structlog.contextvars.bind_contextvars(rpc="GrantTransfer")
            parent = traceparent_of(call.traceparent) if call.traceparent else ""
            reply = local_calls_pb2.LocalReply(
                granted=registry.grant(call.grant, self._caller, parent)
            )
        else:
            structlog.contextvars.bind_contextvars(rpc="RevokeTransfer")
            reply = local_calls_pb2.LocalReply(revoked=registry.revoke(call.revoke, self._caller))
        transport.write(frame(reply) + end_frame(0))
        self._server.series[kind].count("OK")

    def _caller(self) -> PeerCred | None:
        return self._peer


def _peer_cred(transport: asyncio.Transport) -> PeerCred | None:
    """The connected process's pid, uid and gid (SO_PEERCRED), as the
    kernel recorded them when it connected."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    except OSError:
        return None
    pid, uid, gid = _PEERCRED.unpack(raw)
    return PeerCred(pid=pid, uid=uid, gid=gid)


def _kind(call: local_calls_pb2.LocalCall) -> Kind:
    return call.WhichOneof("call") or "pull"  # _parsed refused a frame naming no call


def _parsed(body: bytes) -> local_calls_pb2.LocalCall:
    try:
        call = local_calls_pb2.LocalCall.FromString(body)
    except DecodeError:
        raise InvalidArgument("local calls", "the frame is not a LocalCall") from None
    if call.WhichOneof("call") is None:
        raise InvalidArgument("local calls", "a LocalCall that names no call")
    return call
