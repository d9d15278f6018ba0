"""Transport to a live kvmapd over its Unix socket (gRPC + fd hand-off)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
import grpc.experimental

from kvmap.client import fd_handoff
from kvmap.client.errors import from_rpc_error
from kvmap.client.transports.local_calls import (
    ATTACH_FIELD,
    GRANT_FIELD,
    PULL_FIELD,
    PUSH_FIELD,
    REVOKE_FIELD,
    LocalAttachStream,
    LocalCalls,
    call_bytes,
)
from kvmap.core.config import LOCAL_CALLS_SUFFIX
from kvmap.core.errors import KvmapError, PermissionDenied
from kvmap.core.protowire import varint
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


class _GrpcAttachStream:
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

# A credential token is fetched again after this long (the daemon keeps one
# 120 s), and its fetch may take this long.
CREDENTIAL_REFRESH_S = 60.0
CREDENTIAL_TIMEOUT_S = 5.0

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

# Field 1 (``spec``), length-delimited: the tag of PullRequest and
# PushRequest's only field.
_SPEC_TAG = b"\x0a"


def spec_request_bytes(spec: transfers_pb2.TransferSpec) -> bytes:
    """``PullRequest(spec=spec)`` (or ``PushRequest``) as serialized, the
    same bytes, without first deep-copying a spec of thousands of block ids
    into a request message only to serialize it."""
    body = spec.SerializeToString()
    return _SPEC_TAG + varint(len(body)) + body


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


class GrpcTransport:
    def __init__(self, socket_path: str, fd_socket_path: str | None = None) -> None:
        self.socket_path = socket_path
        self.fd_socket_path = fd_socket_path or f"{socket_path}.fds"
        target = f"unix://{socket_path}"
        self._channel = grpc.insecure_channel(target, options=_OPTIONS)
        self._streams = grpc.insecure_channel(target, options=[*_OPTIONS, _SINGLE_THREADED_STREAMS])
        self._registry = registry_pb2_grpc.RegistryStub(self._channel)
        self._pull_spec = _spec_call(self._streams, "Pull", transfers_pb2.PullResponse.FromString)
        self._push_spec = _spec_call(self._streams, "Push", transfers_pb2.PushResponse.FromString)
        self._transfers = transfers_pb2_grpc.TransfersStub(self._channel)
        self._maps = region_maps_pb2_grpc.RegionMapsStub(self._channel)
        self._admin = admin_pb2_grpc.AdminStub(self._channel)
        # This process's credential token (fd_handoff.send_credentials) and
        # when it was fetched: Registry calls carry it, so that the daemon
        # honours them only from the uid that registered the worker.
        self._credential = ""
        self._credential_at = 0.0
        # Pull and Push go on the daemon's local calls socket where it has one.
        self._local = LocalCalls(socket_path + LOCAL_CALLS_SUFFIX)

    def send_fds(self, fds: Sequence[int], timeout: float) -> str:
        return fd_handoff.send_fds(self.fd_socket_path, fds, timeout)

    def register_worker(
        self, req: registry_pb2.RegisterWorkerRequest, timeout: float
    ) -> registry_pb2.RegisterWorkerResponse:
        return self._as_caller(self._registry.RegisterWorker, req, timeout)

    def deregister_worker(
        self, req: registry_pb2.DeregisterWorkerRequest, timeout: float
    ) -> registry_pb2.DeregisterWorkerResponse:
        return self._as_caller(self._registry.DeregisterWorker, req, timeout)

    def attach(self, req: registry_pb2.AttachRequest) -> LocalAttachStream | _GrpcAttachStream:
        """On the local calls socket where the daemon has one (the kernel
        tells the daemon this process's uid: no credential token), else
        over gRPC."""
        sock = self._local.attach(call_bytes(ATTACH_FIELD, req.SerializeToString(), ""))
        if sock is not None:
            return LocalAttachStream(sock, lambda: self._grpc_attach(req))
        return self._grpc_attach(req)

    def _grpc_attach(self, req: registry_pb2.AttachRequest) -> _GrpcAttachStream:
        # A fresh token: (re)attaching follows a daemon restart, which forgot the old one.
        metadata = self._credentials(fresh=True)
        return _GrpcAttachStream(self._registry.Attach(req, metadata=metadata))

    def grant_transfer(
        self, req: registry_pb2.GrantTransferRequest, timeout: float
    ) -> registry_pb2.GrantTransferResponse:
        # On the local calls socket where the daemon serves it (a scheduler
        # grants on every rank for every request); else gRPC's.
        frame = call_bytes(GRANT_FIELD, req.SerializeToString(), current().traceparent())
        reply = self._local.unary(frame, timeout, "granted")
        if reply is not None:
            return reply.granted
        return self._as_caller(self._registry.GrantTransfer, req, timeout)

    def revoke_transfer(
        self, req: registry_pb2.RevokeTransferRequest, timeout: float
    ) -> registry_pb2.RevokeTransferResponse:
        frame = call_bytes(REVOKE_FIELD, req.SerializeToString(), "")
        reply = self._local.unary(frame, timeout, "revoked")
        if reply is not None:
            return reply.revoked
        return self._as_caller(self._registry.RevokeTransfer, req, timeout)

    def _credentials(self, fresh: bool = False) -> tuple[tuple[str, str], ...]:
        """The metadata that says which uid calls: a credential token, kept
        for CREDENTIAL_REFRESH_S (the daemon keeps it 120 s). None when the
        daemon cannot give one (not up yet, or older): the call goes without,
        and a daemon that needs it answers PERMISSION_DENIED."""
        now = time.monotonic()
        if fresh or not self._credential or now - self._credential_at > CREDENTIAL_REFRESH_S:
            try:
                self._credential = fd_handoff.send_credentials(
                    self.fd_socket_path, CREDENTIAL_TIMEOUT_S
                )
                self._credential_at = now
            except KvmapError:
                self._credential = ""
        return ((fd_handoff.PEER_TOKEN_METADATA, self._credential),) if self._credential else ()

    def _as_caller(self, call: Callable[..., R], req: Any, timeout: float) -> R:
        """A Registry call with this process's credentials; once more with a
        fresh token when refused (a restarted daemon forgot the old one)."""
        traced = _trace_metadata()
        try:
            return self._unary(call, req, timeout, metadata=(*self._credentials(), *traced))
        except PermissionDenied:
            metadata = (*self._credentials(fresh=True), *traced)
            return self._unary(call, req, timeout, metadata=metadata)

    def pull(
        self, spec: transfers_pb2.TransferSpec, timeout: float
    ) -> Iterator[transfers_pb2.PullResponse]:
        """Pull{spec}: on the local calls socket where the daemon has one,
        else over gRPC; the spec is serialized once, straight into the
        request's bytes (no PullRequest copy of its block ids)."""
        local = self._local_call(PULL_FIELD, spec, timeout)
        if local is not None:
            return iter([transfers_pb2.PullResponse(status=status) for status in local])
        return _stream(self._pull_spec(spec, timeout=timeout, metadata=_trace_metadata()))

    def push(
        self, spec: transfers_pb2.TransferSpec, timeout: float
    ) -> Iterator[transfers_pb2.PushResponse]:
        """Push{spec}, as ``pull``."""
        local = self._local_call(PUSH_FIELD, spec, timeout)
        if local is not None:
            return iter([transfers_pb2.PushResponse(status=status) for status in local])
        return _stream(self._push_spec(spec, timeout=timeout, metadata=_trace_metadata()))

    def _local_call(
        self, field: int, spec: transfers_pb2.TransferSpec, timeout: float
    ) -> list[transfers_pb2.TransferStatus] | None:
        frame = call_bytes(field, spec_request_bytes(spec), current().traceparent())
        return self._local.call(frame, timeout)

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
        self._local.close()
        self._streams.close()
        self._channel.close()
