"""BeginTransfer calls on one long-lived BeginTransferStream per owner
(``adapters/peer_stream``), through the daemon's real peer client and a real
gRPC server on 127.0.0.1 standing in for the owner (its answers are the
test's; the owner's own stream is tried against real daemons in
tests/security/test_begin_transfers.py). Calls share one stream and each
caller gets its own call's answer; calls behind one in flight go as one
message; a caller that gives up (or is cancelled) leaves no lease and no
misrouted answer behind; a stream that fails or ends fails whoever waits
and the next call opens a new one; an owner without the stream gets RPCs."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from grpc import aio

from kvmap.core.errors import DeadlineExceeded, KvmapError, PermissionDenied, Unavailable
from kvmap.core.geometry import WorkerKey
from kvmap.core.transfer_requests import Announcement
from kvmap.daemon.adapters.peer_client import PeerClient
from kvmap.v1 import peer_pb2, peer_pb2_grpc

pytestmark = pytest.mark.timeout(60)

TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class Owner(peer_pb2_grpc.PeerServicer):
    """Answers each stream message with a token per call ("token-<request id>"),
    or PERMISSION_DENIED for a call whose request id starts with "denied".
    A message whose first call is "abort" ends the stream PERMISSION_DENIED,
    "end" ends it OK, "twice" is answered twice. Holds answers while
    ``hold`` is clear."""

    def __init__(self, stream: bool = True) -> None:
        self.stream = stream
        self.streams = 0
        self.messages: list[list[str]] = []  # the request ids of each message
        self.traceparents: list[str] = []
        self.unary: list[str] = []
        self.ended: list[str] = []
        self.hold = asyncio.Event()
        self.hold.set()
        self.arrived = asyncio.Event()

    async def BeginTransferStream(  # noqa: N802  (the gRPC method's name)
        self, requests: AsyncIterator[peer_pb2.BeginTransferStreamRequest], context: Any
    ) -> AsyncIterator[peer_pb2.BeginTransferStreamResponse]:
        self.streams += 1
        if not self.stream:
            # Once the first message is in: the caller's write cannot race
            # the answer (gRPC's client would then report INTERNAL).
            await anext(aiter(requests), None)
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        async for request in requests:
            ids = [c.request_id for c in request.calls]
            self.messages.append(ids)
            self.traceparents += [c.traceparent for c in request.calls]
            self.arrived.set()
            await self.hold.wait()
            if ids[0] == "abort":
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, "not any more")
            if ids[0] == "end":
                return
            answer = peer_pb2.BeginTransferStreamResponse(
                results=[_result(c) for c in request.calls]
            )
            yield answer
            if ids[0] == "twice":
                yield answer

    async def BeginTransfer(  # noqa: N802  (the gRPC method's name)
        self, request: peer_pb2.BeginTransferRequest, context: Any
    ) -> peer_pb2.BeginTransferResponse:
        self.unary.append(request.request_id)
        return peer_pb2.BeginTransferResponse(transfer_token=f"token-{request.request_id}")

    async def EndTransfer(  # noqa: N802  (the gRPC method's name)
        self, request: peer_pb2.EndTransferRequest, context: Any
    ) -> peer_pb2.EndTransferResponse:
        self.ended.append(request.transfer_token)
        return peer_pb2.EndTransferResponse()


def _result(call: peer_pb2.BeginTransferRequest) -> peer_pb2.BeginTransferResult:
    if call.request_id.startswith("denied"):
        code = grpc.StatusCode.PERMISSION_DENIED.value[0]
        return peer_pb2.BeginTransferResult(code=code, message="capability does not allow this")
    return peer_pb2.BeginTransferResult(transfer_token=f"token-{call.request_id}")


def _announcement(request_id: str) -> Announcement:
    return Announcement(
        request_id=request_id, worker=WorkerKey("prefill"), generation=3, agent_name="owner",
        peer_agent="decode", write=False, lease_ms=30_000, blocks=1, nbytes=4096,
        capability="A" * 43, groups=((0, (1,)),), replaces_agents=(), readers=0,
        transfer_id=request_id, traceparent=TRACE,
    )  # fmt: skip


Case = Callable[[Owner, PeerClient, str], Awaitable[None]]


def run(case: Case, stream: bool = True, listed: bool = True) -> None:
    """``case`` against an owner on 127.0.0.1 (serving the stream or not)
    and the daemon's peer client, told (as a handshake tells it) that the
    owner serves the stream or not (``listed``)."""

    async def main() -> None:
        async with _setup(stream, listed) as (owner, client, target):
            await case(owner, client, target)

    asyncio.run(main())


@contextlib.asynccontextmanager
async def _setup(stream: bool, listed: bool) -> AsyncIterator[tuple[Owner, PeerClient, str]]:
    owner = Owner(stream)
    server = aio.server()
    peer_pb2_grpc.add_PeerServicer_to_server(owner, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = PeerClient(5.0)
    target = f"127.0.0.1:{port}"
    client._streams.learn(target, listed)
    try:
        yield owner, client, target
    finally:
        await client.close()
        await server.stop(None)


async def _outcome(
    client: PeerClient, target: str, request_id: str, timeout: float = 10.0
) -> object:
    try:
        return await client.begin(target, _announcement(request_id), timeout)
    except KvmapError as err:
        return err


async def _eventually(check: Callable[[], bool]) -> None:
    for _ in range(500):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not within 5 s")


def test_calls_share_one_stream_and_each_gets_its_own_answer() -> None:
    """Calls one after another, and calls behind one in flight (sent together as
    one message, in order), all go on one stream, with their traceparents in the
    calls; each caller gets its own token, or its own refusal."""

    async def case(owner: Owner, client: PeerClient, target: str) -> None:
        assert await _outcome(client, target, "one") == "token-one"
        assert await _outcome(client, target, "two") == "token-two"
        owner.arrived.clear()
        owner.hold.clear()
        first = asyncio.ensure_future(_outcome(client, target, "first"))
        await asyncio.wait_for(owner.arrived.wait(), 5)
        rest = [asyncio.ensure_future(_outcome(client, target, r)) for r in ("a", "denied-b", "c")]
        await asyncio.sleep(0.1)  # queued behind the first
        owner.hold.set()
        got = [await first, *[await r for r in rest]]
        assert got[:2] == ["token-first", "token-a"] and got[3] == "token-c"
        assert isinstance(got[2], PermissionDenied)
        assert owner.messages == [["one"], ["two"], ["first"], ["a", "denied-b", "c"]]
        assert owner.streams == 1 and owner.unary == []
        assert set(owner.traceparents) == {TRACE}

    run(case)


def test_a_caller_that_gives_up_leaves_no_lease_and_no_misrouted_answer() -> None:
    """A call whose caller's deadline passes while the owner holds it, and one whose
    caller is cancelled, fail their callers; their late answers reach nobody but end
    the leases they granted; the call after them gets its own answer."""

    async def case(owner: Owner, client: PeerClient, target: str) -> None:
        owner.arrived.clear()
        owner.hold.clear()
        late = await _outcome(client, target, "late", timeout=0.2)
        assert isinstance(late, DeadlineExceeded)
        cancelled = asyncio.ensure_future(_outcome(client, target, "cancelled"))
        await asyncio.sleep(0.05)
        cancelled.cancel()
        after = asyncio.ensure_future(_outcome(client, target, "after"))
        owner.hold.set()
        assert await after == "token-after"
        await _eventually(lambda: sorted(owner.ended) == ["token-cancelled", "token-late"])
        assert owner.streams == 1

    run(case)


@pytest.mark.parametrize("how", ["abort", "end", "twice"])
def test_a_stream_that_fails_or_ends_fails_its_caller_and_the_next_call_opens_one(
    how: str,
) -> None:
    """The owner ends the stream with a status (the caller gets it, as its
    BeginTransfer's), without one (UNAVAILABLE: retried by the transfer), or
    answers a message it was not sent (the stream is dropped): the next call
    opens a new stream and gets its token."""

    async def case(owner: Owner, client: PeerClient, target: str) -> None:
        got = await _outcome(client, target, how)
        if how == "abort":
            assert isinstance(got, PermissionDenied) and "not any more" in str(got)
        elif how == "end":
            assert isinstance(got, Unavailable) and "ended the stream" in str(got)
        else:
            assert got == "token-twice"
        await _eventually(lambda: client._streams._streams.get(target) is None)
        assert await _outcome(client, target, "next") == "token-next"
        assert owner.streams == 2

    run(case)


def test_an_owner_without_the_stream_gets_rpcs_until_the_next_handshake() -> None:
    """An owner listed as serving the stream (its last handshake said so) that
    answers UNIMPLEMENTED (replaced by an older release since): the call goes
    as a BeginTransfer and so do later ones, without trying the stream again;
    a handshake listing the stream again lets the next call try it once more."""

    async def case(owner: Owner, client: PeerClient, target: str) -> None:
        assert await _outcome(client, target, "one") == "token-one"
        assert await _outcome(client, target, "two") == "token-two"
        assert owner.unary == ["one", "two"] and owner.streams == 1
        assert not client._streams.supported(target)
        client._streams.learn(target, True)
        assert await _outcome(client, target, "three") == "token-three"
        assert owner.unary == ["one", "two", "three"] and owner.streams == 2

    run(case, stream=False)


def test_an_owner_whose_handshake_does_not_list_the_stream_gets_only_rpcs() -> None:
    """An owner that does not list the stream in its handshake (a release
    before it) is never sent one, even one that would serve it: every call
    goes as a BeginTransfer RPC."""

    async def case(owner: Owner, client: PeerClient, target: str) -> None:
        assert await _outcome(client, target, "one") == "token-one"
        assert await _outcome(client, target, "two") == "token-two"
        assert owner.unary == ["one", "two"] and owner.streams == 0

    run(case, listed=False)


def test_a_write_that_fails_unexpectedly_fails_its_caller_at_once() -> None:
    """A write that fails for a reason that is not the stream ending (an
    error gRPC does not raise for an ended call) fails its caller UNAVAILABLE
    at once, not after its deadline; the stream is dropped, and the next
    call opens a new one and gets its token."""

    async def case(owner: Owner, client: PeerClient, target: str) -> None:
        assert await _outcome(client, target, "one") == "token-one"

        async def broken(request: object) -> None:
            raise RuntimeError("a write that fails unexpectedly")

        client._streams._streams[target].call.write = broken  # type: ignore[method-assign]
        started = asyncio.get_running_loop().time()
        got = await _outcome(client, target, "lost")
        assert isinstance(got, Unavailable), got
        assert asyncio.get_running_loop().time() - started < 5.0
        await _eventually(lambda: client._streams._streams.get(target) is None)
        assert await _outcome(client, target, "next") == "token-next"
        assert owner.streams == 2

    run(case)
