"""A live kvmapd on this machine, over the three Unix sockets it listens on:
gRPC (``<socket>``, ``grpc.GrpcTransport``), the fd hand-off socket
(``<socket>.fds``, ``handoff.HandoffTransport``: a registration's fds, and
the credential token Registry calls over gRPC present) and the local calls
socket (``<socket>.calls``, ``local_calls.LocalCallsTransport``). What
``KvmapClient.connect`` talks through.

Attach, GrantTransfer, RevokeTransfer, Pull and Push go on the local calls
socket where the daemon has one, and over gRPC where it answers that they
must (no socket, no room, an older daemon); everything else goes over gRPC.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvmap.client.fd_handoff import fd_socket_path
from kvmap.client.transports.base import AttachStream
from kvmap.client.transports.grpc import GrpcTransport
from kvmap.client.transports.handoff import HandoffTransport
from kvmap.client.transports.local_calls import LocalCallsTransport
from kvmap.core.config import LOCAL_CALLS_SUFFIX
from kvmap.v1 import admin_pb2, region_maps_pb2, registry_pb2, transfers_pb2


class KvmapdTransport:
    """The kvmapd whose gRPC socket is ``socket_path`` (its fd hand-off
    socket at ``fd_socket``, by default beside it)."""

    def __init__(self, socket_path: str, fd_socket: str | None = None) -> None:
        self.socket_path = socket_path
        self.handoff = HandoffTransport(fd_socket or fd_socket_path(socket_path))
        self.grpc = GrpcTransport(socket_path, credentials=self.handoff.credentials)
        self.local = LocalCallsTransport(socket_path + LOCAL_CALLS_SUFFIX)

    def send_fds(self, fds: Sequence[int], timeout: float) -> str:
        return self.handoff.send_fds(fds, timeout)

    def register_worker(
        self, req: registry_pb2.RegisterWorkerRequest, timeout: float
    ) -> registry_pb2.RegisterWorkerResponse:
        return self.grpc.register_worker(req, timeout)

    def deregister_worker(
        self, req: registry_pb2.DeregisterWorkerRequest, timeout: float
    ) -> registry_pb2.DeregisterWorkerResponse:
        return self.grpc.deregister_worker(req, timeout)

    def attach(self, req: registry_pb2.AttachRequest) -> AttachStream:
        stream = self.local.attach(req, lambda: self.grpc.attach(req))
        return stream if stream is not None else self.grpc.attach(req)

    def grant_transfer(
        self, req: registry_pb2.GrantTransferRequest, timeout: float
    ) -> registry_pb2.GrantTransferResponse:
        # A scheduler grants on every rank for every request: the cheap socket.
        granted = self.local.grant_transfer(req, timeout)
        return granted if granted is not None else self.grpc.grant_transfer(req, timeout)

    def revoke_transfer(
        self, req: registry_pb2.RevokeTransferRequest, timeout: float
    ) -> registry_pb2.RevokeTransferResponse:
        revoked = self.local.revoke_transfer(req, timeout)
        return revoked if revoked is not None else self.grpc.revoke_transfer(req, timeout)

    def pull(
        self, spec: transfers_pb2.TransferSpec, timeout: float
    ) -> Iterator[transfers_pb2.PullResponse]:
        local = self.local.pull(spec, timeout)
        return iter(local) if local is not None else self.grpc.pull(spec, timeout)

    def push(
        self, spec: transfers_pb2.TransferSpec, timeout: float
    ) -> Iterator[transfers_pb2.PushResponse]:
        local = self.local.push(spec, timeout)
        return iter(local) if local is not None else self.grpc.push(spec, timeout)

    def release(
        self, req: transfers_pb2.ReleaseRequest, timeout: float
    ) -> transfers_pb2.ReleaseResponse:
        return self.grpc.release(req, timeout)

    def offer_push(
        self, req: transfers_pb2.OfferPushRequest, timeout: float
    ) -> transfers_pb2.OfferPushResponse:
        return self.grpc.offer_push(req, timeout)

    def get_region_map(
        self, req: region_maps_pb2.GetRegionMapRequest, timeout: float
    ) -> region_maps_pb2.GetRegionMapResponse:
        return self.grpc.get_region_map(req, timeout)

    def get_stats(self, timeout: float) -> admin_pb2.GetStatsResponse:
        return self.grpc.get_stats(timeout)

    def close(self) -> None:
        self.local.close()
        self.grpc.close()
