"""Where RPC errors become gRPC statuses (through ``api.status``), plus
per-RPC logging context (a request id) and RPC metrics, as an aio server
interceptor. ``refused`` is the report of a failed call that the local
calls socket (``api.local_calls``) shares with the interceptor."""

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

# RPC ids for calls that bring none: a random prefix per process and a
# counter, unique across restarts without a urandom read per RPC. They are
# logged as ``rpc_id``: ``request_id`` always means the vLLM request's id.
_ID_PREFIX = secrets.token_hex(4)
_ids = itertools.count(1)


def _rpc_id(context: aio.ServicerContext[Any, Any]) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "x-request-id" and isinstance(value, str) and value:
            return value[:128]
    return new_rpc_id()


if TYPE_CHECKING:
    from prometheus_client import Counter, Histogram

    from kvmap.daemon.api.handlers import Handler

    # grpc's stubs make the interceptor generic; the runtime class is not.
    _Interceptor = aio.ServerInterceptor[Any, Any]
else:
    _Interceptor = aio.ServerInterceptor


# Told of every failed kvmap RPC: listener, method, status code name,
# message, request id (the live view's recent errors, engine.activity).
OnFailure = Callable[[str, str, str, str, str], None]


class ErrorsAndContext(_Interceptor):
    def __init__(
        self, metrics: Metrics, listener: str, on_failure: OnFailure | None = None
    ) -> None:
        self._metrics = metrics
        self._listener = listener
        self._on_failure = on_failure
        self._wrapped = WrappedHandlers(self._wrap)
        # Each method's metric series (one entry per served method).
        self._series: dict[str, MethodSeries] = {}

    async def _fail(
        self, err: BaseException, series: MethodSeries, context: aio.ServicerContext[Any, Any]
    ) -> None:
        code, message, reason = refused(err, series, self._listener, self._on_failure)
        await context.abort(code, message, trailing_metadata=reason_metadata(reason))

    def _scope(self, full_method: str, context: aio.ServicerContext[Any, Any]) -> _Scope:
        """One RPC: its logging context, its latency, its status."""
        series = self._series.get(full_method) or self._series.setdefault(
            full_method, MethodSeries(self._metrics, full_method)
        )
        return _Scope(self, series, context)

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
        return wrap_handler(handler, lambda context: self._scope(full_method, context))


def refused(
    err: BaseException, series: MethodSeries, listener: str, on_failure: OnFailure | None
) -> tuple[grpc.StatusCode, str, str]:
    """The status, details and reason a failed call ends with, once it is
    logged (``rpc_rejected``, or ``rpc_crashed`` with its traceback), counted
    and told to ``on_failure``: every listener's one report of a refusal
    (``ErrorsAndContext`` for gRPC, ``local_calls`` for the local socket)."""
    code, message = grpc_status(err)
    if isinstance(err, KvmapError):
        log.warning("rpc_rejected", code=code.name, error=message)
    else:
        log.exception("rpc_crashed", code=code.name)
    series.count(code.name)
    if on_failure is not None:
        # The vLLM request's id where the call is about one, else the RPC's.
        bound = structlog.contextvars.get_contextvars()
        request_id = bound.get("request_id") or bound.get("rpc_id", "")
        on_failure(listener, series.method, code.name, message, str(request_id))
    reason = err.reason if isinstance(err, KvmapError) else ""
    # Logged, the error needs its frames no more, and they hold the request
    # (a refused hostile list: megabytes parsed). gRPC's abort chains them to
    # the call's context in a reference cycle, which only the cyclic
    # collector frees, rarely: 300 refused 80 KB requests grew RSS by 55 MiB.
    err.__traceback__ = None
    return code, message, reason


def new_rpc_id() -> str:
    """An id for a call that brings none (logged as ``rpc_id``)."""
    return f"{_ID_PREFIX}{next(_ids):08x}"


class MethodSeries:
    """One method's latency histogram and OK counter, each looked up once (a
    ``labels`` call per RPC costs more than the observation itself); the
    OK counter only once the method first succeeds, as before, so that a
    method that never did exports no OK series. ``full_method`` is gRPC's
    "/package.Service/Method"."""

    def __init__(self, metrics: Metrics, full_method: str) -> None:
        self._metrics = metrics
        self.service, _, self.method = full_method.lstrip("/").rpartition("/")
        self.seconds: Histogram = metrics.rpc_seconds.labels(self.service, self.method)
        self._ok: Counter | None = None

    @property
    def ok(self) -> Counter:
        if self._ok is None:
            self._ok = self._metrics.rpcs.labels(self.service, self.method, "OK")
        return self._ok

    def count(self, code: str) -> None:
        """A call that ended with status ``code`` (its name), OK or not."""
        if code == "OK":
            self.ok.inc()
        else:
            self._metrics.rpcs.labels(self.service, self.method, code).inc()


class _Scope:
    """``ErrorsAndContext``'s scope of one RPC, as a plain async context
    manager: a generator-based one (``contextlib.asynccontextmanager``)
    costs an async generator, which the event loop tracks and forgets, on
    every call. Entered: the logging context is bound and the clock runs.
    Left: an ``AbortError`` (a status already sent) passes, any other
    ``Exception`` becomes its status (``_fail`` aborts the call), anything
    else (cancellation) passes; the latency is observed and the logging
    context cleared whichever way, and a call that raised nothing counts OK."""

    __slots__ = ("_context", "_owner", "_series", "_start")

    def __init__(
        self,
        owner: ErrorsAndContext,
        series: MethodSeries,
        context: aio.ServicerContext[Any, Any],
    ) -> None:
        self._owner = owner
        self._series = series
        self._context = context
        self._start = 0.0

    async def __aenter__(self) -> None:
        structlog.contextvars.bind_contextvars(
            rpc=self._series.method, rpc_id=_rpc_id(self._context), listener=self._owner._listener
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
                del tb  # see _fail: no frame of the failed call outlives it
                await self._owner._fail(err, self._series, self._context)
                raise AssertionError("unreachable: abort raises") from err
        finally:
            self._series.seconds.observe(time.perf_counter() - self._start)
            structlog.contextvars.clear_contextvars()
        if err is None:
            self._series.ok.inc()
        return False
