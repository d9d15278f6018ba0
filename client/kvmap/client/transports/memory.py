"""An in-process stand-in for kvmapd behind the ``Transport`` seam.

``MemoryDaemon`` keeps what a daemon keeps for its workers (registrations
with generations, Attach subscribers, undelivered notifications, statistics)
and ``MemoryTransport`` is a worker's connection to it. Daemons reach each
other through a ``MemoryNetwork`` by peer address, so a pull on one daemon
reads the blocks of a worker registered on another, copies the bytes (the
registered shared memory is mapped, as the real daemon maps it), counts them
on both sides and tells the owner's worker that its blocks were read.

It decides what kvmapd decides with kvmapd's own core
(``kvmap.core``): registrations are converted and validated by
``convert.parse_and_validate``, planned by the daemon's planners (``baseline``
unless the daemon is made with another) and published by
``convert.region_map_to_proto``; pulls and pushes are planned by
``transfer_pieces`` / ``transfer_plan`` over both region maps and the planned
descriptors are copied. Core errors reach the caller as the client errors
that gRPC would deliver (same class, same message; see ``client_error``).
What the core does not decide (fd tokens, mapping the memory, the handshake
with the peer, notifications) is modelled on the daemon's engine and
adapters; ``tests/contract`` runs the same scenarios against this and a real
``kvmapd serve`` to keep the two in step. Not modelled: CUDA memory, TLS,
draining, transfer deadlines, leases (a transfer here is begun and completed
at once, so a capability is claimed and consumed together), and state kept
across a restart other than the generation counters (as with ``--state-dir``
for workers whose memory the daemon cannot reopen by itself).

Capabilities are checked as kvmapd checks them, with the same core
(``kvmap.core.grants``): GrantTransfer validates against the worker's
geometry and mints a secret kept only as its digest; a transfer presents it
and the owner's side admits it after the puller's own checks, before any
byte moves.

Used by the unit tests of code above the seam (the worker session, the vLLM
connector). Failures are injected with ``MemoryDaemon.pull_hook`` (called
before a pull's handshake; may sleep or raise a ``KvmapClientError``),
``MemoryDaemon.stop`` (every call is UNAVAILABLE, Attach streams end) and
``MemoryDaemon.restart`` (a new instance that forgot its workers).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import mmap
import os
import queue
import secrets
import stat
import threading
import time
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
import numpy as np

from kvmap.client.errors import (
    InvalidArgument,
    KvmapClientError,
    ResourceExhausted,
    Unavailable,
    from_status,
)
from kvmap.client.fd_handoff import SCM_MAX_FD
from kvmap.core import convert, grants
from kvmap.core import errors as core
from kvmap.core.compat import check_compatible
from kvmap.core.config import MAX_REGION_MAP_BYTES
from kvmap.core.features import DAEMON_FEATURES
from kvmap.core.geometry import Plan, RegionMapModel, WorkerGeometry
from kvmap.core.geometry import WorkerKey as CoreKey
from kvmap.core.planner import get_planner
from kvmap.core.token_plan import TokenGroup, plan_token_transfer, token_groups
from kvmap.core.transfer_pieces import (
    Int64Array,
    LayerSelection,
    PieceTable,
    Side,
    SideRows,
    build_piece_table,
)
from kvmap.core.transfer_plan import GroupPairs, TransferPlan, check_sizes, plan_transfer
from kvmap.v1 import admin_pb2, region_maps_pb2, registry_pb2, transfers_pb2, types_pb2

# (engine_id, dp_rank, tp_rank, pp_rank): how tests name a worker.
WorkerKey = tuple[str, int, int, int]

# As kvmapd's fd hand-off server (kvmap.daemon.adapters.fd_handoff).
TOKEN_TTL_S = 120.0
MAX_PENDING_TOKENS = 64
# As kvmapd's Request.parse (kvmap.daemon.engine.transfers).
MAX_REQUEST_ID = 256
_PAGE = mmap.ALLOCATIONGRANULARITY


def _wall_ms() -> int:
    return time.time_ns() // 1_000_000


def client_error(err: core.KvmapError) -> KvmapClientError:
    """The client error a gRPC caller gets when kvmapd raises ``err``: the
    status named like the core's code, the message bounded as on the wire."""
    code, message = core.status_of(err)
    return from_status(getattr(grpc.StatusCode, code.name, grpc.StatusCode.UNKNOWN), message)


@contextlib.contextmanager
def _as_client_errors() -> Iterator[None]:
    try:
        yield
    except core.KvmapError as err:
        raise client_error(err) from None


def _tuple(key: CoreKey) -> WorkerKey:
    return (key.engine_id, key.dp_rank, key.tp_rank, key.pp_rank)


def worker_key(worker: types_pb2.WorkerId, field_name: str = "worker") -> WorkerKey:
    """The worker a request names, rejected as kvmapd rejects it."""
    with _as_client_errors():
        return _tuple(convert.requested_worker(worker, field_name))


