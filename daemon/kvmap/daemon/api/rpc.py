"""Where RPC errors become gRPC statuses (through ``api.status``), plus
per-RPC logging context (a request id) and RPC metrics, as an aio server
interceptor."""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

import grpc
import structlog
from grpc import aio

from kvmap.core.errors import KvmapError
from kvmap.daemon.adapters.grpc_codes import reason_metadata
from kvmap.daemon.adapters.metrics import Metrics
from kvmap.daemon.api.handlers import WrappedHandlers, is_kvmap_method, wrap_handler
from kvmap.daemon.api.status import grpc_status

log = structlog.get_logger("kvmapd.rpc")

# Request ids for calls that bring none: a random prefix per process and a
# counter, unique across restarts without a urandom read per RPC.
_ID_PREFIX = secrets.token_hex(4)
_ids = itertools.count(1)


def _request_id(context: aio.ServicerContext[Any, Any]) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "x-request-id" and isinstance(value, str) and value:
            return value[:128]
    return f"{_ID_PREFIX}{next(_ids):08x}"


if TYPE_CHECKING:
    from prometheus_client import Counter, Histogram

    from kvmap.daemon.api.handlers import Handler

    # grpc's stubs make the interceptor generic; the runtime class is not.
    _Interceptor = aio.ServerInterceptor[Any, Any]
else:
    _Interceptor = aio.ServerInterceptor


class ErrorsAndContext(_Interceptor):
    def __init__(self, metrics: Metrics, listener: str) -> None:
        self._metrics = metrics
        self._listener = listener
        self._wrapped = WrappedHandlers(self._wrap)
        # Each method's metric series (one entry per served method).
        self._series: dict[str, _Series] = {}

    async def _fail(
        self, err: BaseException, method: str, context: aio.ServicerContext[Any, Any]
    ) -> None:
        code, message = grpc_status(err)
        if isinstance(err, KvmapError):
            log.info("rpc_rejected", code=code.name, error=message)
        else:
            log.exception("rpc_crashed", code=code.name)
        self._metrics.rpcs.labels(method, code.name).inc()
        reason = err.reason if isinstance(err, KvmapError) else ""
        await context.abort(code, message, trailing_metadata=reason_metadata(reason))

    def _scope(self, method: str, context: aio.ServicerContext[Any, Any]) -> _Scope:
        """One RPC: its logging context, its latency, its status."""
        series = self._series.get(method) or self._series.setdefault(
            method, _Series(self._metrics, method)
        )
        return _Scope(self, method, series, context)

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        if handler is None or not is_kvmap_method(handler_call_details):
            return handler
        wrapped = self._wrapped.get(str(handler_call_details.method), handler)
        return handler if wrapped is None else wrapped

    def _wrap(self, full_method: str, handler: Handler) -> Handler | None:
        method = full_method.rsplit("/", 1)[-1]
        return wrap_handler(handler, lambda context: self._scope(method, context))


class _Series:
    """One method's latency histogram and OK counter, each looked up once (a
    ``labels`` call per RPC costs more than the observation itself); the
    OK counter only once the method first succeeds, as before, so that a
    method that never did exports no OK series."""

    def __init__(self, metrics: Metrics, method: str) -> None:
        self._metrics = metrics
        self._method = method
        self.seconds: Histogram = metrics.rpc_seconds.labels(method)
        self._ok: Counter | None = None

    @property
    def ok(self) -> Counter:
        if self._ok is None:
            self._ok = self._metrics.rpcs.labels(self._method, "OK")
        return self._ok


class _Scope:
    """``ErrorsAndContext``'s scope of one RPC, as a plain async context
    manager: a generator-based one (``contextlib.asynccontextmanager``)
    costs an async generator, which the event loop tracks and forgets, on
    every call. Entered: the logging context is bound and the clock runs.
    Left: an ``AbortError`` (a status already sent) passes, any other
    ``Exception`` becomes its status (``_fail`` aborts the call), anything
    else (cancellation) passes; the latency is observed and the logging
    context cleared whichever way, and a call that raised nothing counts OK."""

    __slots__ = ("_context", "_method", "_owner", "_series", "_start")

    def __init__(
        self,
        owner: ErrorsAndContext,
        method: str,
        series: _Series,
        context: aio.ServicerContext[Any, Any],
    ) -> None:
        self._owner = owner
        self._method = method
        self._series = series
        self._context = context
        self._start = 0.0

    async def __aenter__(self) -> None:
        structlog.contextvars.bind_contextvars(
            rpc=self._method, request_id=_request_id(self._context), listener=self._owner._listener
        )
        self._start = time.perf_counter()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        err: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        try:
            if isinstance(err, Exception) and not isinstance(err, aio.AbortError):
                await self._owner._fail(err, self._method, self._context)
                raise AssertionError("unreachable: abort raises") from err
        finally:
            self._series.seconds.observe(time.perf_counter() - self._start)
            structlog.contextvars.clear_contextvars()
        if err is None:
            self._series.ok.inc()
        return False
