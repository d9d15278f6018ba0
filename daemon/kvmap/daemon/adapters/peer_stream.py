"""BeginTransfer calls as the messages of one long-lived
``Peer.BeginTransferStream`` per owner, where a BeginTransfer RPC costs a
call's set-up on both daemons: on loopback here a grpc.aio unary round trip
alone takes ~1.5 ms, a message on an open stream ~0.8 ms, and the owner's
per-call check of the caller runs once per stream (the owner's round trip
went from 2.0-2.8 ms to 1.4-2.6 ms a pull at one pull in flight).

The owner answers each request message with one response, in order, so the
answers go to the waiting callers first in, first out. A caller that gave
up (its deadline) is not waited for, but its message's answer still comes:
the leases it granted to nobody are ended at once (EndTransfer) instead of
pinning the owner's blocks until they expire.

A stream that fails or ends fails every call still waiting on it (with the
stream's status, or UNAVAILABLE where it ended without one: the owner
stopped); the next call opens a new stream. Calls go on a stream only to an
owner whose last handshake listed ``PEER_FEATURE_BEGIN_TRANSFER_STREAM``
(``learn``): an owner without the method may end the stream's first message
with INTERNAL instead of UNIMPLEMENTED when the write races its answer
(gRPC's client then reports its own failed write), and the call would fail
for good. Every other owner gets BeginTransfer and BeginTransfers RPCs. An
owner that listed it and then answers UNIMPLEMENTED (replaced by an older
release since) gets RPCs until its next handshake.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Awaitable, Callable

import grpc
import structlog
from grpc import aio

from kvmap.core.errors import DeadlineExceeded, Unavailable
from kvmap.daemon.adapters.peer_batches import EndLease
from kvmap.v1 import peer_pb2

log = structlog.get_logger("kvmapd.peers")

# A BeginTransferStreamRequest's wire bytes (``transfer_wire.stream_request_bytes``):
# the stream is opened without a request serializer.
Request = bytes
Answer = peer_pb2.BeginTransferStreamResponse
# Opens ``target``'s stream (its channel's, with the peers' metadata).
Open = Callable[[str], Awaitable["aio.StreamStreamCall[Request, Answer]"]]


class StreamUnsupported(Exception):
    """The owner does not serve BeginTransferStream: send the call as an RPC."""


class _Stream:
    __slots__ = ("call", "outbox", "reader", "waiting", "writer")

    def __init__(self, call: aio.StreamStreamCall[Request, Answer]) -> None:
        self.call = call
        # One future per message sent and not yet answered, in sending order.
        self.waiting: collections.deque[asyncio.Future[Answer]] = collections.deque()
        # Messages for the writer, queued with their futures in one step: a
        # caller cancelled mid-send cannot leave a future without its message
        # (every later answer would go to the wrong caller).
        self.outbox: asyncio.Queue[Request] = asyncio.Queue()
        self.reader: asyncio.Task[None] | None = None
        self.writer: asyncio.Task[None] | None = None


class BeginStreams:
    def __init__(self, open_stream: Open, end: EndLease) -> None:
        self._open = open_stream
        self._end = end
        self._streams: dict[str, _Stream] = {}
        # Owners whose last handshake listed the stream.
        self._served: set[str] = set()

    def supported(self, target: str) -> bool:
        """Whether calls to ``target`` go on its stream."""
        return target in self._served

    def learn(self, target: str, served: bool) -> None:
        """A handshake with ``target`` said whether it serves the stream."""
        if served:
            self._served.add(target)
        else:
            self._served.discard(target)

    async def send(self, target: str, request: Request, timeout_s: float) -> Answer:
        """The owner's answer to ``request`` (its results, one per call);
        raises the stream's ``AioRpcError`` where it failed, ``Unavailable``
        where it ended, ``DeadlineExceeded`` after ``timeout_s``, and
        ``StreamUnsupported`` where the owner does not serve it."""
        # A stream leaves ``_streams`` the moment it is over (``_over``), and
        # nothing below awaits before the call is queued on it.
        stream = self._streams.get(target) or await self._start(target)
        answer: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        stream.waiting.append(answer)
        stream.outbox.put_nowait(request)
        try:
            async with asyncio.timeout(timeout_s):
                return await answer
        except TimeoutError:
            raise DeadlineExceeded(f"remote daemon {target}: no answer in {timeout_s}s") from None
        finally:
            # Given up (or answered): a late answer's leases are ended (_read).
            answer.cancel()

    async def _start(self, target: str) -> _Stream:
        call = await self._open(target)
        stream = self._streams.get(target)
        if stream is not None:  # another call opened one meanwhile
            call.cancel()
            return stream
        stream = self._streams[target] = _Stream(call)
        loop = asyncio.get_running_loop()
        stream.writer = loop.create_task(self._write(stream))
        stream.reader = loop.create_task(self._read(target, stream))
        return stream

    @staticmethod
    async def _write(stream: _Stream) -> None:
        while True:
            request = await stream.outbox.get()
            try:
                await stream.call.write(request)
            except (asyncio.InvalidStateError, aio.AioRpcError):
                return  # the stream is over: its reader fails whoever waits
            except Exception:
                # Not the stream ending: without its writer the stream would
                # leave every later caller to wait out its deadline. Cancelled,
                # its reader fails them at once (UNAVAILABLE: they try again).
                log.exception("peer_stream_write_failed")
                stream.call.cancel()
                return

    async def _read(self, target: str, stream: _Stream) -> None:
        ended: BaseException = Unavailable(f"remote daemon {target}: it ended the stream")
        try:
            while True:
                answer = await stream.call.read()
                if not isinstance(answer, Answer):  # grpc.aio.EOF: the owner ended it
                    break
                if not stream.waiting:
                    log.warning("peer_answered_unasked", target=target[:256])
                    ended = Unavailable(f"remote daemon {target}: an answer to no message")
                    stream.call.cancel()
                    break
                waiting = stream.waiting.popleft()
                if waiting.done():  # its caller gave up
                    self._abandoned(target, answer)
                else:
                    waiting.set_result(answer)
        except aio.AioRpcError as err:
            ended = err
            if err.code() is grpc.StatusCode.UNIMPLEMENTED:
                log.info("peer_without_begin_stream", target=target[:256])
                self._served.discard(target)
                ended = StreamUnsupported(target)
        except asyncio.CancelledError:
            ended = Unavailable(f"remote daemon {target}: the stream was closed")
            raise
        finally:
            self._over(target, stream, ended)

    def _over(self, target: str, stream: _Stream, ended: BaseException) -> None:
        """The stream is over: whoever still waits on it fails with ``ended``."""
        if stream.writer is not None:
            stream.writer.cancel()
        if self._streams.get(target) is stream:
            del self._streams[target]
        while stream.waiting:
            waiting = stream.waiting.popleft()
            if not waiting.done():
                waiting.set_exception(ended)

    def _abandoned(self, target: str, answer: Answer) -> None:
        """Leases granted to a caller that gave up: ended now."""
        for result in answer.results:
            if not result.code and result.transfer_token:
                self._end(target, result.transfer_token)

    def drop(self, target: str) -> None:
        """``target``'s channel is closed: so is its stream."""
        stream = self._streams.pop(target, None)
        if stream is not None:
            stream.call.cancel()

    async def close(self) -> None:
        streams = list(self._streams.values())
        self._streams.clear()
        for stream in streams:
            stream.call.cancel()
        for stream in streams:
            if stream.reader is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await stream.reader