class MemoryNetwork:
    """Peer addresses -> daemons, the way daemons find each other over TCP."""

    def __init__(self) -> None:
        self._daemons: dict[str, MemoryDaemon] = {}
        self._lock = threading.Lock()

    def daemon(self, address: str, planner: str = "baseline") -> MemoryDaemon:
        """A new daemon listening on ``address``, planning with ``planner``."""
        d = MemoryDaemon(address, self, planner=planner)
        with self._lock:
            self._daemons[address] = d
        return d

    def lookup(self, address: str) -> MemoryDaemon | None:
        """The running daemon at ``address``, if any."""
        with self._lock:
            d = self._daemons.get(address)
        return None if d is None or d.stopped else d

    def find(self, address: str) -> MemoryDaemon:
        d = self.lookup(address)
        if d is None:
            raise Unavailable(f"UNAVAILABLE: no kvmapd at {address}")
        return d


# Memory ------------------------------------------------------------------


class _Mapping:
    """One allocation mapped shared and read/write, as kvmapd maps it; owns
    nothing else (the fd it was mapped from is closed at once)."""

    def __init__(self, fd: int, offset: int, size: int) -> None:
        map_offset = offset - offset % _PAGE
        head = offset - map_offset
        self._mmap = mmap.mmap(
            fd,
            head + size,
            flags=mmap.MAP_SHARED,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
            offset=map_offset,
        )
        # A real address, as the daemon publishes; the export is dropped at
        # once or close() would refuse.
        probe = ctypes.c_char.from_buffer(self._mmap)
        self.address = ctypes.addressof(probe) + head
        del probe
        self.size = size
        self.view = memoryview(self._mmap)[head : head + size]

    def close(self) -> None:
        self.view.release()
        self._mmap.close()


def _check_object(fd: int, offset: int, size: int, field_path: str) -> None:
    """kvmapd's checks before mapping (kvmap.daemon.adapters.memory)."""
    if offset < 0:
        raise core.InvalidArgument(field_path, f"offset {offset} is negative")
    try:
        st = os.fstat(fd)
    except OSError as e:
        raise core.InvalidArgument(field_path, f"not an open file descriptor ({e.strerror})") from e
    if not stat.S_ISREG(st.st_mode):
        raise core.InvalidArgument(field_path, "not a shared-memory object (not a regular file)")
    if st.st_size < offset + size:
        raise core.InvalidArgument(
            field_path,
            f"shared-memory object is {st.st_size} bytes, smaller than offset {offset}"
            f" + size {size} = {offset + size}",
        )


def _map_fd(fd: int, offset: int, size: int, field_path: str) -> _Mapping:
    """Map ``fd`` (consumed: closed whatever happens)."""
    try:
        _check_object(fd, offset, size, field_path)
        try:
            return _Mapping(fd, offset, size)
        except (OSError, ValueError) as e:
            problem = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise core.InvalidArgument(field_path, f"cannot map read/write: {problem}") from e
    finally:
        os.close(fd)


def _open_path(path: str, field_path: str) -> int:
    if not os.path.isabs(path):
        raise core.InvalidArgument(field_path, f"path {path[:256]!r} is not absolute")
    try:
        return os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as e:
        raise core.InvalidArgument(field_path, f"cannot open {path[:256]!r}: {e.strerror}") from e
    except ValueError as e:
        raise core.InvalidArgument(
            field_path, f"path {path[:256]!r} is not a valid path: {e}"
        ) from e


@dataclass
class _FdBatch:
    fds: list[int]
    expires_at: float

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()


# Workers -----------------------------------------------------------------


@dataclass
class _Worker:
    """One registered worker at one generation, with its mapped memory."""

    geometry: WorkerGeometry
    model: RegionMapModel
    memory: dict[str, _Mapping]

    @property
    def generation(self) -> int:
        return self.model.generation

    def close(self) -> None:
        for m in self.memory.values():
            m.close()
        self.memory.clear()


class _Windows:
    """Addresses in one worker's mapped allocations -> their bytes."""

    def __init__(self, memory: dict[str, _Mapping]) -> None:
        self._spans = sorted(memory.values(), key=lambda m: m.address)
        self._starts = [m.address for m in self._spans]

    def __call__(self, address: int, length: int) -> memoryview:
        i = bisect_right(self._starts, address) - 1
        if i >= 0:
            m = self._spans[i]
            start = address - m.address
            if start + length <= m.size:
                return m.view[start : start + length]
        # The core checked every descriptor against the maps: a bug here.
        raise core.InternalError(f"descriptor [{address:#x}, +{length}) is outside every mapping")


def _close_all(memory: dict[str, _Mapping]) -> None:
    for m in memory.values():
        m.close()


class MemoryAttachStream:
    """Events for one worker, as an Attach stream delivers them."""

    _END = object()

    def __init__(self, daemon: MemoryDaemon, key: CoreKey) -> None:
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


# Transfers ----------------------------------------------------------------


