"""BeginTransfer batching (``adapters/peer_batches``) through the daemon's real
peer client and a real gRPC server on 127.0.0.1 standing in for the owner
(its answers are the test's; the owner's checks are tested against real
daemons in tests/security/test_begin_transfers.py). A lone call goes at
once as a BeginTransfer; calls that arrive while one is in flight go
together as one BeginTransfers, in order, each answered as its own call
would have been; an owner without BeginTransfers gets every call alone; a
caller that gives up leaves no lease behind."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
import pytest
from grpc import aio

from kvmap.core.errors import (
    HANDSHAKE_AGAIN,
    DeadlineExceeded,
    KvmapError,
    PermissionDenied,
    StaleGeneration,
    Unavailable,
)
from kvmap.core.geometry import WorkerKey
from kvmap.core.transfer_requests import Announcement
from kvmap.core.transfer_wire import MAX_BATCHED_CALL_BYTES
from kvmap.daemon.adapters.grpc_codes import REASON_KEY
from kvmap.daemon.adapters.peer_batches import BeginBatches
from kvmap.daemon.adapters.peer_client import PeerClient
from kvmap.tracing import TRACEPARENT
from kvmap.v1 import peer_pb2, peer_pb2_grpc

pytestmark = pytest.mark.timeout(60)

TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
# The owner's answer to a call, by request id: a token, or a refusal.
Answer = Callable[[peer_pb2.BeginTransferRequest], str | tuple[grpc.StatusCode, str, str]]


def _answer(req: peer_pb2.BeginTransferRequest) -> str | tuple[grpc.StatusCode, str, str]:
    if req.request_id.startswith("denied"):
        return grpc.StatusCode.PERMISSION_DENIED, "capability does not allow this transfer", ""
    if req.request_id.startswith("stale"):
        return grpc.StatusCode.FAILED_PRECONDITION, "generation 3 is stale", HANDSHAKE_AGAIN
    return f"token-{req.request_id}"


class Owner(peer_pb2_grpc.PeerServicer):
    """Records every call; holds BeginTransfer answers while ``hold`` is clear."""

    def __init__(self, batches: bool = True) -> None:
        self.batches = batches
        # How BeginTransfers goes wrong as a whole: "refuse" (a status for
        # the whole request) or "short" (one result too few); "" answers.
        self.batch_fault = ""
        self.calls: list[tuple[str, list[str], str]] = []  # (method, request ids, traceparent)
        self.ended: list[str] = []
        self.hold = asyncio.Event()
        self.hold.set()
        self.arrived = asyncio.Event()

    async def BeginTransfer(  # noqa: N802  (the gRPC method's name)
        self, request: peer_pb2.BeginTransferRequest, context: Any
    ) -> peer_pb2.BeginTransferResponse:
        meta = dict(context.invocation_metadata())
        self.calls.append(("one", [request.request_id], str(meta.get(TRACEPARENT, ""))))
        self.arrived.set()
        await self.hold.wait()
        answer = _answer(request)
        if isinstance(answer, tuple):
            code, message, reason = answer
            await context.abort(
                code, message, trailing_metadata=((REASON_KEY, reason),) if reason else ()
            )
        return peer_pb2.BeginTransferResponse(transfer_token=answer)

    async def BeginTransfers(  # noqa: N802  (the gRPC method's name)
        self, request: peer_pb2.BeginTransfersRequest, context: Any
    ) -> peer_pb2.BeginTransfersResponse:
        if not self.batches:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        self.calls.append(
            (
                "many",
                [c.request_id for c in request.calls],
                ",".join(c.traceparent for c in request.calls),
            )
        )
        await self.hold.wait()
        if self.batch_fault == "refuse":
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many leases")
        results = []
        for call in request.calls[: -1 if self.batch_fault == "short" else None]:
            answer = _answer(call)
            if isinstance(answer, tuple):
                code, message, reason = answer
                results.append(
                    peer_pb2.BeginTransferResult(code=code.value[0], message=message, reason=reason)
                )
            else:
                results.append(peer_pb2.BeginTransferResult(transfer_token=answer))
        return peer_pb2.BeginTransfersResponse(results=results)

    async def EndTransfer(  # noqa: N802  (the gRPC method's name)
        self, request: peer_pb2.EndTransferRequest, context: Any
    ) -> peer_pb2.EndTransferResponse:
        self.ended.append(request.transfer_token)
        return peer_pb2.EndTransferResponse()


async def _serve(owner: Owner) -> tuple[aio.Server, str]:
    server = aio.server()
    peer_pb2_grpc.add_PeerServicer_to_server(owner, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _announcement(request_id: str, ids: int = 8) -> Announcement:
    return Announcement(
        request_id=request_id, worker=WorkerKey("prefill"), generation=3, agent_name="owner",
        peer_agent="decode", write=False, lease_ms=30_000, blocks=ids, nbytes=ids * 4096,
        capability="A" * 43, groups=((0, tuple(range(ids))),), replaces_agents=(), readers=0,
        transfer_id=request_id, traceparent=TRACE,
    )  # fmt: skip


Case = Callable[["Owner", PeerClient, str], Awaitable[None]]


def run(case: Case, batches: bool = True) -> None:
    """``case`` against an owner on 127.0.0.1 and the daemon's peer client."""

    async def main() -> None:
        async with _setup(batches) as (owner, client, target):
            await case(owner, client, target)

    asyncio.run(main())


