"""The transport seam of the client library."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

from kvmap.v1 import admin_pb2, region_maps_pb2, registry_pb2, transfers_pb2


class AttachStream(Protocol):
    """Events from the daemon for one worker; iteration ends when the stream
    does. ``cancel`` ends it from the worker's side."""

    def __iter__(self) -> Iterator[registry_pb2.AttachResponse]: ...

    def cancel(self) -> None: ...


class Transport(Protocol):
    """Every call raises ``kvmap.core.errors.KvmapError`` subclasses (``kvmap.client.errors``)."""

    def send_fds(self, fds: Sequence[int], timeout: float) -> str: ...

    def register_worker(
        self, req: registry_pb2.RegisterWorkerRequest, timeout: float
    ) -> registry_pb2.RegisterWorkerResponse: ...

    def deregister_worker(
        self, req: registry_pb2.DeregisterWorkerRequest, timeout: float
    ) -> registry_pb2.DeregisterWorkerResponse: ...

    def attach(self, req: registry_pb2.AttachRequest) -> AttachStream: ...

    def grant_transfer(
        self, req: registry_pb2.GrantTransferRequest, timeout: float
    ) -> registry_pb2.GrantTransferResponse: ...

    def revoke_transfer(
        self, req: registry_pb2.RevokeTransferRequest, timeout: float
    ) -> registry_pb2.RevokeTransferResponse: ...

    # Pull and Push take the request's spec itself (the wire request is
    # PullRequest{spec}/PushRequest{spec}): a transport that serializes it
    # need not copy its block ids into a request message first.
    def pull(
        self, spec: transfers_pb2.TransferSpec, timeout: float
    ) -> Iterator[transfers_pb2.PullResponse]: ...

    def push(
        self, spec: transfers_pb2.TransferSpec, timeout: float
    ) -> Iterator[transfers_pb2.PushResponse]: ...

    def release(
        self, req: transfers_pb2.ReleaseRequest, timeout: float
    ) -> transfers_pb2.ReleaseResponse: ...

    def offer_push(
        self, req: transfers_pb2.OfferPushRequest, timeout: float
    ) -> transfers_pb2.OfferPushResponse: ...

    def get_region_map(
        self, req: region_maps_pb2.GetRegionMapRequest, timeout: float
    ) -> region_maps_pb2.GetRegionMapResponse: ...

    def get_stats(self, timeout: float) -> admin_pb2.GetStatsResponse: ...

    def close(self) -> None: ...
