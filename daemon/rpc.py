"""The one place RPC errors become gRPC statuses, plus per-RPC logging
context (a request id) and RPC metrics, as an aio server interceptor."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
import structlog
from grpc import aio

from kvmap.daemon.errors import KvmapError, grpc_status
from kvmap.daemon.metrics import Metrics

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
        await context.abort(code, message)

    def _wrap_unary(
        self, method: str, behavior: Callable[[Any, Any], Awaitable[Any]]
    ) -> Callable[[Any, Any], Awaitable[Any]]:
        async def call(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
            structlog.contextvars.bind_contextvars(
                rpc=method, request_id=_request_id(context), listener=self._listener
            )
            start = time.perf_counter()
            try:
                response = await behavior(request, context)
            except (KvmapError, Exception) as err:
                if isinstance(err, aio.AbortError):
                    raise
                await self._fail(err, method, context)
                raise AssertionError("unreachable: abort raises") from err
            finally:
                self._metrics.rpc_seconds.labels(method).observe(time.perf_counter() - start)
                structlog.contextvars.clear_contextvars()
            self._metrics.rpcs.labels(method, "OK").inc()
            return response

        return call

    def _wrap_stream(
        self, method: str, behavior: Callable[[Any, Any], AsyncIterator[Any]]
    ) -> Callable[[Any, Any], AsyncIterator[Any]]:
        async def call(request: Any, context: aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            structlog.contextvars.bind_contextvars(
                rpc=method, request_id=_request_id(context), listener=self._listener
            )
            start = time.perf_counter()
            try:
                async for item in behavior(request, context):
                    yield item
            except (KvmapError, Exception) as err:
                if isinstance(err, aio.AbortError):
                    raise
                await self._fail(err, method, context)
                raise AssertionError("unreachable: abort raises") from err
            finally:
                self._metrics.rpc_seconds.labels(method).observe(time.perf_counter() - start)
                structlog.contextvars.clear_contextvars()
            self._metrics.rpcs.labels(method, "OK").inc()

        return call

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        # Health and reflection come from grpcio's own packages and report
        # their own statuses; only kvmap's services are wrapped.
        if handler is None or not handler_call_details.method.startswith("/kvmap.v1."):
            return handler
        method = handler_call_details.method.rsplit("/", 1)[-1]
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(method, handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                # grpc's stubs type sync handlers; aio handlers are async generators.
                self._wrap_stream(method, handler.unary_stream),  # type: ignore[arg-type]
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler
