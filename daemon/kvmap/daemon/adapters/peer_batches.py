"""BeginTransfer calls to one owner that arrive while a call to that owner is
in flight wait, and go together as one ``Peer.BeginTransfers`` call when it
returns. A lone call goes at once, as a plain BeginTransfer, so a single
pull waits for nothing; at concurrency N the two daemons make a few calls
instead of N, and each call costs both of them gRPC and event-loop work
(batching took the owner's event loop from 1.25-1.37 to 0.86-1.05 ms a
pull at 32 pulls in flight). An owner that does not serve
BeginTransfers (a release before it) gets every call alone from then on,
until the next handshake with it.

Each call is answered as its BeginTransfer would have been: the owner checks
and answers every call of a batch on its own, in order, and a refused call
changes nothing for the others.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Awaitable, Callable, Sequence

import grpc
import structlog
from grpc import aio

from kvmap.core.errors import DeadlineExceeded, KvmapError, Unavailable
from kvmap.core.transfer_wire import (
    MAX_BATCHED_CALL_BYTES,
    MAX_BEGIN_CALLS,
    MAX_BEGIN_CALLS_BYTES,
)
from kvmap.daemon.adapters.grpc_codes import reason_of, status_from_number
from kvmap.v1 import peer_pb2

log = structlog.get_logger("kvmapd.peers")

# A plain BeginTransfer: (target, call, its serialized bytes or b"" when it
# has none yet, timeout) -> the lease token.
SendOne = Callable[[str, peer_pb2.BeginTransferRequest, bytes, float], Awaitable[str]]
# Several calls at once (a stream message, else Peer.BeginTransfers):
# (target, each call with its serialized bytes, timeout) -> the owner's
# answer, one result per call.
SendMany = Callable[
    [str, Sequence[tuple[peer_pb2.BeginTransferRequest, bytes]], float],
    Awaitable[peer_pb2.BeginTransfersResponse],
]
# The error a call's BeginTransfer would have raised, had it ended with
# (target, call, status, details, kvmap-reason): a refused call's result, or
# the failed BeginTransfers call, for each of its calls.
Failure = Callable[[str, peer_pb2.BeginTransferRequest, grpc.StatusCode, str, str], KvmapError]
# Ends a lease nobody waits for any more (EndTransfer, best effort), off the
# caller's path: (target, lease token).
EndLease = Callable[[str, str], None]


def outcomes(
    target: str,
    requests: Sequence[peer_pb2.BeginTransferRequest],
    results: Sequence[peer_pb2.BeginTransferResult],
    failure: Failure,
) -> list[str | KvmapError]:
    """Each call's outcome from the owner's answer to the calls sent together
    (a BeginTransfers call, or a message of the stream): its lease token, or
    the error its own BeginTransfer would have raised; every call fails
    INTERNAL when the answer does not have one result per call."""
    if len(results) != len(requests):
        log.warning("peer_sent_wrong_results", target=target[:256],
                    calls=len(requests), results=len(results))  # fmt: skip
        wrong = "the answer does not have one result per call"
        return [failure(target, r, grpc.StatusCode.INTERNAL, wrong, "") for r in requests]
    return [
        failure(target, request, status_from_number(r.code), r.message, r.reason)
        if r.code
        else r.transfer_token
        for request, r in zip(requests, results, strict=True)
    ]


class _Call:
    __slots__ = ("data", "deadline", "future", "request", "size")

    def __init__(
        self, request: peer_pb2.BeginTransferRequest, data: bytes, deadline: float
    ) -> None:
        self.request = request
        # Serialized once, here: its size decides its batch, and the batch's
        # message is these bytes joined (``transfer_wire.stream_request_bytes``).
        self.data = data
        self.size = len(data)
        self.deadline = deadline
        self.future: asyncio.Future[str] = asyncio.get_running_loop().create_future()


class BeginBatches:
    def __init__(
        self,
        send_one: SendOne,
        send_many: SendMany,
        *,
        failure: Failure,
        end: EndLease,
    ) -> None:
        self._send_one = send_one
        self._send_many = send_many
        self._failure = failure
        self._end = end
        self._busy: collections.Counter[str] = collections.Counter()
        self._queued: dict[str, collections.deque[_Call]] = {}
        self._alone_only: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def forget(self, target: str) -> None:
        """A new handshake with ``target``: it may serve BeginTransfers now."""
        self._alone_only.discard(target)

    async def begin(
        self, target: str, request: peer_pb2.BeginTransferRequest, timeout_s: float
    ) -> str:
        """The call's lease token (or the error its BeginTransfer raises)."""
        if not self._busy[target] or target in self._alone_only:
            return await self._alone(target, request, timeout_s)
        data = request.SerializeToString()  # only a call that may wait is serialized here
        if len(data) > MAX_BATCHED_CALL_BYTES:
            return await self._alone(target, request, timeout_s)
        loop = asyncio.get_running_loop()
        call = _Call(request, data, loop.time() + timeout_s)
        self._queued.setdefault(target, collections.deque()).append(call)
        try:
            # Shielded: the future is the call's, whoever waits for it.
            return await asyncio.wait_for(asyncio.shield(call.future), timeout_s)
        except TimeoutError:
            raise DeadlineExceeded(f"remote daemon {target}: no answer in {timeout_s}s") from None
        finally:
            # Given up (or answered): a call not sent yet is dropped, and a
            # lease granted to nobody is ended (_settle).
            call.future.cancel()

    async def _alone(
        self, target: str, request: peer_pb2.BeginTransferRequest, timeout_s: float
    ) -> str:
        self._busy[target] += 1
        try:
            return await self._send_one(target, request, b"", timeout_s)
        finally:
            self._done(target)

    def _done(self, target: str) -> None:
        """A call to ``target`` returned: send what queued meanwhile."""
        self._busy[target] -= 1
        if self._busy[target] <= 0:
            del self._busy[target]
            self._flush(target)

    def _flush(self, target: str) -> None:
        queue = self._queued.get(target)
        calls: list[_Call] = []
        size = 0
        while queue and len(calls) < MAX_BEGIN_CALLS:
            if queue[0].future.done():  # its caller gave up before it was sent
                queue.popleft()
                continue
            if calls and size + queue[0].size > MAX_BEGIN_CALLS_BYTES:
                break
            call = queue.popleft()
            calls.append(call)
            size += call.size
        if queue is not None and not queue:
            del self._queued[target]
        if not calls:
            return
        self._busy[target] += 1
        task = asyncio.get_running_loop().create_task(self._send(target, calls))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, target: str, calls: list[_Call]) -> None:
        try:
            if len(calls) == 1 or target in self._alone_only:
                await asyncio.gather(*(self._send_alone(target, c) for c in calls))
            else:
                await self._send_batch(target, calls)
        except Exception as err:
            # Not a status (a bug, or an error type nothing here expected):
            # its callers still hear at once, UNAVAILABLE so that their
            # transfers try again, instead of waiting out their deadlines.
            log.exception("peer_calls_lost", target=target[:256], calls=len(calls))
            lost = Unavailable(f"remote daemon {target}: the call failed ({type(err).__name__})")
            for call in calls:
                self._settle(target, call, lost)
        finally:
            self._done(target)

    async def _send_alone(self, target: str, call: _Call) -> None:
        timeout = max(call.deadline - asyncio.get_running_loop().time(), 0.001)
        try:
            sent = await self._send_one(target, call.request, call.data, timeout)
            self._settle(target, call, sent)
        except KvmapError as err:
            self._settle(target, call, err)

    async def _send_batch(self, target: str, calls: list[_Call]) -> None:
        now = asyncio.get_running_loop().time()
        timeout = max(max(c.deadline for c in calls) - now, 0.001)
        try:
            answer = await self._send_many(target, [(c.request, c.data) for c in calls], timeout)
        except aio.AioRpcError as err:
            if err.code() is grpc.StatusCode.UNIMPLEMENTED:
                log.info("peer_without_begin_transfers", target=target[:256])
                self._alone_only.add(target)
                await asyncio.gather(*(self._send_alone(target, c) for c in calls))
                return
            reason = reason_of(err.trailing_metadata())
            self._fail_each(target, calls, err.code(), err.details() or "", reason)
            return
        except KvmapError as err:  # the channel could not be had (the allow-list, say)
            for call in calls:
                self._settle(target, call, err)
            return
        requests = [c.request for c in calls]
        got = outcomes(target, requests, answer.results, self._failure)
        for call, outcome in zip(calls, got, strict=True):
            self._settle(target, call, outcome)

    def _fail_each(
        self, target: str, calls: list[_Call], status: grpc.StatusCode, details: str, reason: str
    ) -> None:
        """Every call of a batch that failed as a whole fails as its own
        BeginTransfer would have with that status."""
        for call in calls:
            self._settle(target, call, self._failure(target, call.request, status, details, reason))

    def _settle(self, target: str, call: _Call, outcome: str | KvmapError) -> None:
        """Hand the call's caller its outcome; a lease granted to a caller
        that gave up meanwhile is ended at once instead of running out."""
        if not call.future.done():
            if isinstance(outcome, KvmapError):
                call.future.set_exception(outcome)
            else:
                call.future.set_result(outcome)
            return
        if isinstance(outcome, str) and outcome:
            self._end(target, outcome)

    async def close(self) -> None:
        """Wait for the calls in flight (their callers are answered)."""
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._tasks, return_exceptions=True)
