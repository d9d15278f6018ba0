"""Synchronous client of a local kvmapd, over a transport (see transports)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvmap.client.transports import AttachStream, KvmapdTransport, Transport
from kvmap.core.errors import KvmapError
from kvmap.v1 import admin_pb2, region_maps_pb2, registry_pb2, transfers_pb2, types_pb2

DEFAULT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class TransferResult:
    descriptors: int
    bytes: int
    post_seconds: float
    completion_seconds: float
    remote_generation: int
    handshaked: bool
    # The daemon's id of the transfer (both daemons' logs name it so); ","
    # joins those of a load from several prefill ranks.
    transfer_id: str = ""


def _result(statuses: Iterable[transfers_pb2.TransferStatus]) -> TransferResult:
    last: transfers_pb2.TransferStatus | None = None
    for status in statuses:
        last = status
    if last is None or last.state != transfers_pb2.TRANSFER_STATE_DONE:
        raise KvmapError(f"transfer stream ended without DONE (last: {last})")
    s = last.stats
    return TransferResult(
        descriptors=s.descriptors,
        bytes=s.bytes,
        post_seconds=s.post_seconds,
        completion_seconds=s.completion_seconds,
        remote_generation=s.remote_generation,
        handshaked=s.handshaked,
        transfer_id=last.transfer_id,
    )


class KvmapClient:
    def __init__(self, transport: Transport, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.transport = transport
        self.timeout_s = timeout_s

    @classmethod
    def connect(cls, socket_path: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> KvmapClient:
        return cls(KvmapdTransport(socket_path), timeout_s)

    def register(
        self, req: registry_pb2.RegisterWorkerRequest, fds: Sequence[int] = ()
    ) -> types_pb2.RegionMap:
        """Register a worker. ``fds[i]`` backs the i-th allocation whose handle
        is ``shm_fd``; they travel over the fd hand-off socket first."""
        return self.register_worker(req, fds).region_map

    def register_worker(
        self, req: registry_pb2.RegisterWorkerRequest, fds: Sequence[int] = ()
    ) -> registry_pb2.RegisterWorkerResponse:
        """``register``, answering the whole response: the region map and the
        daemon's ``features``."""
        req = _copy(req)
        if fds:
            token = self.transport.send_fds(fds, self.timeout_s)
            for alloc in req.allocations:
                if alloc.WhichOneof("handle") == "shm_fd":
                    alloc.shm_fd.token = token
        return self.transport.register_worker(req, self.timeout_s)

    def deregister(self, worker: types_pb2.WorkerId) -> int:
        req = registry_pb2.DeregisterWorkerRequest(worker=worker)
        return self.transport.deregister_worker(req, self.timeout_s).generation

    def attach(self, worker: types_pb2.WorkerId) -> AttachStream:
        return self.transport.attach(registry_pb2.AttachRequest(worker=worker))

    def grant_transfer(
        self,
        worker: types_pb2.WorkerId,
        request_id: str,
        blocks: Mapping[int, Sequence[int]],
        ttl_ms: int = 0,
        max_uses: int = 0,
        *,
        open_uses: bool = False,
        unread_release: registry_pb2.UnreadRelease.ValueType = (
            registry_pb2.UNREAD_RELEASE_UNSPECIFIED
        ),
        access: registry_pb2.GrantAccess.ValueType = registry_pb2.GRANT_ACCESS_UNSPECIFIED,
        capability: str = "",
    ) -> registry_pb2.GrantTransferResponse:
        """Mint the capability a peer must present to read (or write) exactly
        ``blocks`` (block ids per transfer group) of ``worker`` for
        ``request_id``. ``ttl_ms`` 0 is the daemon's default, ``max_uses`` 0 is 1;
        ``open_uses``: the first transfer that declares its readers fixes the
        count (``max_uses`` must be 0); ``unread_release``: whether a release
        declaring no readers may use an open grant up unread (ALLOWED, where
        the worker's layout agrees) or never (REFUSED); ``access``: READ (a
        pull, the default) or WRITE (a push into these blocks);
        ``capability``: one this process drew (``new_capability``), granted
        instead of one the daemon draws (a daemon without
        DAEMON_FEATURE_CALLER_CAPABILITIES answers with its own)."""
        req = registry_pb2.GrantTransferRequest(
            worker=worker,
            request_id=request_id,
            groups=[
                types_pb2.BlockGrant(transfer_group=group, block_ids=list(ids))
                for group, ids in blocks.items()
            ],
            ttl_ms=ttl_ms,
            max_uses=max_uses,
            open_uses=open_uses,
            unread_release=unread_release,
            access=access,
            capability=capability,
        )
        return self.transport.grant_transfer(req, self.timeout_s)

    def revoke_transfer(self, worker: types_pb2.WorkerId, request_id: str) -> int:
        """Withdraw every grant of ``request_id`` (its blocks are being
        freed); how many announced writes into them have not finished
        (``RevokeTransferResponse.writes_in_flight``)."""
        req = registry_pb2.RevokeTransferRequest(worker=worker, request_id=request_id)
        return self.transport.revoke_transfer(req, self.timeout_s).writes_in_flight

    def offer_push(
        self, target: str, offer: types_pb2.PushOffer, timeout_s: float | None = None
    ) -> int:
        """Offer a worker's write-granted blocks to the prefill engine on the
        daemon at ``target`` (Transfers.OfferPush); how many of its workers heard."""
        req = transfers_pb2.OfferPushRequest(
            target=target, offer=offer, timeout_ms=int((timeout_s or self.timeout_s) * 1000)
        )
        return self.transport.offer_push(req, (timeout_s or self.timeout_s) + 2.0).workers

    def pull(
        self, spec: transfers_pb2.TransferSpec, timeout_s: float | None = None
    ) -> TransferResult:
        return _result(r.status for r in self.transport.pull(spec, timeout_s or self.timeout_s))

    def push(
        self, spec: transfers_pb2.TransferSpec, timeout_s: float | None = None
    ) -> TransferResult:
        return _result(r.status for r in self.transport.push(spec, timeout_s or self.timeout_s))

    def release(self, req: transfers_pb2.ReleaseRequest, timeout_s: float | None = None) -> None:
        """Give up this worker's use of a remote worker's grant (it needs none
        of the blocks): Transfers.Release, on daemons that list
        DAEMON_FEATURE_RELEASE_RPC."""
        self.transport.release(req, timeout_s or self.timeout_s)

    def get_region_map(self, worker: types_pb2.WorkerId) -> types_pb2.RegionMap:
        req = region_maps_pb2.GetRegionMapRequest(worker=worker)
        return self.transport.get_region_map(req, self.timeout_s).region_map

    def get_stats(self) -> admin_pb2.GetStatsResponse:
        return self.transport.get_stats(self.timeout_s)

    def close(self) -> None:
        self.transport.close()


def _copy(req: registry_pb2.RegisterWorkerRequest) -> registry_pb2.RegisterWorkerRequest:
    out = registry_pb2.RegisterWorkerRequest()
    out.CopyFrom(req)
    return out
