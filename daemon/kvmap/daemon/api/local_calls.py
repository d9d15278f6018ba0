"""The local calls socket (``<socket>.calls``): Transfers.Pull and Push as
length-prefixed protobuf frames (``protos/kvmap/v1/local_calls.proto``),
for the worker that pulls on every request.

Why it exists: on this socket a pull's call and answer cost what a Unix
socket costs (~0.06 ms and ~0.02 ms of the caller's CPU), where a gRPC call
on the same machine costs 1-1.7 ms at the median and 4 ms at p95, with 0.6 ms
of the caller's CPU (docs/benchmarks.md, "The hop, fifth round"). The
transfer itself is the gRPC servicer's (``TransfersService.reports``), so a
call is checked, run, tracked, logged, counted and refused exactly as the
same gRPC call is (``rpc.refused``, under the method's gRPC metric series).

Who may call: whoever may open the gRPC Unix socket (the socket is made
``0660`` beside it; Pull and Push ask for no credential token there
either). What a caller can do to the daemon is bounded: a frame over the
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
import struct
import time
from typing import Literal

import structlog
from google.protobuf.message import DecodeError

from kvmap.core.config import MAX_MESSAGE_BYTES
from kvmap.core.errors import InvalidArgument, KvmapError, ResourceExhausted, Unavailable
from kvmap.daemon.adapters.grpc_codes import status_number
from kvmap.daemon.adapters.metrics import Metrics
from kvmap.daemon.api.rpc import MethodSeries, OnFailure, new_rpc_id, refused
from kvmap.daemon.api.services import TransfersService
from kvmap.daemon.api.status import grpc_status
from kvmap.tracing import traceparent_of
from kvmap.v1 import local_calls_pb2, transfers_pb2

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

Kind = Literal["pull", "push"]


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
        max_frame_bytes: int = MAX_MESSAGE_BYTES,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.transfers = transfers
        self.on_failure = on_failure
        self.max_frame_bytes = max_frame_bytes
        self.max_connections = max_connections
        self.series: dict[Kind, MethodSeries] = {
            "pull": MethodSeries(metrics, "/kvmap.v1.Transfers/Pull"),
            "push": MethodSeries(metrics, "/kvmap.v1.Transfers/Push"),
        }
        self.connections: set[_Connection] = set()
        self._server: asyncio.AbstractServer | None = None

    async def start(self, path: str) -> None:
        """Listen on ``path`` (a stale file there is replaced), ``0660``."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _Connection(self), path)
        os.chmod(path, 0o660)

    def close(self) -> None:
        """Stop accepting; end every connection (a call still running is cancelled)."""
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.abort()


class _Connection(asyncio.Protocol):
    """One client connection: frames in, a call at a time, frames out."""

    def __init__(self, server: LocalCallsServer) -> None:
        self._server = server
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._call: asyncio.Task[None] | None = None
        self._stalled: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
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
        if self._call is not None:
            self._call.cancel()  # as gRPC cancels the call of a client gone

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def data_received(self, data: bytes) -> None:
        if self._call is not None:
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
        self._call = asyncio.get_running_loop().create_task(self._serve(body))

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
        transport = self._transport
        assert transport is not None
        server = self._server
        kind: Kind = "pull"
        structlog.contextvars.bind_contextvars(rpc="Pull", rpc_id=new_rpc_id(), listener=LISTENER)
        started = time.perf_counter()
        # DONE goes out with the end frame, in one write: the caller reads
        # both at one wake-up instead of being woken for each.
        held = b""
        try:
            call = _parsed(body)
            kind = "push" if call.WhichOneof("call") == "push" else "pull"
            spec = call.push.spec if kind == "push" else call.pull.spec
            parent = traceparent_of(call.traceparent) if call.traceparent else ""
            structlog.contextvars.bind_contextvars(rpc=kind.capitalize())
            async for state in server.transfers.reports(spec, kind, parent):
                if held:  # a status after DONE: nothing is held back any more
                    transport.write(held)
                    held = b""
                reply = frame(local_calls_pb2.LocalReply(status=state))
                if state.state == transfers_pb2.TRANSFER_STATE_DONE:
                    held = reply
                else:
                    transport.write(reply)
            transport.write(held + end_frame(0))
            server.series[kind].count("OK")
        except Exception as err:  # every failure becomes its status, as in rpc
            code, message, reason = refused(err, server.series[kind], LISTENER, server.on_failure)
            del err
            transport.write(held + end_frame(status_number(code), message, reason))
        finally:
            server.series[kind].seconds.observe(time.perf_counter() - started)
            self._call = None


def _parsed(body: bytes) -> local_calls_pb2.LocalCall:
    try:
        call = local_calls_pb2.LocalCall.FromString(body)
    except DecodeError:
        raise InvalidArgument("local calls", "the frame is not a LocalCall") from None
    if call.WhichOneof("call") is None:
        raise InvalidArgument("local calls", "a LocalCall with neither pull nor push")
    return call