@dataclass(frozen=True)
class _Request:
    """A TransferSpec checked as kvmapd checks it (engine ``Request.parse``)."""

    request_id: str
    local: CoreKey
    target: str
    remote: CoreKey
    selections: tuple[LayerSelection, ...]
    pairs: tuple[GroupPairs, ...]
    expected_generation: int
    capability: str
    # Token-mode groups (wire num_tokens > 0), as kvmapd reads them.
    tokens: tuple[TokenGroup, ...] = ()
    readers: int = 0
    release: bool = False

    @classmethod
    def parse(cls, spec: transfers_pb2.TransferSpec) -> _Request:
        if not spec.request_id:
            raise core.InvalidArgument("spec.request_id", "must not be empty")
        if not spec.remote_target or ":" not in spec.remote_target:
            raise core.InvalidArgument("spec.remote_target", "expected HOST:PORT")
        readers = grants.check_readers(spec.readers, "spec.readers")
        if spec.release:
            if spec.groups:
                raise core.InvalidArgument("spec.groups", "a release names no blocks")
            if not spec.capability:
                raise core.PermissionDenied(
                    "spec.capability: a release needs the owner's capability"
                )
            return cls(
                request_id=spec.request_id[:MAX_REQUEST_ID],
                local=convert.requested_worker(spec.local_worker, "spec.local_worker"),
                target=spec.remote_target,
                remote=convert.requested_worker(spec.remote_worker, "spec.remote_worker"),
                selections=(),
                pairs=(),
                expected_generation=spec.remote_generation,
                capability=spec.capability,
                readers=readers,
                release=True,
            )
        if not spec.groups:
            raise core.InvalidArgument("spec.groups", "at least one transfer group is required")
        pairs = tuple(
            GroupPairs(g.transfer_group, list(g.local_block_ids), list(g.remote_block_ids))
            for g in spec.groups
        )
        tokens = token_groups(spec)
        if not tokens:
            check_sizes(pairs)  # as kvmapd: before anything is planned for the request
        if not spec.capability:
            raise core.PermissionDenied("spec.capability: a transfer needs the owner's capability")
        return cls(
            request_id=spec.request_id[:MAX_REQUEST_ID],
            local=convert.requested_worker(spec.local_worker, "spec.local_worker"),
            target=spec.remote_target,
            remote=convert.requested_worker(spec.remote_worker, "spec.remote_worker"),
            selections=tuple(
                LayerSelection(g.transfer_group, tuple(g.layer_names)) for g in spec.groups
            ),
            pairs=pairs,
            expected_generation=spec.remote_generation,
            capability=spec.capability,
            tokens=tokens,
            readers=readers,
        )


def _finished(
    request_id: str, agent: str, used: grants.Grant, *, write: bool, released: bool = False
) -> registry_pb2.AttachResponse:
    """The owner's TransferFinishedEvent, with the grant's count after the use."""
    return registry_pb2.AttachResponse(
        transfer_finished=registry_pb2.TransferFinishedEvent(
            request_id=request_id,
            direction=(
                registry_pb2.TRANSFER_DIRECTION_PUSHED_TO
                if write
                else registry_pb2.TRANSFER_DIRECTION_PULLED_FROM
            ),
            peer_agent=agent,
            uses=used.uses,
            max_uses=used.max_uses,
            exhausted=used.exhausted,
            released=released,
        )
    )


def _status(
    state: transfers_pb2.TransferState.ValueType, message: str, **stats: Any
) -> transfers_pb2.TransferStatus:
    return transfers_pb2.TransferStatus(
        state=state, message=message, stats=transfers_pb2.TransferStats(**stats)
    )


def _descriptor_addresses(
    rows: SideRows, lengths: Int64Array, indices: Int64Array
) -> tuple[Int64Array, Int64Array]:
    """Addresses and lengths of prepared-list descriptors: index
    ``first_index[p] + b`` is block ``b`` of piece ``p``."""
    piece = np.searchsorted(rows.first_index, indices, side="right") - 1
    block = indices - rows.first_index[piece]
    return rows.addr[piece] + block * rows.stride[piece], lengths[piece]


def _copies(
    table: PieceTable | None, plan: TransferPlan, local: _Worker, remote: _Worker, write: bool
) -> list[tuple[memoryview, memoryview]]:
    """(destination, source) windows of every planned descriptor (a
    token-mode plan has no piece table: explicit descriptors only)."""
    pairs = [tuple(run) for run in plan.runs.tolist()]
    if table is not None:
        lidx = plan.local_indices.astype(np.int64)
        ridx = plan.remote_indices.astype(np.int64)
        laddr, lens = _descriptor_addresses(table.local, table.len_bytes, lidx)
        raddr, _ = _descriptor_addresses(table.remote, table.len_bytes, ridx)
        pairs[:0] = zip(laddr.tolist(), raddr.tolist(), lens.tolist(), strict=True)
    lwin, rwin = _Windows(local.memory), _Windows(remote.memory)
    out = []
    for la, ra, n in pairs:
        lw, rw = lwin(la, n), rwin(ra, n)
        out.append((rw, lw) if write else (lw, rw))
    return out


