"""kvmapd's gRPC API over its Unix socket, and nothing else: the fd hand-off
socket (``handoff.py``, which also gives the credential token Registry calls
present) and the local calls socket (``local_calls.py``) are transports of
their own, which ``kvmapd.KvmapdTransport`` composes with this one."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import grpc
import grpc.experimental

from kvmap.client.errors import from_rpc_error
from kvmap.client.transports.wire import spec_request_bytes
from kvmap.core.errors import PermissionDenied
from kvmap.tracing import TRACEPARENT, current
from kvmap.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    region_maps_pb2,
    region_maps_pb2_grpc,
    registry_pb2,
    registry_pb2_grpc,
    transfers_pb2,
    transfers_pb2_grpc,
)

T = TypeVar("T")
R = TypeVar("R")
Metadata = tuple[tuple[str, str], ...]
# The metadata that says which uid calls (``HandoffTransport.credentials``):
# called with True for a new token, after the daemon refused the old one.
Credentials = Callable[[bool], Metadata]


class GrpcAttachStream:
    def __init__(self, call: Any) -> None:
        self._call = call

    def __iter__(self) -> Iterator[registry_pb2.AttachResponse]:
        try:
            yield from self._call
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.CANCELLED:
                return
            raise from_rpc_error(err) from None

    def cancel(self) -> None:
        self._call.cancel()


def _stream(call: Iterable[T]) -> Iterator[T]:
    try:
        yield from call
    except grpc.RpcError as err:
        raise from_rpc_error(err) from None


_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
    # A restarted sidecar is back within a second or two: retry the
    # socket quickly instead of gRPC's default backoff (up to 2 min). A
    # failed connect to a local socket costs microseconds, so the pace is
    # set by how long a caller may find the daemon back but the channel
    # still waiting (see ``_unary``), not by the attempts' cost.
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 250),
]

# How long a unary call waits for the channel to reconnect to a daemon that
# is listening again (several reconnect periods, well under a call's deadline).
RECONNECT_WAIT_S = 2.0

# Pull and Push answer a short stream per transfer, read to its end by the
# thread that called: on a channel with this option that thread polls the
# call's own completion queue, instead of the channel's spin thread taking
# every event and waking the caller (two thread switches per message, the
# cost that grows with transfers in flight). A Python-side option only: the
# core sees the same arguments as ``_OPTIONS``, so both channels share one
# connection to the daemon.
_SINGLE_THREADED_STREAMS = (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)


def _spec_call(
    channel: grpc.Channel, method: str, deserializer: Callable[[bytes], R]
) -> grpc.UnaryStreamMultiCallable[transfers_pb2.TransferSpec, R]:
    """Transfers' ``method`` taking a TransferSpec (``spec_request_bytes``)."""
    # Registered as the generated stub registers it (the core then skips
    # looking the method path up per call); grpc's type stubs lack the flag.
    return channel.unary_stream(  # type: ignore[call-arg]
        f"/kvmap.v1.Transfers/{method}",
        request_serializer=spec_request_bytes,
        response_deserializer=deserializer,
        _registered_method=True,
    )


def _trace_metadata() -> tuple[tuple[str, str], ...]:
    """The calling thread's current span (``kvmap.tracing.current``) as
    ``traceparent`` metadata: the daemon's span of the call is its child.
    Nothing when tracing is off (the null span has no traceparent)."""
    traceparent = current().traceparent()
    return ((TRACEPARENT, traceparent),) if traceparent else ()