@contextlib.asynccontextmanager
async def _setup(batches: bool) -> AsyncIterator[tuple[Owner, PeerClient, str]]:
    owner = Owner(batches)
    server, target = await _serve(owner)
    client = PeerClient(5.0)
    try:
        yield owner, client, target
    finally:
        await client.close()
        await server.stop(None)


async def _outcome(client: PeerClient, target: str, request_id: str, ids: int = 8) -> object:
    try:
        return await client.begin(target, _announcement(request_id, ids), 10.0)
    except KvmapError as err:
        return err


async def _first_held(owner: Owner, client: PeerClient, target: str) -> asyncio.Future[object]:
    """A first call that the owner holds; returns once it has arrived."""
    owner.arrived.clear()
    owner.hold.clear()
    first = asyncio.ensure_future(_outcome(client, target, "first"))
    await asyncio.wait_for(owner.arrived.wait(), 5)
    return first


def _queue(client: PeerClient, target: str, *request_ids: str) -> list[asyncio.Future[object]]:
    return [asyncio.ensure_future(_outcome(client, target, r)) for r in request_ids]


def test_calls_behind_one_in_flight_go_as_one_batch_in_order() -> None:
    """While the first call is held, three more queue; they reach the owner as one
    BeginTransfers, in order, with their traceparents in the calls (the lone one's is
    metadata), and each caller gets what its own BeginTransfer would have given it: a
    token, PERMISSION_DENIED as it is, or a stale generation (HANDSHAKE_AGAIN)."""

    async def case(owner: Owner, client: PeerClient, target: str) -> None:
        first = await _first_held(owner, client, target)
        rest = _queue(client, target, "ok-1", "denied-2", "stale-3")
        await asyncio.sleep(0.1)  # queued behind the first
        owner.hold.set()
        got = [await first, *[await r for r in rest]]
        assert owner.calls == [
            ("one", ["first"], TRACE),
            ("many", ["ok-1", "denied-2", "stale-3"], f"{TRACE},{TRACE},{TRACE}"),
        ]
        assert got[:2] == ["token-first", "token-ok-1"]
        assert isinstance(got[2], PermissionDenied)
        assert "PERMISSION_DENIED: capability does not allow this transfer" in str(got[2])
        assert isinstance(got[3], StaleGeneration)

    run(case)


@pytest.mark.parametrize(
    ("fault", "error", "words"),
    [
        ("refuse", Unavailable, "RESOURCE_EXHAUSTED: too many leases"),
        ("short", Unavailable, "INTERNAL: the answer does not have one result per call"),
    ],
)
def test_a_batch_that_fails_as_a_whole_fails_each_of_its_calls(
    fault: str, error: type[KvmapError], words: str
) -> None:
    """A BeginTransfers refused as a whole, or answered with a result missing, fails
    every call of the batch as its own BeginTransfer with that status would have failed
    (naming the owner), and takes no lease; the lone first call is not touched."""

    async def case(owner: Owner, client: PeerClient, target: str) -> None:
        owner.batch_fault = fault
        first = await _first_held(owner, client, target)
        rest = _queue(client, target, "a", "b")
        await asyncio.sleep(0.1)
        owner.hold.set()
        assert await first == "token-first"
        got = [await r for r in rest]
        assert [m for m, _, _ in owner.calls] == ["one", "many"]
        for err in got:
            assert type(err) is error, err
            assert f"remote daemon {target}: {words}" in str(err)
        assert owner.ended == []

    run(case)


def test_a_lone_call_goes_at_once_as_begin_transfer() -> None:
    """Calls one after another never wait for each other: each is a BeginTransfer."""

    async def case(owner: Owner, client: PeerClient, target: str) -> None:
        got = [await _outcome(client, target, f"r{i}") for i in range(3)]
        assert got == ["token-r0", "token-r1", "token-r2"]
        assert [m for m, _, _ in owner.calls] == ["one", "one", "one"]

    run(case)


def test_an_owner_without_begin_transfers_gets_every_call_alone() -> None:
    """An owner of a release before BeginTransfers answers it UNIMPLEMENTED: the queued
    calls are sent alone, each answered, and later ones never try a batch again."""

    async def case(owner: Owner, client: PeerClient, target: str) -> None:
        first = await _first_held(owner, client, target)
        rest = _queue(client, target, "q0", "q1")
        await asyncio.sleep(0.1)
        owner.hold.set()
        assert [await first, *[await r for r in rest]] == ["token-first", "token-q0", "token-q1"]
        first = await _first_held(owner, client, target)
        later = _queue(client, target, "later")
        await asyncio.sleep(0.1)
        owner.hold.set()
        assert [await first, await later[0]] == ["token-first", "token-later"]
        assert [m for m, _, _ in owner.calls] == ["one"] * 5

    run(case, batches=False)


