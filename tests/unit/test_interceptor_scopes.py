"""What the two server interceptors do around each call, now that their
scopes are plain async context managers (``rpc._Scope``, ``authorization.
_Guard``) and the peer check remembers its answer per peer string: every
outcome of a call (OK, a kvmap error, an abort the handler sent itself, a
cancellation) is counted, timed, logged in its request's context and
answered exactly as before; a refused peer is refused on every call, before
its request is read."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
import structlog
from grpc import aio

from kvmap.core.errors import Unavailable
from kvmap.core.peer_policy import INBOUND_DENIED, PEER_SECRET_METADATA, PeerPolicy
from kvmap.daemon.adapters.metrics import Metrics
from kvmap.daemon.api.authorization import PeerAuthorization
from kvmap.daemon.api.rpc import ErrorsAndContext
from kvmap.v1 import peer_pb2

METHOD = "BeginTransfer"
# The RPC series' labels of METHOD (gRPC's conventions).
SERIES = {"grpc_service": "kvmap.v1.Peer", "grpc_method": METHOD}
# The peers' shared secret; every call here presents it.
SECRET = b"s" * 43


class Ctx:
    """What the interceptors read of a call's context, and the abort they send."""

    def __init__(self, peer: str = "ipv4:127.0.0.1:40000") -> None:
        self._peer = peer
        self.aborted: list[tuple[grpc.StatusCode, str, Any]] = []
        # The request's bytes, as gRPC hands them to a streaming-request
        # handler that reads; how many reads the interceptors made.
        self.request: list[Any] = []
        self.reads = 0

    async def read(self) -> Any:
        self.reads += 1
        return self.request.pop(0) if self.request else aio.EOF

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("x-request-id", "req-7"), (PEER_SECRET_METADATA, SECRET.decode()))

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}

    async def abort(self, code: grpc.StatusCode, message: str, trailing_metadata: Any) -> None:
        self.aborted.append((code, message, trailing_metadata))
        raise aio.AbortError()


class Details:
    method = f"/kvmap.v1.Peer/{METHOD}"


class Server:
    """ErrorsAndContext outside PeerAuthorization (as ``api.server`` installs
    them) around one handler whose behaviour a test sets."""

    def __init__(self, accept: str = "127.0.0.0/8") -> None:
        self.metrics = Metrics()
        self.outer = ErrorsAndContext(self.metrics, "tcp")
        self.auth = PeerAuthorization(
            PeerPolicy.parse([accept], [], []), mutual_tls=False, secret=SECRET
        )
        self.seen: list[tuple[str, dict[str, Any]]] = []
        self.behave: Any = None

        async def behaviour(request: peer_pb2.BeginTransferRequest, context: Any) -> Any:
            self.seen.append((request.request_id, structlog.contextvars.get_contextvars()))
            return await self.behave()

        self.handler = grpc.unary_unary_rpc_method_handler(
            behaviour,
            request_deserializer=peer_pb2.BeginTransferRequest.FromString,
            response_serializer=peer_pb2.BeginTransferResponse.SerializeToString,
        )

    async def call(self, context: Ctx, raw: bytes | None = None) -> Any:
        async def inner(_: Any) -> Any:
            return self.handler

        async def outer(details: Any) -> Any:
            return await self.auth.intercept_service(inner, details)

        wrapped = await self.outer.intercept_service(outer, Details())
        if raw is None:
            raw = peer_pb2.BeginTransferRequest(request_id="r1").SerializeToString()
        # On TCP a unary method is served as a streaming-request one, read
        # only once the caller is authorized (handlers.read_after).
        context.request = [raw]
        return await wrapped.stream_unary(None, context)

    def count(self, code: str) -> float | None:
        return self.metrics.registry.get_sample_value(
            "kvmap_rpcs_total", {**SERIES, "grpc_code": code}
        )

    def timed(self) -> float | None:
        return self.metrics.registry.get_sample_value("kvmap_rpc_seconds_count", SERIES)


def test_every_outcome_is_counted_timed_and_answered() -> None:
    """OK counts OK; a kvmap error aborts with its status and counts its
    code (no OK series appears for it); an abort the handler sent and a
    cancellation pass as they are, uncounted; each call is timed, runs in
    its request's logging context, and leaves no context behind."""

    async def main() -> None:
        s = Server()
        s.behave = _refusing
        ctx = Ctx()
        with pytest.raises(aio.AbortError):
            await s.call(ctx)
        assert ctx.aborted == [(grpc.StatusCode.UNAVAILABLE, "retry later", ())]
        assert s.count("UNAVAILABLE") == 1 and s.count("OK") is None
        s.behave = _ok
        assert (await s.call(Ctx())).transfer_token == "t"
        assert s.count("OK") == 1
        s.behave = _aborting
        with pytest.raises(aio.AbortError):
            await s.call(Ctx())
        s.behave = _cancelled
        with pytest.raises(asyncio.CancelledError):
            await s.call(Ctx())
        assert s.count("OK") == 1 and s.count("UNAVAILABLE") == 1
        assert s.timed() == 4
        assert [rid for rid, _ in s.seen] == ["r1"] * 4
        assert all(c == {"rpc": METHOD, "rpc_id": "req-7", "listener": "tcp"} for _, c in s.seen)
        assert structlog.contextvars.get_contextvars() == {}

    asyncio.run(main())


def test_a_refused_peer_is_refused_on_every_call_before_parsing() -> None:
    """A peer outside the accepted networks gets PERMISSION_DENIED with the
    one message each time it calls (its answer remembered, its bytes never
    parsed, the handler never run); an accepted peer's string is decided on
    its own; unparsable bytes from an accepted peer are INVALID_ARGUMENT."""

    async def main() -> None:
        s = Server(accept="10.0.0.0/8")
        s.behave = _ok
        for _ in range(3):
            ctx = Ctx("ipv4:127.0.0.1:40000")
            with pytest.raises(aio.AbortError):
                await s.call(ctx, raw=b"\xff\xff not a message")
            assert ctx.aborted == [(grpc.StatusCode.PERMISSION_DENIED, INBOUND_DENIED, ())]
            assert ctx.reads == 0, "a refused peer's request was read"
        assert s.seen == [] and s.count("PERMISSION_DENIED") == 3
        assert (await s.call(Ctx("ipv4:10.1.2.3:5000"))).transfer_token == "t"
        ctx = Ctx("ipv4:10.1.2.3:5000")
        with pytest.raises(aio.AbortError):
            await s.call(ctx, raw=b"\xff\xff not a message")
        assert ctx.aborted[0][0] == grpc.StatusCode.INVALID_ARGUMENT
        assert [rid for rid, _ in s.seen] == ["r1"]

    asyncio.run(main())


async def _ok() -> peer_pb2.BeginTransferResponse:
    return peer_pb2.BeginTransferResponse(transfer_token="t")


async def _refusing() -> Any:
    raise Unavailable("retry later")


async def _aborting() -> Any:
    raise aio.AbortError()


async def _cancelled() -> Any:
    raise asyncio.CancelledError()