def daemon_listening(socket_path: str) -> bool:
    """Whether something accepts connections on ``socket_path`` now (one
    connect, closed at once: no gRPC, nothing sent)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        try:
            probe.connect(socket_path)
        except OSError:  # no file, nobody listening, a path too long
            return False
    return True


def _no_credentials(fresh: bool) -> Metadata:
    return ()


class GrpcTransport:
    """kvmapd's gRPC services on ``socket_path``. Registry calls present
    ``credentials`` (a daemon that requires them refuses calls without);
    it sends no fds, so registering a worker whose memory travels as fds
    needs ``kvmapd.KvmapdTransport``."""

    def __init__(self, socket_path: str, credentials: Credentials = _no_credentials) -> None:
        self.socket_path = socket_path
        target = f"unix://{socket_path}"
        self._channel = grpc.insecure_channel(target, options=_OPTIONS)
        self._streams = grpc.insecure_channel(target, options=[*_OPTIONS, _SINGLE_THREADED_STREAMS])
        self._registry = registry_pb2_grpc.RegistryStub(self._channel)
        self._pull_spec = _spec_call(self._streams, "Pull", transfers_pb2.PullResponse.FromString)
        self._push_spec = _spec_call(self._streams, "Push", transfers_pb2.PushResponse.FromString)
        self._transfers = transfers_pb2_grpc.TransfersStub(self._channel)
        self._maps = region_maps_pb2_grpc.RegionMapsStub(self._channel)
        self._admin = admin_pb2_grpc.AdminStub(self._channel)
        self._credentials = credentials

    def register_worker(
        self, req: registry_pb2.RegisterWorkerRequest, timeout: float
    ) -> registry_pb2.RegisterWorkerResponse:
        return self._as_caller(self._registry.RegisterWorker, req, timeout)

    def deregister_worker(
        self, req: registry_pb2.DeregisterWorkerRequest, timeout: float
    ) -> registry_pb2.DeregisterWorkerResponse:
        return self._as_caller(self._registry.DeregisterWorker, req, timeout)

    def attach(self, req: registry_pb2.AttachRequest) -> GrpcAttachStream:
        # A fresh token: (re)attaching follows a daemon restart, which forgot the old one.
        metadata = self._credentials(True)
        return GrpcAttachStream(self._registry.Attach(req, metadata=metadata))

    def grant_transfer(
        self, req: registry_pb2.GrantTransferRequest, timeout: float
    ) -> registry_pb2.GrantTransferResponse:
        return self._as_caller(self._registry.GrantTransfer, req, timeout)

    def revoke_transfer(
        self, req: registry_pb2.RevokeTransferRequest, timeout: float
    ) -> registry_pb2.RevokeTransferResponse:
        return self._as_caller(self._registry.RevokeTransfer, req, timeout)

    def _as_caller(self, call: Callable[..., R], req: Any, timeout: float) -> R:
        """A Registry call with this process's credentials; once more with a
        fresh token when refused (a restarted daemon forgot the old one)."""
        traced = _trace_metadata()
        try:
            return self._unary(call, req, timeout, metadata=(*self._credentials(False), *traced))
        except PermissionDenied:
            metadata = (*self._credentials(True), *traced)
            return self._unary(call, req, timeout, metadata=metadata)

    def pull(
        self, spec: transfers_pb2.TransferSpec, timeout: float
    ) -> Iterator[transfers_pb2.PullResponse]:
        """Pull{spec}; the spec is serialized once, straight into the
        request's bytes (no PullRequest copy of its block ids)."""
        return _stream(self._pull_spec(spec, timeout=timeout, metadata=_trace_metadata()))

    def push(
        self, spec: transfers_pb2.TransferSpec, timeout: float
    ) -> Iterator[transfers_pb2.PushResponse]:
        """Push{spec}, as ``pull``."""
        return _stream(self._push_spec(spec, timeout=timeout, metadata=_trace_metadata()))

    def release(
        self, req: transfers_pb2.ReleaseRequest, timeout: float
    ) -> transfers_pb2.ReleaseResponse:
        """Transfers.Release. Made once, as a Pull is: a release the daemon
        did pass on must not be passed on twice (a second one would spend
        another reader's use)."""
        try:
            return self._transfers.Release(req, timeout=timeout, metadata=_trace_metadata())
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def offer_push(
        self, req: transfers_pb2.OfferPushRequest, timeout: float
    ) -> transfers_pb2.OfferPushResponse:
        """Transfers.OfferPush, as this process's uid (only the uid that
        registered the offered worker may offer its blocks)."""
        return self._as_caller(self._transfers.OfferPush, req, timeout)

    def get_region_map(
        self, req: region_maps_pb2.GetRegionMapRequest, timeout: float
    ) -> region_maps_pb2.GetRegionMapResponse:
        return self._unary(self._maps.GetRegionMap, req, timeout)

    def get_stats(self, timeout: float) -> admin_pb2.GetStatsResponse:
        return self._unary(self._admin.GetStats, admin_pb2.GetStatsRequest(), timeout)

    def _unary(self, call: Callable[..., R], req: Any, timeout: float, **kw: Any) -> R:
        """``call(req)``, typed errors. A daemon back after a restart (or an
        upgrade) can find this channel still waiting out its reconnect
        backoff, which fails calls at once with the old connect error: when
        the socket accepts connections again, the call is made once more,
        waiting (boundedly) for the channel to connect. A daemon that is
        down fails at once, as before: callers (vLLM's scheduler among
        them) must not block on a missing sidecar."""
        started = time.monotonic()
        try:
            return call(req, timeout=timeout, **kw)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.UNAVAILABLE or not daemon_listening(self.socket_path):
                raise from_rpc_error(err) from None
            first = err
        left = min(timeout - (time.monotonic() - started), RECONNECT_WAIT_S)
        if left <= 0 or not self._reconnected(left):
            # Still no connection: the daemon is unavailable (not slow: the
            # caller's deadline is not spent), as the first attempt said.
            raise from_rpc_error(first) from None
        try:
            return call(req, timeout=timeout - (time.monotonic() - started), **kw)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def _reconnected(self, wait_s: float) -> bool:
        """Whether the unary channel connects within ``wait_s``."""
        ready = grpc.channel_ready_future(self._channel)
        try:
            ready.result(timeout=wait_s)
        except grpc.FutureTimeoutError:
            ready.cancel()
            return False
        return True

    def close(self) -> None:
        self._streams.close()
        self._channel.close()