def test_a_caller_that_gives_up_leaves_no_lease() -> None:
    """A queued caller whose deadline passes while its batch is held hears
    DEADLINE_EXCEEDED; the owner's token for its call, granted after it gave up, is ended
    at once (EndTransfer), not left to run out; the other callers are answered as usual."""

    async def case(owner: Owner, client: PeerClient, target: str) -> None:
        first = await _first_held(owner, client, target)
        patient = _queue(client, target, "patient")
        hasty = asyncio.ensure_future(client.begin(target, _announcement("hasty"), 0.3))
        await asyncio.sleep(0.05)
        owner.hold.set()  # the first is answered; the batch goes...
        assert await first == "token-first"
        owner.hold.clear()  # ...and is held past the hasty caller's deadline
        with pytest.raises(DeadlineExceeded):
            await hasty
        owner.hold.set()
        assert await patient[0] == "token-patient"
        for _ in range(100):
            if owner.ended:
                break
            await asyncio.sleep(0.02)
        assert owner.calls[1][:2] == ("many", ["patient", "hasty"])
        assert owner.ended == ["token-hasty"]

    run(case)


def test_a_caller_that_gives_up_before_its_batch_is_not_sent() -> None:
    """A queued call whose caller gave up before the batch left is not sent at all."""

    async def case(owner: Owner, client: PeerClient, target: str) -> None:
        first = await _first_held(owner, client, target)
        with pytest.raises(DeadlineExceeded):
            await client.begin(target, _announcement("hasty"), 0.1)
        kept = _queue(client, target, "kept")
        await asyncio.sleep(0.05)
        owner.hold.set()
        assert (await first, await kept[0]) == ("token-first", "token-kept")
        assert owner.calls[1][:2] == ("one", ["kept"])  # alone: the hasty call was dropped
        assert owner.ended == []

    run(case)


def test_a_large_call_goes_alone() -> None:
    """A call larger than a batch may carry is never batched with others."""

    async def case(owner: Owner, client: PeerClient, target: str) -> None:
        first = await _first_held(owner, client, target)
        big = asyncio.ensure_future(_outcome(client, target, "big", MAX_BATCHED_CALL_BYTES // 2))
        small = _queue(client, target, "small")
        await asyncio.sleep(0.1)
        owner.hold.set()
        assert [await first, await big, await small[0]] == [
            "token-first", "token-big", "token-small"
        ]  # fmt: skip
        assert sorted((m, ids[0]) for m, ids, _ in owner.calls) == [
            ("one", "big"), ("one", "first"), ("one", "small")
        ]  # fmt: skip

    run(case)


def test_a_queued_call_whose_send_fails_unexpectedly_is_answered_at_once() -> None:
    """A call queued behind one in flight whose own send then raises an
    error that is no status (a bug, an error type nobody expected) fails
    UNAVAILABLE as soon as it is sent (its transfer tries again), instead of
    leaving its caller to wait out its 30 s deadline."""

    async def main() -> None:
        release = asyncio.Event()
        sent: list[str] = []
        serialized: list[bytes] = []

        async def send_one(
            target: str, req: peer_pb2.BeginTransferRequest, data: bytes, timeout: float
        ) -> str:
            sent.append(req.request_id)
            serialized.append(data)
            if req.request_id == "held":
                await release.wait()
                return "token-held"
            raise RuntimeError("a bug in the sender")

        async def send_many(
            target: str,
            calls: Sequence[tuple[peer_pb2.BeginTransferRequest, bytes]],
            timeout: float,
        ) -> peer_pb2.BeginTransfersResponse:
            raise AssertionError("one queued call goes alone")

        def failure(
            target: str, req: peer_pb2.BeginTransferRequest, code: grpc.StatusCode, m: str, r: str
        ) -> KvmapError:
            raise AssertionError("no status came back")

        batches = BeginBatches(send_one, send_many, failure=failure, end=lambda t, tok: None)
        held = asyncio.ensure_future(
            batches.begin("owner:1", peer_pb2.BeginTransferRequest(request_id="held"), 30.0)
        )
        await asyncio.sleep(0.05)
        queued = asyncio.ensure_future(
            batches.begin("owner:1", peer_pb2.BeginTransferRequest(request_id="queued"), 30.0)
        )
        await asyncio.sleep(0.05)
        release.set()
        assert await asyncio.wait_for(held, 5.0) == "token-held"
        with pytest.raises(Unavailable, match="the call failed"):
            await asyncio.wait_for(queued, 5.0)
        assert sent == ["held", "queued"]
        # The queued call goes alone with the bytes it was serialized into
        # when it queued (not serialized again); the first had none yet.
        queued_bytes = peer_pb2.BeginTransferRequest(request_id="queued").SerializeToString()
        assert serialized == [b"", queued_bytes]
        await batches.close()

    asyncio.run(main())
