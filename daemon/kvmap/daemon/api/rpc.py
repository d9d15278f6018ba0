"""Where RPC errors become gRPC statuses (through ``api.status``), plus
per-RPC logging context (a request id) and RPC metrics, as an aio server
interceptor."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
import structlog
from grpc import aio

from kvmap.daemon.adapters.grpc_codes import reason_metadata
from kvmap.daemon.adapters.metrics import Metrics
from kvmap.daemon.api.handlers import is_kvmap_method, wrap_handler
from kvmap.daemon.api.status import grpc_status
from kvmap.daemon.core.errors import KvmapError

log = structlog.get_logger("kvmapd.rpc")


def _request_id(context: aio.ServicerContext[Any, Any]) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "x-request-id" and isinstance(value, str) and value:
            return value[:128]
    return uuid.uuid4().hex[:16]


if TYPE_CHECKING:
    # grpc's stubs make the interceptor generic; the runtime class is not.
    _Interceptor = aio.ServerInterceptor[Any, Any]
else:
    _Interceptor = aio.ServerInterceptor


class ErrorsAndContext(_Interceptor):
    def __init__(self, metrics: Metrics, listener: str) -> None:
        self._metrics = metrics
        self._listener = listener

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
        method = str(handler_call_details.method).rsplit("/", 1)[-1]
        wrapped = wrap_handler(handler, lambda context: self._scope(method, context))
        return handler if wrapped is None else wrapped
