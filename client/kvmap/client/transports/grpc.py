"""Transport to a live kvmapd over its Unix socket (gRPC + fd hand-off)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeVar

import grpc

from kvmap.client import fd_handoff
from kvmap.client.errors import from_rpc_error
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


class GrpcTransport:
    def __init__(self, socket_path: str, fd_socket_path: str | None = None) -> None:
        self.socket_path = socket_path
        self.fd_socket_path = fd_socket_path or f"{socket_path}.fds"
        self._channel = grpc.insecure_channel(
            f"unix://{socket_path}",
            options=[
                ("grpc.max_receive_message_length", 16 * 1024 * 1024),
                # A restarted sidecar is back within a second or two: retry the
                # socket quickly instead of gRPC's default backoff (up to 2 min).
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000),
            ],
        )
        self._registry = registry_pb2_grpc.RegistryStub(self._channel)
        self._transfers = transfers_pb2_grpc.TransfersStub(self._channel)
        self._maps = region_maps_pb2_grpc.RegionMapsStub(self._channel)
        self._admin = admin_pb2_grpc.AdminStub(self._channel)

    def send_fds(self, fds: Sequence[int], timeout: float) -> str:
        return fd_handoff.send_fds(self.fd_socket_path, fds, timeout)

    def register_worker(
        self, req: registry_pb2.RegisterWorkerRequest, timeout: float
    ) -> registry_pb2.RegisterWorkerResponse:
        try:
            return self._registry.RegisterWorker(req, timeout=timeout)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def deregister_worker(
        self, req: registry_pb2.DeregisterWorkerRequest, timeout: float
    ) -> registry_pb2.DeregisterWorkerResponse:
        try:
            return self._registry.DeregisterWorker(req, timeout=timeout)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def attach(self, req: registry_pb2.AttachRequest) -> _GrpcAttachStream:
        return _GrpcAttachStream(self._registry.Attach(req))

    def grant_transfer(
        self, req: registry_pb2.GrantTransferRequest, timeout: float
    ) -> registry_pb2.GrantTransferResponse:
        try:
            return self._registry.GrantTransfer(req, timeout=timeout)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def revoke_transfer(
        self, req: registry_pb2.RevokeTransferRequest, timeout: float
    ) -> registry_pb2.RevokeTransferResponse:
        try:
            return self._registry.RevokeTransfer(req, timeout=timeout)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def pull(
        self, req: transfers_pb2.PullRequest, timeout: float
    ) -> Iterator[transfers_pb2.PullResponse]:
        return _stream(self._transfers.Pull(req, timeout=timeout))

    def push(
        self, req: transfers_pb2.PushRequest, timeout: float
    ) -> Iterator[transfers_pb2.PushResponse]:
        return _stream(self._transfers.Push(req, timeout=timeout))

    def get_region_map(
        self, req: region_maps_pb2.GetRegionMapRequest, timeout: float
    ) -> region_maps_pb2.GetRegionMapResponse:
        try:
            return self._maps.GetRegionMap(req, timeout=timeout)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def get_stats(self, timeout: float) -> admin_pb2.GetStatsResponse:
        try:
            return self._admin.GetStats(admin_pb2.GetStatsRequest(), timeout=timeout)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def close(self) -> None:
        self._channel.close()
