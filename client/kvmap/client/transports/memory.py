"""An in-process stand-in for kvmapd behind the ``Transport`` seam.

``MemoryDaemon`` keeps what a daemon keeps for its workers (registrations
with generations, Attach subscribers, statistics) and ``MemoryTransport`` is a
worker's connection to it. Daemons reach each other through a
``MemoryNetwork`` by peer address, so a pull on one daemon reads the blocks of
a worker registered on another, copies the bytes (the registered fds are
mapped, as the real daemon maps them), counts them on both sides and tells
the owner's worker that its blocks were read.

Used by the unit tests of code above the seam (the worker session, the vLLM
connector). Failures are injected with ``MemoryDaemon.pull_hook`` (called
before a pull; may sleep or raise a ``KvmapClientError``),
``MemoryDaemon.stop`` (every call is UNAVAILABLE, Attach streams end) and
``MemoryDaemon.restart`` (a new instance that forgot its workers).

Registration is checked only as far as this needs (handles resolve, views
lie inside their allocations); the daemon's own validation is tested on the
daemon. Region maps list one region per view (the ``baseline`` plan).
"""

from __future__ import annotations

import itertools
import mmap
import os
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from kvmap.client.errors import (
    FailedPrecondition,
    InvalidArgument,
    KvmapClientError,
    NotFound,
    Unavailable,
)
from kvmap.v1 import admin_pb2, region_maps_pb2, registry_pb2, transfers_pb2, types_pb2

WorkerKey = tuple[str, int, int, int]


def worker_key(worker: types_pb2.WorkerId, field_name: str = "worker") -> WorkerKey:
    if not worker.engine_id:
        raise InvalidArgument(f"INVALID_ARGUMENT: {field_name}.engine_id: must not be empty")
    return (worker.engine_id, worker.dp_rank, worker.tp_rank, worker.pp_rank)


class MemoryNetwork:
    """Peer addresses -> daemons, the way daemons find each other over TCP."""

    def __init__(self) -> None:
        self._daemons: dict[str, MemoryDaemon] = {}
        self._lock = threading.Lock()

    def daemon(self, address: str) -> MemoryDaemon:
        """A new daemon listening on ``address``."""
        d = MemoryDaemon(address, self)
        with self._lock:
            self._daemons[address] = d
        return d

    def find(self, address: str) -> MemoryDaemon:
        with self._lock:
            d = self._daemons.get(address)
        if d is None or d.stopped:
            raise Unavailable(f"UNAVAILABLE: no kvmapd at {address}")
        return d


@dataclass
class _Worker:
    request: registry_pb2.RegisterWorkerRequest
    generation: int
    maps: dict[str, memoryview]
    mmaps: list[mmap.mmap]

    def close(self) -> None:
        for m in self.maps.values():
            m.release()
        self.maps.clear()
        for mm in self.mmaps:
            mm.close()
        self.mmaps.clear()


class MemoryAttachStream:
    _END = object()

    def __init__(self, daemon: MemoryDaemon, key: WorkerKey) -> None:
        self._daemon = daemon
        self._key = key
        self._queue: queue.Queue[object] = queue.Queue()
        self._cancelled = False

    def put(self, event: object) -> None:
        self._queue.put(event)

    def __iter__(self) -> Iterator[registry_pb2.AttachResponse]:
        try:
            while True:
                item = self._queue.get()
                if item is self._END:
                    return
                if isinstance(item, KvmapClientError):
                    raise item
                assert isinstance(item, registry_pb2.AttachResponse)
                yield item
        finally:
            self._daemon._unsubscribe(self._key, self, cancelled=self._cancelled)

    def cancel(self) -> None:
        self._cancelled = True
        self._queue.put(self._END)


