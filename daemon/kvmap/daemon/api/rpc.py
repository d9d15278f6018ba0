"""Where RPC errors become gRPC statuses (through ``api.status``), plus
per-RPC logging context (a request id) and RPC metrics, as an aio server
interceptor."""

from __future__ import annotations

import contextlib
import itertools
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
import structlog
from grpc import aio

from kvmap.daemon.adapters.grpc_codes import reason_metadata
from kvmap.daemon.adapters.metrics import Metrics
from kvmap.daemon.api.handlers import WrappedHandlers, is_kvmap_method, wrap_handler
from kvmap.daemon.api.status import grpc_status
from kvmap.daemon.core.errors import KvmapError

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

    @contextlib.asynccontextmanager
    async def _scope(
        self, method: str, context: aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[None]:
        """One RPC: its logging context, its latency, its status."""
        structlog.contextvars.bind_contextvars(
            rpc=method, request_id=_request_id(context), listener=self._listener
        )
        start = time.perf_counter()
        try:
            yield
        except aio.AbortError:
            raise
        except Exception as err:
            await self._fail(err, method, context)
            raise AssertionError("unreachable: abort raises") from err
        finally:
            self._metrics.rpc_seconds.labels(method).observe(time.perf_counter() - start)
            structlog.contextvars.clear_contextvars()
        self._metrics.rpcs.labels(method, "OK").inc()

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
