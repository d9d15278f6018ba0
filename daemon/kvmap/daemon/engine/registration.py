"""Registering, re-planning and retiring workers: import each allocation
once, register it with NIXL once, plan regions, prepare the local descriptor
list, and swap the worker's record atomically with a new generation.

Every step that can fail happens before the table changes; a failure
releases what the attempt acquired and leaves the daemon as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable
from dataclasses import replace
from functools import partial
from typing import Any

import numpy as np
import structlog

from kvmap.core import convert
from kvmap.core.config import (
    DEFAULT_MAX_REGISTERED_BYTES,
    DEFAULT_MAX_WORKERS,
    MAX_REGION_MAP_BYTES,
)
from kvmap.core.errors import InvalidArgument, KvmapError, ResourceExhausted
from kvmap.core.geometry import (
    AllocationSpec,
    CudaIpcHandle,
    DeviceKind,
    Plan,
    RegionMapModel,
    ShmFdHandle,
    ShmPathHandle,
    WorkerGeometry,
    WorkerKey,
)
from kvmap.core.planner import Planner
from kvmap.core.validation import validate_geometry
from kvmap.daemon.adapters.cuda_ipc import CudaIpcImporter, CudaMapping, import_allocation
from kvmap.daemon.adapters.fd_handoff import FdHandoffServer
from kvmap.daemon.adapters.memory import MappedMemory, Owner, ShmImporter
from kvmap.daemon.adapters.nixl_port import MemoryType, NixlPort, Registration
from kvmap.daemon.adapters.nixl_thread import NixlRunner
from kvmap.daemon.adapters.state_store import (
    Reopen,
    StateStore,
    StateStoreError,
    StoredWorker,
)
from kvmap.daemon.engine.workers import AttachedMemory, WorkerRecord, WorkerTable

log = structlog.get_logger("kvmapd.registration")

# One allocation of a worker, mapped into the daemon.
Mapping = MappedMemory | CudaMapping


def region_rows(model: RegionMapModel) -> np.ndarray[Any, np.dtype[np.int64]]:
    """NIXL strided rows (address, len, device, stride, count), one per region:
    descriptor ``first_index[r] + b`` is block b of region r."""
    rows = np.zeros((len(model.regions), 5), dtype=np.int64)
    for i, region in enumerate(model.regions):
        alloc = model.allocation(region.allocation_id)
        rows[i] = (
            alloc.base_address + region.offset_bytes,
            region.block_len_bytes,
            alloc.device.index,
            region.block_stride_bytes,
            region.num_blocks,
        )
    return rows


class Registrar:
    def __init__(
        self,
        *,
        table: WorkerTable,
        agent: NixlPort,
        fds: FdHandoffServer,
        shm: ShmImporter,
        cuda: CudaIpcImporter,
        nixl: NixlRunner,
        retire_timeout_s: float,
        on_retire: Callable[[WorkerKey, int], Awaitable[None]],
        store: StateStore,
        max_workers: int = DEFAULT_MAX_WORKERS,
        max_registered_bytes: int = DEFAULT_MAX_REGISTERED_BYTES,
    ) -> None:
        self._table = table
        self._agent = agent
        self._fds = fds
        self._shm = shm
        self._cuda = cuda
        self._nixl = nixl
        self._retire_timeout_s = retire_timeout_s
        # Drops what the transfer engine prepared over the retired record.
        self._on_retire = on_retire
        self._store = store
        self._max_workers = max_workers
        self._max_registered_bytes = max_registered_bytes

    def _check_caps(self, geometry: WorkerGeometry, key: WorkerKey) -> None:
        """Refuse a registration over the daemon's caps before anything is
        mapped. A worker registering again replaces itself: its current
        record does not count."""
        others = [r for r in self._table.records() if r.key != key]
        if len(others) >= self._max_workers:
            raise ResourceExhausted(
                f"max_workers ({self._max_workers}) would be exceeded: "
                f"{len(others)} workers are registered"
            )
        used = sum(r.memory.size_bytes for r in others)
        wanted = sum(a.size_bytes for a in geometry.allocations)
        if used + wanted > self._max_registered_bytes:
            raise ResourceExhausted(
                f"max_registered_bytes ({self._max_registered_bytes}) would be exceeded: "
                f"{used} bytes are registered and this worker asks for {wanted}"
            )

    # Memory ---------------------------------------------------------------

    def _import(
        self,
        geometry: WorkerGeometry,
        preopened: dict[str, int],
        restored_from: dict[str, Reopen],
        caller_uid: int | None = None,
    ) -> tuple[dict[str, Mapping], dict[str, Reopen]]:
        """Map every allocation, noting how to re-open it after a restart; on
        any failure unmap what was mapped (and close the fds not used)."""
        mapped: dict[str, Mapping] = {}
        reopen: dict[str, Reopen] = {}
        try:
            for i, alloc in enumerate(geometry.allocations):
                mapped[alloc.id], reopen[alloc.id] = self._import_one(
                    alloc, f"allocations[{i}]", preopened, restored_from, caller_uid
                )
        except BaseException:
            for m in mapped.values():
                m.close()
            for fd in preopened.values():
                os.close(fd)
            raise
        return mapped, reopen

    def _import_one(
        self,
        alloc: AllocationSpec,
        field: str,
        preopened: dict[str, int],
        restored_from: dict[str, Reopen],
        caller_uid: int | None,
    ) -> tuple[Mapping, Reopen]:
        handle = alloc.handle
        if isinstance(handle, CudaIpcHandle):
            # The handle opens again while the worker lives.
            mapping = import_allocation(alloc, handle, field=field, importer=self._cuda)
            return mapping, Reopen(cuda_ipc=handle.handle)
        if alloc.device.kind is DeviceKind.CUDA:
            raise InvalidArgument(f"{field}.handle", "a CUDA allocation needs a cuda_ipc handle")
        if alloc.id in preopened:  # restored by the daemon itself
            fd = preopened.pop(alloc.id)
            offset = handle_offset(alloc)
            # A memfd was sealed when first registered (seals stay); a path's
            # file takes none, and it was checked against the prefixes then.
            reopen = restored_from[alloc.id]
            mapped = self._shm.import_fd(
                fd, offset, alloc.size_bytes, field=field, require_seal=not reopen.path
            )
            return mapped, reopen
        if isinstance(handle, ShmFdHandle):
            return self._import_shm_fd(alloc, handle, f"{field}.shm_fd")
        if isinstance(handle, ShmPathHandle):
            return self._import_shm_path(alloc, handle, f"{field}.shm_path", caller_uid)
        raise InvalidArgument(
            f"{field}.handle",
            "registration needs memory: set shm_fd, shm_path or cuda_ipc "
            "(a handle of 'none' is for PlanPreview and kvmapd plan only)",
        )

    def _import_shm_fd(
        self, alloc: AllocationSpec, handle: ShmFdHandle, field: str
    ) -> tuple[Mapping, Reopen]:
        fd = self._fds.claim(handle.token, handle.index, field)
        st = os.fstat(fd)
        # The worker holds the same object open: after a restart the daemon
        # finds it again in /proc/<pid>/fd by identity.
        reopen = Reopen(pid=self._fds.peer(handle.token).pid, dev=st.st_dev, ino=st.st_ino)
        return self._shm.import_fd(fd, handle.offset_bytes, alloc.size_bytes, field=field), reopen

    def _import_shm_path(
        self, alloc: AllocationSpec, handle: ShmPathHandle, field: str, caller_uid: int | None
    ) -> tuple[Mapping, Reopen]:
        """A file by path: only the caller's own, so a caller maps only what
        it could map itself (the daemon may open far more)."""
        mapping = self._shm.import_path(
            handle.path, handle.offset_bytes, alloc.size_bytes, field=field, owner=Owner(caller_uid)
        )
        st = os.stat(handle.path)
        return mapping, Reopen(path=handle.path, dev=st.st_dev, ino=st.st_ino)

    async def _attach(self, mapped: dict[str, Mapping]) -> AttachedMemory:
        regs: list[Registration] = []
        try:
            for m in mapped.values():
                dev_id, mem_type = nixl_target(m)
                regs.append(
                    await self._nixl(
                        partial(self._agent.register, m.address, m.size, dev_id, mem_type)
                    )
                )
        except BaseException:
            for reg in regs:
                await self._nixl(partial(self._agent.deregister, reg))
            for m in mapped.values():
                m.close()
            raise
        return AttachedMemory(mapped=mapped, registrations=regs)

    async def _release_memory(self, mem: AttachedMemory) -> None:
        for reg in mem.registrations:
            await self._nixl(partial(self._agent.deregister, reg))
        for m in mem.mapped.values():
            m.close()
        mem.registrations.clear()
        mem.mapped.clear()

    # Records --------------------------------------------------------------

    async def _make_record(
        self, geometry: WorkerGeometry, plan: Plan, mem: AttachedMemory
    ) -> WorkerRecord:
        generation = self._table.next_generation(geometry.worker)
        model = convert.model_from_plan(geometry, plan, generation, mem.base_addresses())
        # Like base addresses, device ordinals in a published map are this
        # daemon's (what NIXL registered), not the worker's.
        ordinals = {k: nixl_target(m)[0] for k, m in mem.mapped.items()}
        model = replace(
            model,
            allocations=tuple(
                replace(a, device=replace(a.device, index=ordinals.get(a.id, a.device.index)))
                for a in model.allocations
            ),
        )
        size = convert.region_map_bytes(model)
        if size > MAX_REGION_MAP_BYTES:
            raise InvalidArgument(
                "views",
                f"the region map would be {size} bytes, over the {MAX_REGION_MAP_BYTES}-byte "
                "limit of one message: register fewer views or shorter layer names",
            )
        rows = region_rows(model)
        dlist = await self._nixl(partial(self._agent.prep_local, rows))
        mem.refs += 1
        return WorkerRecord(geometry=geometry, model=model, memory=mem, local_dlist=dlist)

    async def retire(self, record: WorkerRecord) -> None:
        """Release a record once no transfer uses it (bounded wait)."""
        if record.pins:
            try:
                await asyncio.wait_for(record.unpinned.wait(), self._retire_timeout_s)
            except TimeoutError:
                log.warning("retire_with_pins", worker=str(record.key), pins=record.pins)
        await self._on_retire(record.key, record.generation)
        await self._nixl(partial(self._agent.release_dlist, record.local_dlist))
        record.memory.refs -= 1
        if record.memory.refs <= 0:
            await self._release_memory(record.memory)

    async def register(
        self,
        geometry: WorkerGeometry,
        planner: Planner,
        restored: dict[str, tuple[int, Reopen]] | None = None,
        *,
        caller_uid: int | None = None,
    ) -> WorkerRecord:
        """Register a worker (``geometry``, as read off the wire: validated
        here). ``restored`` maps allocation ids to fds the daemon opened
        itself (restore after a restart) and their Reopen; ``caller_uid`` is
        who registers (path registrations need it)."""
        preopened = {k: fd for k, (fd, _) in (restored or {}).items()}
        try:
            validate_geometry(geometry)
            plan = planner.plan(geometry)
        except BaseException:
            for fd in preopened.values():
                os.close(fd)
            raise
        async with self._table.lock:
            try:
                self._check_caps(geometry, geometry.worker)
            except BaseException:
                for fd in preopened.values():
                    os.close(fd)
                raise
            mapped, reopen = self._import(
                geometry, preopened, {k: r for k, (_, r) in (restored or {}).items()}, caller_uid
            )
            mem = await self._attach(mapped)
            record = await self._commit(geometry, plan, mem, reopen)
            old = self._table.put(record)
        for alloc in geometry.allocations:
            # The claimed fds were duplicated and are mapped now; the batch's
            # own copies can go rather than wait for the token to expire.
            if isinstance(alloc.handle, ShmFdHandle):
                self._fds.discard(alloc.handle.token)
        log.info(
            "worker_registered",
            worker=str(geometry.worker),
            generation=record.generation,
            regions=len(plan.regions),
            descriptors=plan.descriptor_count,
            baseline_descriptors=plan.baseline_descriptor_count,
        )
        if old is not None:
            await self.retire(old)
        return record

    async def _commit(
        self,
        geometry: WorkerGeometry,
        plan: Plan,
        mem: AttachedMemory,
        reopen: dict[str, Reopen],
    ) -> WorkerRecord:
        """Make the record and persist it before the table sees it: when
        either fails (a full or read-only store) everything the attempt made
        is released and the daemon is as it was."""
        try:
            record = await self._make_record(geometry, plan, mem)
        except BaseException:
            await self._release_memory(mem)
            raise
        try:
            self._store.save_worker(geometry, reopen, plan.planner.name, record.generation)
        except BaseException:
            await self._nixl(partial(self._agent.release_dlist, record.local_dlist))
            await self._release_memory(mem)
            raise
        return record

    async def deregister(self, key: WorkerKey, *, forget_unsaved: bool = False) -> WorkerRecord:
        """Forget a worker, in the store first: a store that cannot take the
        write leaves it registered (DeregisterWorker fails, changing nothing).
        With ``forget_unsaved`` (its client is gone, or the daemon stops) it
        is released even so; its stale row goes at the next start, when its
        memory cannot be re-opened or its client never attaches again."""
        async with self._table.lock:
            self._table.get(key)  # NOT_FOUND before any write
            try:
                self._store.delete_worker(key)
            except StateStoreError as err:
                if not forget_unsaved:
                    raise
                log.error("worker_forgotten_unsaved", worker=str(key), error=str(err))
            record = self._table.pop(key)
        await self.retire(record)
        log.info("worker_deregistered", worker=str(key), generation=record.generation)
        return record

    async def release_kept(self, key: WorkerKey) -> None:
        """The daemon stops (SIGTERM, an upgrade): release the worker here but
        keep its stored row, so that the next daemon on this state dir
        restores it, its grants and pending events, as after a ``kill -9``."""
        async with self._table.lock:
            record = self._table.pop(key)
        await self.retire(record)
        log.info("worker_released_kept", worker=str(key), generation=record.generation)

    async def replan(
        self, planner: Planner, on_swap: Callable[[WorkerRecord], None] = lambda _: None
    ) -> list[WorkerRecord]:
        """Re-plan every live worker over its existing registrations. Each
        new plan and generation is stored before it is published, so that a
        restart never hands out a generation again (for another plan); a
        worker whose row cannot be written keeps its plan (logged).
        ``on_swap`` is called with each new record as it replaces the old
        one, before anything awaits: what is bound to the generation (the
        worker's grants) moves with it, not after the old plan has retired
        (which waits for the transfers still reading it)."""
        done: list[WorkerRecord] = []
        replaced: list[WorkerRecord] = []
        async with self._table.lock:
            for old in self._table.records():
                record = await self._make_record(
                    old.geometry, planner.plan(old.geometry), old.memory
                )
                try:
                    self._store.update_plan(old.key, planner.info.name, record.generation)
                except StateStoreError as err:
                    log.error("replan_not_stored", worker=str(old.key), error=str(err))
                    await self._nixl(partial(self._agent.release_dlist, record.local_dlist))
                    record.memory.refs -= 1
                    continue
                self._table.put(record)
                on_swap(record)
                done.append(record)
                replaced.append(old)
        for old in replaced:
            await self.retire(old)
        return done

    async def restore(self, stored: StoredWorker, planner: Planner) -> WorkerRecord | None:
        """Register a worker from the state store with memory the daemon can
        open by itself; None when it cannot (its client re-registers)."""
        if stored.geometry is None:  # a row this kvmapd cannot read
            log.warning("restore_failed", worker=str(stored.worker), error=stored.problem)
            return None
        restored: dict[str, tuple[int, Reopen]] = {}
        for alloc in stored.geometry.allocations:
            if isinstance(alloc.handle, CudaIpcHandle):
                continue  # the stored handle itself opens again
            info = stored.reopen.get(alloc.id)
            fd = reopen_fd(info) if info is not None else None
            if fd is None or info is None:
                for opened, _ in restored.values():
                    os.close(opened)
                log.info("restore_deferred", worker=str(stored.worker), allocation=alloc.id)
                return None
            restored[alloc.id] = (fd, info)
        try:
            return await self.register(stored.geometry, planner, restored)
        except KvmapError as err:
            log.warning("restore_failed", worker=str(stored.worker), error=str(err))
            return None


def nixl_target(m: Mapping) -> tuple[int, MemoryType]:
    """(dev_id, memory type) to register a mapping under with NIXL."""
    if isinstance(m, CudaMapping):
        return m.dev_id, MemoryType.VRAM
    return 0, MemoryType.DRAM


def handle_offset(alloc: AllocationSpec) -> int:
    """Where the allocation starts in its shared-memory object."""
    if isinstance(alloc.handle, ShmFdHandle | ShmPathHandle):
        return alloc.handle.offset_bytes
    return 0


def reopen_fd(info: Reopen) -> int | None:
    """Open the same shared-memory object again, identified by (st_dev,
    st_ino): by its path, or through the worker's /proc/<pid>/fd entries
    (magic links: opening one opens the object the worker holds)."""
    candidates = [info.path] if info.path else []
    if info.pid:
        fd_dir = f"/proc/{info.pid}/fd"
        # The worker may be gone, or not ours to look at: then no candidates.
        with contextlib.suppress(OSError):
            candidates += [f"{fd_dir}/{name}" for name in os.listdir(fd_dir)]
    for path in candidates:
        try:
            st = os.stat(path)
            if (st.st_dev, st.st_ino) != (info.dev, info.ino):
                continue
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) == (info.dev, info.ino):
            return fd
        os.close(fd)
    return None