@dataclass
class MemoryDaemon:
    address: str
    network: MemoryNetwork
    stopped: bool = False
    instance: str = ""
    # Called with every pull's spec before it runs: sleep to delay, raise to fail.
    pull_hook: Callable[[transfers_pb2.TransferSpec], None] | None = None
    stats: admin_pb2.TransferCounters = field(default_factory=admin_pb2.TransferCounters)
    _workers: dict[WorkerKey, _Worker] = field(default_factory=dict)
    _generations: dict[WorkerKey, int] = field(default_factory=dict)
    _subscribers: dict[WorkerKey, list[MemoryAttachStream]] = field(default_factory=dict)
    _pending_fds: dict[str, list[int]] = field(default_factory=dict)
    _tokens: Iterator[int] = field(default_factory=itertools.count)
    _instances: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    _lock: threading.RLock = field(default_factory=threading.RLock)

    def __post_init__(self) -> None:
        self.instance = f"mem-{self.address}-{next(self._instances)}"

    # Failure injection --------------------------------------------------

    def stop(self) -> None:
        """The daemon goes away: calls fail UNAVAILABLE, Attach streams end."""
        with self._lock:
            self.stopped = True
            subs = [s for streams in self._subscribers.values() for s in streams]
            self._subscribers.clear()
            for w in self._workers.values():
                w.close()
            self._workers.clear()
            for fds in self._pending_fds.values():
                for fd in fds:
                    os.close(fd)
            self._pending_fds.clear()
        for s in subs:
            s.put(Unavailable("UNAVAILABLE: kvmapd stopped"))

    def restart(self) -> None:
        """A new daemon instance on the same address, with no workers."""
        self.stop()
        with self._lock:
            self.instance = f"mem-{self.address}-{next(self._instances)}"
            self.stopped = False

    # State inspection ---------------------------------------------------

    def workers(self) -> list[WorkerKey]:
        with self._lock:
            return sorted(self._workers)

    def generation(self, key: WorkerKey) -> int:
        with self._lock:
            return self._workers[key].generation

    def subscriber_count(self, key: WorkerKey) -> int:
        with self._lock:
            return len(self._subscribers.get(key, ()))

    def _check_up(self) -> None:
        if self.stopped:
            raise Unavailable(f"UNAVAILABLE: kvmapd at {self.address} is not running")

    # Daemon API -----------------------------------------------------------

    def send_fds(self, fds: Sequence[int]) -> str:
        self._check_up()
        if not fds:
            raise InvalidArgument("no fds to send")
        with self._lock:
            token = f"tok{next(self._tokens)}"
            self._pending_fds[token] = [os.dup(fd) for fd in fds]
        return token

    def register_worker(self, req: registry_pb2.RegisterWorkerRequest) -> types_pb2.RegionMap:
        self._check_up()
        key = worker_key(req.worker)
        maps, mmaps = self._import(req)
        with self._lock:
            generation = self._generations.get(key, 0) + 1
            self._generations[key] = generation
            old = self._workers.get(key)
            stored = registry_pb2.RegisterWorkerRequest()
            stored.CopyFrom(req)
            self._workers[key] = _Worker(stored, generation, maps, mmaps)
            region_map = self._region_map(self._workers[key])
            subs = list(self._subscribers.get(key, ()))
        if old is not None:
            old.close()
        event = registry_pb2.AttachResponse(
            region_map_changed=registry_pb2.RegionMapChangedEvent(
                generation=generation, planner=region_map.planner
            )
        )
        for s in subs:
            s.put(event)
        return region_map

    def _import(
        self, req: registry_pb2.RegisterWorkerRequest
    ) -> tuple[dict[str, memoryview], list[mmap.mmap]]:
        maps: dict[str, memoryview] = {}
        mmaps: list[mmap.mmap] = []
        sizes: dict[str, int] = {}
        try:
            for i, alloc in enumerate(req.allocations):
                sizes[alloc.id] = alloc.size_bytes
                which = alloc.WhichOneof("handle")
                if which == "none":
                    continue
                if which != "shm_fd":
                    raise FailedPrecondition(
                        f"FAILED_PRECONDITION: allocations[{i}]: the in-memory daemon maps "
                        f"shm_fd handles only, not {which}"
                    )
                with self._lock:
                    batch = self._pending_fds.get(alloc.shm_fd.token)
                if batch is None or alloc.shm_fd.index >= len(batch):
                    raise InvalidArgument(
                        f"INVALID_ARGUMENT: allocations[{i}].shm_fd: unknown token or index"
                    )
                fd = batch[alloc.shm_fd.index]
                length = alloc.shm_fd.offset_bytes + alloc.size_bytes
                mm = mmap.mmap(fd, length)
                mmaps.append(mm)
                maps[alloc.id] = memoryview(mm)[alloc.shm_fd.offset_bytes : length]
            for i, view in enumerate(req.views):
                size = sizes.get(view.allocation_id)
                if size is None:
                    raise InvalidArgument(
                        f"INVALID_ARGUMENT: views[{i}].allocation_id: unknown "
                        f"{view.allocation_id!r}"
                    )
                end = (
                    view.offset_bytes
                    + (view.num_blocks - 1) * view.block_stride_bytes
                    + view.block_len_bytes
                )
                if view.offset_bytes < 0 or end > size:
                    raise InvalidArgument(
                        f"INVALID_ARGUMENT: views[{i}]: ends at byte {end}, past its "
                        f"allocation of {size} bytes"
                    )
        except BaseException:
            for m in maps.values():
                m.release()
            for mm in mmaps:
                mm.close()
            raise
        return maps, mmaps

    def _region_map(self, w: _Worker) -> types_pb2.RegionMap:
        req = w.request
        m = types_pb2.RegionMap(
            worker=req.worker,
            generation=w.generation,
            planner=types_pb2.PlannerInfo(name="memory", version=1),
            kv_cache_layout=req.kv_cache_layout,
            block_size_tokens=req.block_size_tokens,
            tp_size=req.tp_size,
            view_count=len(req.views),
        )
        for i, v in enumerate(req.views):
            m.regions.add(
                id=i,
                allocation_id=v.allocation_id,
                transfer_group=v.transfer_group,
                offset_bytes=v.offset_bytes,
                block_len_bytes=v.block_len_bytes,
                block_stride_bytes=v.block_stride_bytes,
                num_blocks=v.num_blocks,
                layer_names=[v.layer_name],
                full_row=v.block_len_bytes == v.block_stride_bytes,
            )
        m.descriptor_count = m.baseline_descriptor_count = sum(v.num_blocks for v in req.views)
        for a in req.allocations:
            m.allocations.add(id=a.id, size_bytes=a.size_bytes, device=a.device)
        return m

    def deregister_worker(self, worker: types_pb2.WorkerId) -> int:
        self._check_up()
        key = worker_key(worker)
        with self._lock:
            w = self._workers.pop(key, None)
        if w is None:
            raise NotFound(f"NOT_FOUND: worker {key} is not registered")
        w.close()
        return w.generation

    def attach(self, worker: types_pb2.WorkerId) -> MemoryAttachStream:
        self._check_up()
        key = worker_key(worker)
        with self._lock:
            w = self._workers.get(key)
            if w is None:
                raise NotFound(f"NOT_FOUND: worker {key} is not registered")
            stream = MemoryAttachStream(self, key)
            self._subscribers.setdefault(key, []).append(stream)
            stream.put(
                registry_pb2.AttachResponse(
                    attached=registry_pb2.AttachedEvent(
                        generation=w.generation, daemon_instance=self.instance
                    )
                )
            )
        return stream

    def _unsubscribe(self, key: WorkerKey, stream: MemoryAttachStream, cancelled: bool) -> None:
        with self._lock:
            subs = self._subscribers.get(key)
            if subs is None or stream not in subs:
                return  # the daemon stopped: nothing of ours left
            subs.remove(stream)
            if subs:
                return
            del self._subscribers[key]
            # As kvmapd does: a worker without a live Attach stream is gone.
            w = self._workers.pop(key, None)
        if w is not None:
            w.close()

    def get_region_map(self, worker: types_pb2.WorkerId) -> types_pb2.RegionMap:
        self._check_up()
        key = worker_key(worker)
        with self._lock:
            w = self._workers.get(key)
            if w is None:
                raise NotFound(f"NOT_FOUND: worker {key} is not registered")
            return self._region_map(w)

    def get_stats(self) -> admin_pb2.GetStatsResponse:
        self._check_up()
        with self._lock:
            out = admin_pb2.GetStatsResponse(
                workers=len(self._workers), daemon_instance=self.instance
            )
            out.transfers.CopyFrom(self.stats)
        return out

    def transfer(
        self, spec: transfers_pb2.TransferSpec, write: bool
    ) -> Iterator[transfers_pb2.TransferStatus]:
        """Pull (``write`` False) or push: copy the blocks, count them, tell
        the owner's worker."""
        self._check_up()
        if not spec.request_id:
            raise InvalidArgument("INVALID_ARGUMENT: spec.request_id: must not be empty")
        if not spec.groups:
            raise InvalidArgument("INVALID_ARGUMENT: spec.groups: at least one group")
        if self.pull_hook is not None:
            try:
                self.pull_hook(spec)
            except KvmapClientError:
                with self._lock:
                    self.stats.failed += 1
                raise
        local_key = worker_key(spec.local_worker, "spec.local_worker")
        remote_key = worker_key(spec.remote_worker, "spec.remote_worker")
        peer = self.network.find(spec.remote_target)
        with self._lock:
            local = self._workers.get(local_key)
        if local is None:
            raise NotFound(f"NOT_FOUND: worker {local_key} is not registered")
        yield transfers_pb2.TransferStatus(state=transfers_pb2.TRANSFER_STATE_HANDSHAKING)
        with peer._lock:
            remote = peer._workers.get(remote_key)
            if remote is None:
                raise NotFound(f"NOT_FOUND: worker {remote_key} is not registered")
            if spec.remote_generation and spec.remote_generation != remote.generation:
                raise FailedPrecondition(
                    f"FAILED_PRECONDITION: worker {remote_key} is at generation "
                    f"{remote.generation}, not {spec.remote_generation}"
                )
            blocks, nbytes = _copy_blocks(local, remote, spec, write)
        yield transfers_pb2.TransferStatus(state=transfers_pb2.TRANSFER_STATE_POSTED)
        with self._lock:
            if write:
                self.stats.pushes_done += 1
            else:
                self.stats.pulls_done += 1
            self.stats.blocks += blocks
            self.stats.bytes += nbytes
        with peer._lock:
            peer.stats.served_done += 1
            peer.stats.served_blocks += blocks
            subs = list(peer._subscribers.get(remote_key, ()))
        direction = (
            registry_pb2.TRANSFER_DIRECTION_PUSHED_TO
            if write
            else registry_pb2.TRANSFER_DIRECTION_PULLED_FROM
        )
        event = registry_pb2.AttachResponse(
            transfer_finished=registry_pb2.TransferFinishedEvent(
                request_id=spec.request_id, direction=direction, peer_agent=self.instance
            )
        )
        for s in subs:
            s.put(event)
        yield transfers_pb2.TransferStatus(
            state=transfers_pb2.TRANSFER_STATE_DONE,
            message="done",
            stats=transfers_pb2.TransferStats(
                bytes=nbytes, remote_generation=remote.generation, descriptors=blocks
            ),
        )


