"""Re-wrapping a kvmap RPC handler so that a server interceptor runs code
around it: the one shape both ``rpc.ErrorsAndContext`` (statuses, logging,
metrics) and ``authorization.PeerAuthorization`` (who may call) need.

The wrapped handler takes the request as raw bytes and parses it inside the
interceptor's scope, for two reasons: bytes that are no valid message get
INVALID_ARGUMENT through the one error-to-status place (grpcio's own parse
failure would answer UNKNOWN before any handler runs), and an unauthorized
caller's bytes are never decoded at all.

``read_after`` goes further for the TCP listener: it serves a unary-request
method as a streaming-request one, so that the check runs before gRPC has
read a single byte of the request (an aio unary handler is handed its
request whole, already buffered: a refused stranger's 16 MiB body cost
16 MiB of memory first). Each method's request is then bounded by its own
size limit. ``read_each`` does the same for a method that streams both
ways: the check runs once, before the first message is read, and each
message is bounded by the method's limit.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import DecodeError
from grpc import aio

from kvmap.core.errors import InvalidArgument, ResourceExhausted

Ctx = aio.ServicerContext[Any, Any]
if TYPE_CHECKING:
    # grpc's stubs make the handler generic; the runtime class is not.
    Handler = grpc.RpcMethodHandler[Any, Any]
    # What runs around one call: entered before the request is parsed, and
    # its exit sees whatever the handler raised.
    Around = Callable[[Ctx], contextlib.AbstractAsyncContextManager[None]]


def is_kvmap_method(details: grpc.HandlerCallDetails) -> bool:
    """kvmap's own services; health and reflection come from grpcio's
    packages and keep their own statuses."""
    return str(details.method).startswith("/kvmap.v1.")


def parser(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
    def parse(raw: bytes) -> Any:
        if deserialize is None:
            return raw
        try:
            return deserialize(raw)
        except DecodeError as err:
            raise InvalidArgument("", f"request is not a valid message: {err}") from None

    return parse


class WrappedHandlers:
    """Each method's wrapped handler, built once: an interceptor runs for
    every call, and re-wrapping (closures, a new grpc handler) per call is
    work on the event loop every pull shares. Keyed by the handler itself
    (grpcio hands out the one registered per method, or the inner
    interceptor's cached one), so the cache holds one entry per served
    method and an unknown method (no handler) is never cached."""

    def __init__(self, wrap: Callable[[str, Handler], Handler | None]) -> None:
        self._wrap = wrap
        self._cache: dict[tuple[str, Handler], Handler | None] = {}

    def get(self, method: str, handler: Handler) -> Handler | None:
        key = (method, handler)
        try:
            return self._cache[key]
        except KeyError:
            wrapped = self._cache[key] = self._wrap(method, handler)
            return wrapped


def wrap_handler(handler: Handler, around: Around) -> Handler | None:
    """``handler`` with ``around`` entered for each call. A streaming-request
    handler is wrapped only where it reads its requests itself (``read_after``
    made it: no request deserializer); for any other one the answer is None,
    and the caller decides what it gets rather than letting it through
    unwrapped (no such method is served)."""
    if handler.request_streaming:
        return _wrap_reader(handler, around) if handler.request_deserializer is None else None
    parse = parser(handler.request_deserializer)
    # grpc's stubs type the behaviours as synchronous; aio servers' are async.
    unary: Callable[..., Any] | None = handler.unary_unary
    stream: Callable[..., Any] | None = handler.unary_stream
    if unary is not None:

        async def call_unary(raw: bytes, context: Ctx) -> Any:
            async with around(context):
                return await unary(parse(raw), context)

        return grpc.unary_unary_rpc_method_handler(
            call_unary, response_serializer=handler.response_serializer
        )
    if stream is not None:

        async def call_stream(raw: bytes, context: Ctx) -> AsyncIterator[Any]:
            async with around(context):
                async for item in stream(parse(raw), context):
                    yield item

        return grpc.unary_stream_rpc_method_handler(
            call_stream, response_serializer=handler.response_serializer
        )
    return None


def _wrap_reader(handler: Handler, around: Around) -> Handler | None:
    """A ``read_after`` handler with ``around`` entered for each call, before
    the request is read (the stream of requests passes through untouched)."""
    unary: Callable[..., Any] | None = handler.stream_unary
    stream: Callable[..., Any] | None = handler.stream_stream
    if unary is not None:

        async def call_unary(requests: AsyncIterator[bytes], context: Ctx) -> Any:
            async with around(context):
                return await unary(requests, context)

        return grpc.stream_unary_rpc_method_handler(
            call_unary, response_serializer=handler.response_serializer
        )
    if stream is not None:

        async def call_stream(requests: AsyncIterator[bytes], context: Ctx) -> AsyncIterator[Any]:
            async with around(context):
                async for item in stream(requests, context):
                    yield item

        return grpc.stream_stream_rpc_method_handler(
            call_stream, response_serializer=handler.response_serializer
        )
    return None


def _bounded(limit: int, parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def read(raw: bytes) -> Any:
        if len(raw) > limit:
            raise ResourceExhausted(
                f"request of {len(raw)} bytes; this method takes at most {limit} bytes here"
            )
        return parse(raw)

    return read


def read_each(handler: Handler, around: Around, limit: int) -> Handler | None:
    """A ``handler`` that streams both ways, served with ``around`` entered
    once per call before its first message is read; then each message is
    read as the handler asks for it, refused at over ``limit`` bytes and
    parsed. None for any other handler."""
    stream: Callable[..., Any] | None = handler.stream_stream
    if stream is None:
        return None
    read = _bounded(limit, parser(handler.request_deserializer))

    async def requests(context: Ctx) -> AsyncIterator[Any]:
        while True:
            raw = await context.read()
            if not isinstance(raw, bytes):  # grpc.aio.EOF: the caller is done
                return
            yield read(raw)

    async def call_stream(_: AsyncIterator[bytes], context: Ctx) -> AsyncIterator[Any]:
        async with around(context):
            async for item in stream(requests(context), context):
                yield item

    return grpc.stream_stream_rpc_method_handler(
        call_stream, response_serializer=handler.response_serializer
    )


def read_after(handler: Handler, around: Around, limit: int) -> Handler | None:
    """A unary-request ``handler`` served as a streaming-request one: for each
    call ``around`` is entered first, and only then is the one request read
    (refused at over ``limit`` bytes) and parsed. Until it is read, gRPC
    holds no more of it than the stream's flow-control window. None for a
    streaming-request handler."""
    if handler.request_streaming:
        return None
    read = _bounded(limit, parser(handler.request_deserializer))

    async def request(context: Ctx) -> Any:
        raw = await context.read()
        if not isinstance(raw, bytes):  # grpc.aio.EOF: the caller sent none
            raise InvalidArgument("", "the call carries no request message")
        return read(raw)

    unary: Callable[..., Any] | None = handler.unary_unary
    stream: Callable[..., Any] | None = handler.unary_stream
    if unary is not None:

        async def call_unary(requests: AsyncIterator[bytes], context: Ctx) -> Any:
            async with around(context):
                return await unary(await request(context), context)

        return grpc.stream_unary_rpc_method_handler(
            call_unary, response_serializer=handler.response_serializer
        )
    assert stream is not None  # a unary-request handler is one of the two

    async def call_stream(requests: AsyncIterator[bytes], context: Ctx) -> AsyncIterator[Any]:
        async with around(context):
            async for item in stream(await request(context), context):
                yield item

    return grpc.stream_stream_rpc_method_handler(
        call_stream, response_serializer=handler.response_serializer
    )
