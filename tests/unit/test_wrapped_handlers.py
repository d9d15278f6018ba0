"""Interceptors wrap each method's handler once (``handlers.WrappedHandlers``),
not once per call, and still run their scope around every call; request ids
made for calls that bring none stay distinct."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc

from kvmap.daemon.adapters.metrics import Metrics
from kvmap.daemon.api import rpc
from kvmap.daemon.api.handlers import WrappedHandlers


def test_each_handler_is_wrapped_once_per_method() -> None:
    """The same (method, handler) gives the same wrapped handler without
    wrapping again; another method or another handler is wrapped on its
    own; a None answer (a handler no interceptor serves) is kept too."""
    calls: list[tuple[str, Any]] = []

    def wrap(method: str, handler: Any) -> Any:
        calls.append((method, handler))
        return None if method == "/none" else ("wrapped", method, handler)

    cache = WrappedHandlers(wrap)
    a = grpc.unary_unary_rpc_method_handler(lambda req, ctx: req)
    b = grpc.unary_unary_rpc_method_handler(lambda req, ctx: req)
    first = cache.get("/kvmap.v1.X/A", a)
    assert cache.get("/kvmap.v1.X/A", a) is first
    assert cache.get("/kvmap.v1.X/B", a) == ("wrapped", "/kvmap.v1.X/B", a)
    assert cache.get("/kvmap.v1.X/A", b) == ("wrapped", "/kvmap.v1.X/A", b)
    assert cache.get("/none", a) is None and cache.get("/none", a) is None
    assert calls == [("/kvmap.v1.X/A", a), ("/kvmap.v1.X/B", a), ("/kvmap.v1.X/A", b), ("/none", a)]


class Ctx:
    def __init__(self, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self._metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


def test_a_cached_wrapper_runs_its_scope_on_every_call() -> None:
    """The interceptor's wrapped unary handler, taken from its cache for a
    second call, enters the scope (request id, metrics) for each call."""
    interceptor = rpc.ErrorsAndContext(Metrics(), "unix")
    seen: list[str] = []
    scopes: list[str] = []

    async def behaviour(request: Any, context: Any) -> bytes:
        seen.append(request)
        return b"ok"

    handler = grpc.unary_unary_rpc_method_handler(behaviour)

    async def continuation(_: Any) -> Any:
        return handler

    original = interceptor._scope

    @contextlib.asynccontextmanager
    async def counted(method: str, context: Any) -> AsyncIterator[None]:
        scopes.append(method)
        async with original(method, context):
            yield

    interceptor._scope = counted  # type: ignore[method-assign]

    class Details:
        method = "/kvmap.v1.Peer/BeginTransfer"

    async def main() -> None:
        details: Any = Details()
        wrapped = [await interceptor.intercept_service(continuation, details) for _ in (0, 1)]
        assert wrapped[0] is wrapped[1] and wrapped[0] is not handler
        for raw in (b"a", b"b"):
            assert await wrapped[0].unary_unary(raw, Ctx()) == b"ok"

    asyncio.run(main())
    assert seen == [b"a", b"b"]
    assert scopes == ["/kvmap.v1.Peer/BeginTransfer"] * 2


def test_rpc_ids_are_distinct_unless_given() -> None:
    """A call without x-request-id gets a fresh RPC id each time; one that
    brings it keeps it (cut to 128 characters)."""
    made = {rpc._rpc_id(Ctx()) for _ in range(1000)}  # type: ignore[arg-type]
    assert len(made) == 1000
    given = rpc._rpc_id(Ctx((("x-request-id", "r" * 200),)))  # type: ignore[arg-type]
    assert given == "r" * 128