def _copy_blocks(
    local: _Worker, remote: _Worker, spec: transfers_pb2.TransferSpec, write: bool
) -> tuple[int, int]:
    """Check every pair first, then copy: a bad request changes nothing."""
    copies: list[tuple[memoryview, memoryview]] = []
    blocks = 0
    for gi, g in enumerate(spec.groups):
        if len(g.local_block_ids) != len(g.remote_block_ids):
            raise InvalidArgument(
                f"INVALID_ARGUMENT: spec.groups[{gi}].remote_block_ids: "
                f"{len(g.remote_block_ids)} ids for {len(g.local_block_ids)} local ids"
            )
        lviews = {
            v.layer_name: v for v in local.request.views if v.transfer_group == g.transfer_group
        }
        rviews = {
            v.layer_name: v for v in remote.request.views if v.transfer_group == g.transfer_group
        }
        if not lviews or not rviews:
            raise NotFound(f"NOT_FOUND: transfer group {g.transfer_group}")
        names = list(g.layer_names) or sorted(lviews)
        for name in names:
            lv, rv = lviews.get(name), rviews.get(name)
            if lv is None or rv is None:
                raise NotFound(f"NOT_FOUND: layer {name!r} in transfer group {g.transfer_group}")
            if lv.block_len_bytes != rv.block_len_bytes:
                raise FailedPrecondition(
                    f"FAILED_PRECONDITION: layer {name!r}: block of {lv.block_len_bytes} bytes "
                    f"here, {rv.block_len_bytes} on the peer"
                )
            for side, view, ids in (
                ("local", lv, g.local_block_ids),
                ("remote", rv, g.remote_block_ids),
            ):
                for i, b in enumerate(ids):
                    if not 0 <= b < view.num_blocks:
                        raise InvalidArgument(
                            f"INVALID_ARGUMENT: spec.groups[{gi}].{side}_block_ids[{i}]: "
                            f"block {b} out of range [0, {view.num_blocks})"
                        )
            lmem = local.maps.get(lv.allocation_id)
            rmem = remote.maps.get(rv.allocation_id)
            if lmem is None or rmem is None:
                raise FailedPrecondition("FAILED_PRECONDITION: allocation has no memory")
            n = lv.block_len_bytes
            for lb, rb in zip(g.local_block_ids, g.remote_block_ids, strict=True):
                lo = lv.offset_bytes + lb * lv.block_stride_bytes
                ro = rv.offset_bytes + rb * rv.block_stride_bytes
                dst, src = (
                    (rmem[ro : ro + n], lmem[lo : lo + n])
                    if write
                    else (
                        lmem[lo : lo + n],
                        rmem[ro : ro + n],
                    )
                )
                copies.append((dst, src))
        blocks += len(g.local_block_ids)
    nbytes = 0
    for dst, src in copies:
        dst[:] = src
        nbytes += len(src)
    return blocks, nbytes


