"""Asynchronous client of a local kvmapd: the same calls as ``KvmapClient``,
awaitable, over the same transports (so over the same seam and the same
error mapping). Each call runs the blocking transport call on a worker
thread; Attach events are delivered through an async iterator.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence

from kvmap.client.client import DEFAULT_TIMEOUT_S, KvmapClient, TransferResult
from kvmap.client.transports import KvmapdTransport, Transport
from kvmap.client.transports.base import AttachStream
from kvmap.v1 import admin_pb2, registry_pb2, transfers_pb2, types_pb2


class AsyncAttachStream:
    """Async iteration over a worker's Attach events; ``cancel`` ends it."""

    def __init__(self, stream: AttachStream) -> None:
        self._stream = stream
        self._it = iter(stream)

    def __aiter__(self) -> AsyncIterator[registry_pb2.AttachResponse]:
        return self._events()

    async def _events(self) -> AsyncIterator[registry_pb2.AttachResponse]:
        end = object()
        while True:
            item = await asyncio.to_thread(next, self._it, end)
            if item is end:
                return
            assert isinstance(item, registry_pb2.AttachResponse)
            yield item

    def cancel(self) -> None:
        self._stream.cancel()


class AsyncKvmapClient:
    def __init__(self, transport: Transport, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.sync = KvmapClient(transport, timeout_s)

    @classmethod
    def connect(cls, socket_path: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> AsyncKvmapClient:
        return cls(KvmapdTransport(socket_path), timeout_s)

    async def register(
        self, req: registry_pb2.RegisterWorkerRequest, fds: Sequence[int] = ()
    ) -> types_pb2.RegionMap:
        return await asyncio.to_thread(self.sync.register, req, fds)

    async def deregister(self, worker: types_pb2.WorkerId) -> int:
        return await asyncio.to_thread(self.sync.deregister, worker)

    async def attach(self, worker: types_pb2.WorkerId) -> AsyncAttachStream:
        stream = await asyncio.to_thread(self.sync.attach, worker)
        return AsyncAttachStream(stream)

    async def grant_transfer(
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
    ) -> registry_pb2.GrantTransferResponse:
        """``KvmapClient.grant_transfer``, off the event loop."""
        return await asyncio.to_thread(
            self.sync.grant_transfer,
            worker,
            request_id,
            blocks,
            ttl_ms,
            max_uses,
            open_uses=open_uses,
            unread_release=unread_release,
        )

    async def revoke_transfer(self, worker: types_pb2.WorkerId, request_id: str) -> None:
        await asyncio.to_thread(self.sync.revoke_transfer, worker, request_id)

    async def pull(
        self, spec: transfers_pb2.TransferSpec, timeout_s: float | None = None
    ) -> TransferResult:
        return await asyncio.to_thread(self.sync.pull, spec, timeout_s)

    async def push(
        self, spec: transfers_pb2.TransferSpec, timeout_s: float | None = None
    ) -> TransferResult:
        return await asyncio.to_thread(self.sync.push, spec, timeout_s)

    async def release(
        self, req: transfers_pb2.ReleaseRequest, timeout_s: float | None = None
    ) -> None:
        await asyncio.to_thread(self.sync.release, req, timeout_s)

    async def get_region_map(self, worker: types_pb2.WorkerId) -> types_pb2.RegionMap:
        return await asyncio.to_thread(self.sync.get_region_map, worker)

    async def get_stats(self) -> admin_pb2.GetStatsResponse:
        return await asyncio.to_thread(self.sync.get_stats)

    async def close(self) -> None:
        await asyncio.to_thread(self.sync.close)