@contextlib.contextmanager
def _locked(*daemons: MemoryDaemon) -> Iterator[None]:
    """Both daemons' locks, always in the same order (pulls both ways at once)."""
    with contextlib.ExitStack() as stack:
        for d in sorted({id(d): d for d in daemons}.values(), key=id):
            stack.enter_context(d._lock)
        yield


@dataclass
class MemoryDaemon:
    address: str
    network: MemoryNetwork
    stopped: bool = False
    instance: str = ""
    # Called with every pull's (and push's) spec before its handshake: sleep to
    # delay, raise a KvmapClientError to fail it (counted as failed).
    pull_hook: Callable[[transfers_pb2.TransferSpec], None] | None = None
    stats: admin_pb2.TransferCounters = field(default_factory=admin_pb2.TransferCounters)
    planner: str = "baseline"
    # What RegisterWorker lists (kvmapd's DAEMON_FEATURES); a test sets fewer
    # to stand in for an older daemon.
    features: tuple[registry_pb2.DaemonFeature.ValueType, ...] = DAEMON_FEATURES
    _workers: dict[CoreKey, _Worker] = field(default_factory=dict)
    _generations: dict[CoreKey, int] = field(default_factory=dict)
    _subscribers: dict[CoreKey, list[MemoryAttachStream]] = field(default_factory=dict)
    # Notifications no Attach stream has delivered yet (kvmapd keeps them in its store).
    _pending_events: dict[CoreKey, list[registry_pb2.AttachResponse]] = field(default_factory=dict)
    _pending_fds: dict[str, _FdBatch] = field(default_factory=dict)
    # Capabilities by digest (kvmapd's engine.grants), never the secret.
    _grants: dict[bytes, grants.Grant] = field(default_factory=dict)
    # (target, remote worker) -> (peer instance, generation) of the last handshake.
    _handshakes: dict[tuple[str, CoreKey], tuple[str, int]] = field(default_factory=dict)
    _tokens: Iterator[int] = field(default_factory=itertools.count)
    _instances: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    _lock: threading.RLock = field(default_factory=threading.RLock)

    def __post_init__(self) -> None:
        self.instance = f"mem-{self.address}-{next(self._instances)}"
        with _as_client_errors():
            self._planner = get_planner(self.planner)

    @property
    def agent_name(self) -> str:
        """The name peers see in notifications (kvmapd's NIXL agent name)."""
        return f"kvmapd-{self.instance}"

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
            for batch in self._pending_fds.values():
                batch.close()
            self._pending_fds.clear()
            self._pending_events.clear()
            self._handshakes.clear()
            self._grants.clear()
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
            return [_tuple(k) for k in sorted(self._workers)]

    def generation(self, key: WorkerKey) -> int:
        with self._lock:
            return self._workers[CoreKey(*key)].generation

    def subscriber_count(self, key: WorkerKey) -> int:
        with self._lock:
            return len(self._subscribers.get(CoreKey(*key), ()))

    def _check_up(self) -> None:
        if self.stopped:
            raise Unavailable(f"UNAVAILABLE: kvmapd at {self.address} is not running")

    def _get(self, key: CoreKey) -> _Worker:
        w = self._workers.get(key)
        if w is None:
            raise core.NotFound(f"worker {key} is not registered")
        return w

    # Fd hand-off ----------------------------------------------------------

    def send_fds(self, fds: Sequence[int]) -> str:
        """Keep duplicates of ``fds`` under a new token, as the hand-off socket does."""
        self._check_up()
        if not fds:
            raise InvalidArgument("no fds to send")
        if len(fds) > SCM_MAX_FD:
            raise InvalidArgument(f"{len(fds)} fds in one batch; at most {SCM_MAX_FD}")
        dups: list[int] = []
        try:
            for fd in fds:
                dups.append(os.dup(fd))
        except OSError as e:
            _FdBatch(dups, 0.0).close()
            raise InvalidArgument(f"cannot send fds {list(fds)}: {e.strerror}") from e
        with self._lock:
            self._expire_fds()
            if len(self._pending_fds) >= MAX_PENDING_TOKENS:
                _FdBatch(dups, 0.0).close()
                raise ResourceExhausted(
                    f"RESOURCE_EXHAUSTED: fd hand-off rejected: {len(self._pending_fds)} fd "
                    f"batches already pending (limit {MAX_PENDING_TOKENS}); register or retry later"
                )
            token = f"tok{next(self._tokens)}"
            self._pending_fds[token] = _FdBatch(dups, time.monotonic() + TOKEN_TTL_S)
        return token

    def _expire_fds(self) -> None:
        now = time.monotonic()
        for token in [t for t, b in self._pending_fds.items() if b.expires_at <= now]:
            self._pending_fds.pop(token).close()

    def _claim(self, token: str, index: int, field_path: str) -> int:
        """A duplicate of fd ``index`` of batch ``token`` (the caller owns it)."""
        self._expire_fds()
        batch = self._pending_fds.get(token)
        if batch is None:
            raise core.NotFound(f"{field_path}.token: unknown or expired fd hand-off token")
        if not 0 <= index < len(batch.fds):
            raise core.InvalidArgument(
                f"{field_path}.index", f"index {index} outside the batch of {len(batch.fds)} fds"
            )
        return os.dup(batch.fds[index])

    # Registration ---------------------------------------------------------

    def register_worker(self, req: registry_pb2.RegisterWorkerRequest) -> types_pb2.RegionMap:
        """Validate, plan, map and publish, as kvmapd's registrar: every step
        that can fail comes before the worker's record changes."""
        self._check_up()
        with _as_client_errors():
            geometry = convert.parse_and_validate(req)
            plan = self._planner.plan(geometry)
            with self._lock:
                record = self._install(req, geometry, plan)
                subs = list(self._subscribers.get(geometry.worker, ()))
        event = registry_pb2.AttachResponse(
            region_map_changed=registry_pb2.RegionMapChangedEvent(
                generation=record.generation,
                planner=convert.planner_info_to_proto(record.model.planner),
            )
        )
        for s in subs:
            s.put(event)
        return convert.region_map_to_proto(record.model)

    def _install(
        self, req: registry_pb2.RegisterWorkerRequest, geometry: WorkerGeometry, plan: Plan
    ) -> _Worker:
        memory = self._import(req)
        try:
            record = self._make_record(geometry, plan, memory)
        except BaseException:
            _close_all(memory)
            raise
        old = self._workers.get(geometry.worker)
        self._workers[geometry.worker] = record
        self._drop_grants(geometry.worker)  # new memory: old block ids mean nothing
        if old is not None:
            old.close()
        for alloc in req.allocations:
            # The claimed fds are mapped; the batch is done with, as in kvmapd.
            if alloc.WhichOneof("handle") == "shm_fd":
                batch = self._pending_fds.pop(alloc.shm_fd.token, None)
                if batch is not None:
                    batch.close()
        return record

    def _make_record(
        self, geometry: WorkerGeometry, plan: Plan, memory: dict[str, _Mapping]
    ) -> _Worker:
        generation = self._generations.get(geometry.worker, 0) + 1
        self._generations[geometry.worker] = generation
        bases = {k: m.address for k, m in memory.items()}
        model = convert.model_from_plan(geometry, plan, generation, bases)
        # Device ordinals in a published map are the daemon's (0 for host memory).
        model = replace(
            model,
            allocations=tuple(
                replace(a, device=replace(a.device, index=0)) for a in model.allocations
            ),
        )
        size = convert.region_map_to_proto(model).ByteSize()
        if size > MAX_REGION_MAP_BYTES:
            raise core.InvalidArgument(
                "views",
                f"the region map would be {size} bytes, over the {MAX_REGION_MAP_BYTES}-byte "
                "limit of one message: register fewer views or shorter layer names",
            )
        return _Worker(geometry, model, memory)

    def _import(self, req: registry_pb2.RegisterWorkerRequest) -> dict[str, _Mapping]:
        """Map every allocation; on any failure unmap what was mapped."""
        memory: dict[str, _Mapping] = {}
        try:
            for i, alloc in enumerate(req.allocations):
                memory[alloc.id] = self._map_allocation(f"allocations[{i}]", alloc)
        except BaseException:
            _close_all(memory)
            raise
        return memory

    def _map_allocation(self, at: str, alloc: types_pb2.Allocation) -> _Mapping:
        which = alloc.WhichOneof("handle")
        if which == "cuda_ipc":
            raise core.FailedPrecondition(
                f"{at}: the in-memory daemon maps shared memory (shm_fd, shm_path) only, "
                "not cuda_ipc"
            )
        if alloc.device.type == types_pb2.DEVICE_TYPE_CUDA:
            raise core.InvalidArgument(f"{at}.handle", "a CUDA allocation needs a cuda_ipc handle")
        if which == "shm_fd":
            fd = self._claim(alloc.shm_fd.token, alloc.shm_fd.index, f"{at}.shm_fd")
            return _map_fd(fd, alloc.shm_fd.offset_bytes, alloc.size_bytes, f"{at}.shm_fd")
        if which == "shm_path":
            where = f"{at}.shm_path"
            if alloc.shm_path.offset_bytes < 0:
                raise core.InvalidArgument(
                    where, f"offset {alloc.shm_path.offset_bytes} is negative"
                )
            fd = _open_path(alloc.shm_path.path, where)
            return _map_fd(fd, alloc.shm_path.offset_bytes, alloc.size_bytes, where)
        raise core.InvalidArgument(
            f"{at}.handle",
            "registration needs memory: set shm_fd, shm_path or cuda_ipc "
            "(a handle of 'none' is for PlanPreview and kvmapd plan only)",
        )

    def deregister_worker(self, worker: types_pb2.WorkerId) -> int:
        self._check_up()
        with _as_client_errors(), self._lock:
            key = convert.requested_worker(worker, "worker")
            w = self._get(key)
            del self._workers[key]
            self._pending_events.pop(key, None)
            self._drop_grants(key)
            w.close()
        return w.generation

    # Attach ---------------------------------------------------------------

    def attach(self, worker: types_pb2.WorkerId) -> MemoryAttachStream:
        """A stream that starts with ``attached``, then the notifications no
        stream delivered yet, then live events. Errors come at once (a gRPC
        transport delivers the same ones on the stream)."""
        self._check_up()
        with _as_client_errors(), self._lock:
            key = convert.requested_worker(worker, "worker")
            w = self._get(key)
            stream = MemoryAttachStream(self, key)
            self._subscribers.setdefault(key, []).append(stream)
            stream.put(
                registry_pb2.AttachResponse(
                    attached=registry_pb2.AttachedEvent(
                        generation=w.generation, daemon_instance=self.instance
                    )
                )
            )
            for event in self._pending_events.pop(key, []):
                stream.put(event)
        return stream

    def _unsubscribe(self, key: CoreKey, stream: MemoryAttachStream, cancelled: bool) -> None:
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
                self._pending_events.pop(key, None)
                self._drop_grants(key)
                w.close()

    def _notify(self, key: CoreKey, event: registry_pb2.AttachResponse) -> None:
        """Deliver to the worker's streams, or keep until one attaches."""
        subs = self._subscribers.get(key)
        if not subs:
            self._pending_events.setdefault(key, []).append(event)
            return
        for s in subs:
            s.put(event)

    # Capabilities -------------------------------------------------------------

    def grant_transfer(
        self, req: registry_pb2.GrantTransferRequest
    ) -> registry_pb2.GrantTransferResponse:
        """Mint a capability for an attached worker's request, as kvmapd's
        GrantTransfer: every check before anything is kept."""
        self._check_up()
        with _as_client_errors(), self._lock:
            key = convert.requested_worker(req.worker, "worker")
            w = self._get(key)
            if not self._subscribers.get(key):
                raise core.FailedPrecondition(f"worker {key} has no Attach stream open")
            request_id = grants.check_request_id(req.request_id)
            ttl_ms = grants.check_ttl(req.ttl_ms)
            max_uses = grants.check_grant_uses(req.max_uses, req.open_uses)
            blocks = grants.granted_blocks(
                [(g.transfer_group, g.block_ids) for g in req.groups], grants.group_limits(w.model)
            )
            self._check_grant_room(key, sum(len(ids) for ids in blocks.values()))
            capability = secrets.token_urlsafe(32)
            grant = grants.Grant(
                digest=grants.digest(capability),
                worker=key,
                generation=w.generation,
                request_id=request_id,
                blocks=blocks,
                expires_unix_ms=_wall_ms() + ttl_ms,
                max_uses=max_uses,
            )
            self._grants[grant.digest] = grant
        return registry_pb2.GrantTransferResponse(
            capability=capability,
            generation=grant.generation,
            expires_unix_ms=grant.expires_unix_ms,
            open_uses=grant.open,
        )

    def _check_grant_room(self, key: CoreKey, blocks: int) -> None:
        cutoff = _wall_ms() - grants.EXPIRED_KEPT_MS
        for d in [d for d, g in self._grants.items() if g.expires_unix_ms <= cutoff]:
            del self._grants[d]
        if sum(g.worker == key for g in self._grants.values()) >= grants.MAX_GRANTS_PER_WORKER:
            raise core.ResourceExhausted(
                f"worker {key} has {grants.MAX_GRANTS_PER_WORKER} grants (the limit)"
            )
        if len(self._grants) >= grants.MAX_GRANTS:
            raise core.ResourceExhausted(
                f"{grants.MAX_GRANTS} grants outstanding in all (the limit)"
            )
        if sum(g.block_count for g in self._grants.values()) + blocks > grants.MAX_GRANTED_BLOCKS:
            raise core.ResourceExhausted(
                f"{grants.MAX_GRANTED_BLOCKS} granted block ids in all (the limit)"
            )

    def revoke_transfer(self, req: registry_pb2.RevokeTransferRequest) -> None:
        self._check_up()
        with _as_client_errors(), self._lock:
            key = convert.requested_worker(req.worker, "worker")
            self._get(key)
            for d in [
                d
                for d, g in self._grants.items()
                if g.worker == key and g.request_id == req.request_id
            ]:
                del self._grants[d]

    def _drop_grants(self, key: CoreKey) -> None:
        for d in [d for d, g in self._grants.items() if g.worker == key]:
            del self._grants[d]

    def _admit(self, req: _Request, remote: _Worker) -> grants.Grant:
        """The owner's checks of a transfer's capability (kvmapd's
        BeginTransfer), with the statuses the puller reports for them."""
        found = self._grants.get(grants.digest(req.capability))
        try:
            grant = grants.check_binding(
                found,
                worker=req.remote,
                generation=remote.generation,
                request_id=req.request_id,
                groups=[(p.transfer_group, p.remote_block_ids) for p in req.pairs],
            )
            if grant.exhausted:
                raise core.PermissionDenied(grants.DENIED)
        except core.PermissionDenied as err:
            raise core.PermissionDenied(
                f"remote daemon {req.target}: PERMISSION_DENIED: {err.message}"
            ) from None
        if grant.expired(_wall_ms()):
            # kvmapd's peer client takes any FAILED_PRECONDITION of the owner's
            # BeginTransfer for a stale generation (and re-handshakes once).
            raise core.StaleGeneration(
                str(convert.worker_id_to_proto(req.remote)), remote.generation, 0
            )
        return self._declared(req, grant)

    def _declared(self, req: _Request, grant: grants.Grant) -> grants.Grant:
        """``grant`` with the count ``req`` declares (kvmapd's claim), its
        refusal as the puller reports the owner's."""
        try:
            return grants.declare_readers(grant, req.readers)
        except core.FailedPrecondition as err:
            raise core.FailedPrecondition(
                f"remote daemon {req.target}: FAILED_PRECONDITION: {err.message}"
            ) from None

    def _consume(self, grant: grants.Grant) -> grants.Grant:
        """The transfer completed (or a reader released its use): one use of
        its capability is spent (``grant`` has it). Returns the grant after."""
        used = replace(grant, uses=grant.uses + 1)
        self._spend(used)
        return used

    def _spend(self, used: grants.Grant) -> None:
        if used.exhausted:
            self._grants.pop(used.digest, None)
        else:
            self._grants[used.digest] = used

    def _release(self, req: _Request) -> grants.Grant:
        """kvmapd's BeginTransfer with ``release``: a reader gives up its use."""
        remote = self._workers.get(req.remote)
        found = self._grants.get(grants.digest(req.capability))
        try:
            if remote is None:
                raise core.PermissionDenied(grants.DENIED)
            grant = grants.check_owner(
                found, worker=req.remote, generation=remote.generation, request_id=req.request_id
            )
        except core.PermissionDenied as err:
            raise core.PermissionDenied(
                f"remote daemon {req.target}: PERMISSION_DENIED: {err.message}"
            ) from None
        if grant.expired(_wall_ms()):
            raise core.FailedPrecondition(
                f"remote daemon {req.target}: FAILED_PRECONDITION: capability for request "
                f"{req.request_id} expired"
            )
        try:
            used = grants.release_use(grant, req.readers)
        except core.FailedPrecondition as err:
            raise core.FailedPrecondition(
                f"remote daemon {req.target}: FAILED_PRECONDITION: {err.message}"
            ) from None
        self._spend(used)
        return used

    # Region maps and stats ---------------------------------------------------

    def get_region_map(self, worker: types_pb2.WorkerId) -> types_pb2.RegionMap:
        self._check_up()
        with _as_client_errors(), self._lock:
            w = self._get(convert.requested_worker(worker, "worker"))
            return convert.region_map_to_proto(w.model)

    def get_stats(self) -> admin_pb2.GetStatsResponse:
        self._check_up()
        with self._lock:
            out = admin_pb2.GetStatsResponse(
                workers=len(self._workers),
                daemon_instance=self.instance,
                planner=convert.planner_info_to_proto(self._planner.info),
                remote_agents=len({target for target, _ in self._handshakes}),
                mapped_allocations=sum(len(w.memory) for w in self._workers.values()),
                mapped_bytes=sum(m.size for w in self._workers.values() for m in w.memory.values()),
                fd_handoff_pending=sum(len(b.fds) for b in self._pending_fds.values()),
            )
            out.transfers.CopyFrom(self.stats)
        return out

    # Transfers ----------------------------------------------------------------

    def transfer(
        self, spec: transfers_pb2.TransferSpec, write: bool
    ) -> Iterator[transfers_pb2.TransferStatus]:
        """Pull (``write`` False) or push, as kvmapd runs them: HANDSHAKING
        when the peer's map was (re)read, then DONE; the owner's worker is
        told its blocks were read or written. A request that fails changes
        no byte."""
        self._check_up()
        with _as_client_errors():
            req = _Request.parse(spec)
            with self._lock:
                self._get(req.local)
            if req.release:
                yield self._run_release(req)
                return
            try:
                yield from self._run(spec, req, write)
            except BaseException:
                with self._lock:
                    self.stats.failed += 1
                raise
            with self._lock:
                if write:
                    self.stats.pushes_done += 1
                else:
                    self.stats.pulls_done += 1

    def _run_release(self, req: _Request) -> transfers_pb2.TransferStatus:
        """A release (spec.release): no handshake, nothing moved; the owner's
        worker is told, as kvmapd tells it."""
        if self.pull_hook is not None:
            self.pull_hook(transfers_pb2.TransferSpec(request_id=req.request_id, release=True))
        peer = self.network.lookup(req.target)
        if peer is None:
            raise core.Unavailable(
                f"remote daemon {req.target}: UNAVAILABLE: no kvmapd at {req.target}"
            )
        with _locked(self, peer):
            used = peer._release(req)
            peer._notify(
                req.remote,
                _finished(req.request_id, self.agent_name, used, write=False, released=True),
            )
        return _status(transfers_pb2.TRANSFER_STATE_DONE, "released")

    def _handshake(self, req: _Request) -> tuple[MemoryDaemon, int, bool]:
        """The peer holding the remote worker, and whether its map was read
        anew (first time, or the peer's instance or generation changed)."""
        peer = self.network.lookup(req.target)
        if peer is None:
            raise core.Unavailable(
                f"remote daemon {req.target}: UNAVAILABLE: no kvmapd at {req.target}"
            )
        with _locked(self, peer):
            remote = peer._workers.get(req.remote)
            if remote is None:
                raise core.NotFound(
                    f"remote daemon {req.target}: NOT_FOUND: worker {req.remote} is not registered"
                )
            seen = (peer.instance, remote.generation)
            cached = self._handshakes.get((req.target, req.remote))
            self._handshakes[(req.target, req.remote)] = seen
        # kvmapd re-reads the map when asked for another generation than the
        # one it has, and when the owner refuses a stale one (changed map, or
        # a restarted daemon): both show here as a changed (instance, generation).
        fresh = cached is None or cached != seen or req.expected_generation not in (0, cached[1])
        return peer, remote.generation, fresh

    def _run(
        self, spec: transfers_pb2.TransferSpec, req: _Request, write: bool
    ) -> Iterator[transfers_pb2.TransferStatus]:
        if self.pull_hook is not None:
            self.pull_hook(spec)
        peer, generation, fresh = self._handshake(req)
        if fresh:
            yield _status(
                transfers_pb2.TRANSFER_STATE_HANDSHAKING,
                f"handshake with {req.target}",
                remote_generation=generation,
            )
        with _locked(self, peer):
            plan, generation, used = self._copy(peer, req, write)
            self.stats.bytes += plan.bytes
            self.stats.descriptors += plan.descriptors
            self.stats.blocks += plan.blocks
            peer.stats.served_done += 1
            peer.stats.served_blocks += plan.blocks
            peer._notify(req.remote, _finished(req.request_id, self.agent_name, used, write=write))
        yield _status(
            transfers_pb2.TRANSFER_STATE_DONE,
            "done",
            descriptors=plan.descriptors,
            bytes=plan.bytes,
            remote_generation=generation,
            handshaked=fresh,
        )

    def _copy(
        self, peer: MemoryDaemon, req: _Request, write: bool
    ) -> tuple[TransferPlan, int, grants.Grant]:
        """Plan with the core over both maps, then copy (holding both locks)."""
        local = self._get(req.local)
        remote = peer._workers.get(req.remote)
        if remote is None:
            raise core.NotFound(
                f"remote daemon {req.target}: NOT_FOUND: worker {req.remote} is not registered"
            )
        if req.expected_generation and req.expected_generation != remote.generation:
            raise core.StaleGeneration(str(req.remote), req.expected_generation, remote.generation)
        # As kvmapd: the two workers' KV caches must mean the same thing.
        check_compatible(local.model, remote.model)
        side = Side.REMOTE if write else Side.LOCAL
        table = None
        if req.tokens:
            plan = plan_token_transfer(local.model, remote.model, req.tokens, destination=side)
        else:
            table = build_piece_table(local.model, remote.model, req.selections)
            plan = plan_transfer(table, req.pairs, destination=side)
        grant = peer._admit(req, remote)
        for dst, src in _copies(table, plan, local, remote, write):
            dst[:] = src
        return plan, remote.generation, peer._consume(grant)


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
        return registry_pb2.RegisterWorkerResponse(
            region_map=self.daemon.register_worker(req), features=self.daemon.features
        )

    def deregister_worker(
        self, req: registry_pb2.DeregisterWorkerRequest, timeout: float
    ) -> registry_pb2.DeregisterWorkerResponse:
        return registry_pb2.DeregisterWorkerResponse(
            generation=self.daemon.deregister_worker(req.worker)
        )

    def attach(self, req: registry_pb2.AttachRequest) -> MemoryAttachStream:
        return self.daemon.attach(req.worker)

    def grant_transfer(
        self, req: registry_pb2.GrantTransferRequest, timeout: float
    ) -> registry_pb2.GrantTransferResponse:
        return self.daemon.grant_transfer(req)

    def revoke_transfer(
        self, req: registry_pb2.RevokeTransferRequest, timeout: float
    ) -> registry_pb2.RevokeTransferResponse:
        self.daemon.revoke_transfer(req)
        return registry_pb2.RevokeTransferResponse()

    def pull(
        self, spec: transfers_pb2.TransferSpec, timeout: float
    ) -> Iterator[transfers_pb2.PullResponse]:
        return (
            transfers_pb2.PullResponse(status=s) for s in self.daemon.transfer(spec, write=False)
        )

    def push(
        self, spec: transfers_pb2.TransferSpec, timeout: float
    ) -> Iterator[transfers_pb2.PushResponse]:
        return (
            transfers_pb2.PushResponse(status=s) for s in self.daemon.transfer(spec, write=True)
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