class MemoryTransport:
    """A worker's connection to a ``MemoryDaemon`` (the ``Transport`` seam)."""

    def __init__(self, daemon: MemoryDaemon) -> None:
        self.daemon = daemon
        self.closed = False

    def send_fds(self, fds: Sequence[int], timeout: float) -> str:
        return self.daemon.send_fds(fds)

    def register_worker(
        self, req: registry_pb2.RegisterWorkerRequest, timeout: float
    ) -> registry_pb2.RegisterWorkerResponse:
        return registry_pb2.RegisterWorkerResponse(region_map=self.daemon.register_worker(req))

    def deregister_worker(
        self, req: registry_pb2.DeregisterWorkerRequest, timeout: float
    ) -> registry_pb2.DeregisterWorkerResponse:
        return registry_pb2.DeregisterWorkerResponse(
            generation=self.daemon.deregister_worker(req.worker)
        )

    def attach(self, req: registry_pb2.AttachRequest) -> MemoryAttachStream:
        return self.daemon.attach(req.worker)

    def pull(
        self, req: transfers_pb2.PullRequest, timeout: float
    ) -> Iterator[transfers_pb2.PullResponse]:
        return (
            transfers_pb2.PullResponse(status=s)
            for s in self.daemon.transfer(req.spec, write=False)
        )

    def push(
        self, req: transfers_pb2.PushRequest, timeout: float
    ) -> Iterator[transfers_pb2.PushResponse]:
        return (
            transfers_pb2.PushResponse(status=s) for s in self.daemon.transfer(req.spec, write=True)
        )

    def get_region_map(
        self, req: region_maps_pb2.GetRegionMapRequest, timeout: float
    ) -> region_maps_pb2.GetRegionMapResponse:
        return region_maps_pb2.GetRegionMapResponse(
            region_map=self.daemon.get_region_map(req.worker)
        )

    def get_stats(self, timeout: float) -> admin_pb2.GetStatsResponse:
        return self.daemon.get_stats()

    def close(self) -> None:
        self.closed = True
