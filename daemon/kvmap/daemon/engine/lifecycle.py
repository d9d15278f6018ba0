"""Workers across restarts and Attach streams: the stored workers a
restarted daemon brings back, the ones only their clients can hand over
again (expected back for a while, and if they return over the very same
memory their grants and undelivered events still hold), and registered
workers that must attach within their grace or be released."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import structlog

from kvmap.core.config import DaemonConfig
from kvmap.core.convert import check_requested
from kvmap.core.errors import KvmapError, NotFound, PermissionDenied, Unavailable
from kvmap.core.geometry import WorkerGeometry, WorkerKey
from kvmap.core.planner import Planner
from kvmap.core.validation import validate_geometry
from kvmap.core.worker_events import WorkerEvent
from kvmap.daemon.adapters.fd_handoff import PeerCred
from kvmap.daemon.adapters.state_store import StateStore, StateStoreError, StoredWorker
from kvmap.daemon.engine.events import EventOutbox
from kvmap.daemon.engine.grants import GrantTable
from kvmap.daemon.engine.registration import Registrar, handle_offset
from kvmap.daemon.engine.workers import WorkerRecord, WorkerTable

log = structlog.get_logger("kvmapd")

Spawn = Callable[[Coroutine[Any, Any, object]], None]


@dataclass(frozen=True)
class _Returning:
    """A stored worker the restarted daemon could not reopen, and the events
    it had not been sent."""

    stored: StoredWorker
    events: list[WorkerEvent]


class Lifecycle:
    """Restored, returning and unattached workers, each in its own set."""

    def __init__(
        self,
        *,
        config: DaemonConfig,
        table: WorkerTable,
        store: StateStore,
        grants: GrantTable,
        events: EventOutbox,
        registrar: Callable[[], Registrar],
        spawn: Spawn,
        update_gauges: Callable[[], None],
    ) -> None:
        self._config = config
        self._table = table
        self._store = store
        self._grants = grants
        self._events = events
        self._registrar = registrar
        self._spawn = spawn
        self._update_gauges = update_gauges
        # Workers known before a restart whose memory only their client can
        # hand over again, until when they are expected back.
        self._awaiting: dict[WorkerKey, float] = {}
        # What such a worker had (its stored row and undelivered events).
        self._returning: dict[WorkerKey, _Returning] = {}
        # Restored workers whose clients have not attached again yet (until
        # their grace ends): they may be granted meanwhile, since their
        # events wait in the store for the Attach.
        self._restored_unattached: set[WorkerKey] = set()
        # Registered workers not attached yet, each with a timer running.
        self._unattached: set[WorkerKey] = set()
        # The uid that registered each worker with a credential token: only
        # it may re-register, attach, grant, revoke or deregister the worker.
        self._owners: dict[WorkerKey, int] = {}

    def check_caller(self, key: WorkerKey, caller: PeerCred | None) -> None:
        """PERMISSION_DENIED unless ``caller`` may act as worker ``key``: the
        uid that registered it, or anyone for a worker registered without
        credentials. A restored worker is adopted by the first uid that
        attaches it with credentials (its client, re-attaching)."""
        owner = self._owners.get(key)
        if owner is None:
            if caller is not None and key in self._restored_unattached:
                self._owners[key] = caller.uid
            return
        if caller is None or caller.uid != owner:
            log.warning(
                "worker_caller_refused",
                worker=str(key),
                uid=None if caller is None else caller.uid,
                pid=None if caller is None else caller.pid,
            )
            raise PermissionDenied(
                f"worker {key} was registered by another uid: only that uid may attach,"
                " grant, revoke, deregister or replace it (send its kvmap-peer-token)"
            )

    def check_replacer(self, key: WorkerKey, caller: PeerCred | None) -> None:
        """A registration of ``key`` by ``caller``: a live worker is replaced
        only by the uid that registered it (``check_caller``), a new one by
        anyone."""
        if self._table.find(key) is not None:
            self.check_caller(key, caller)

    def may_grant_unattached(self, key: WorkerKey) -> bool:
        """A restored worker's client is re-attaching after the restart: a
        finished event waits in the store for its Attach."""
        return key in self._restored_unattached

    async def restore(self, planner: Planner) -> None:
        """Bring back every stored worker whose memory the daemon can open
        without it, re-planned with the planner it runs now."""
        for stored in self._store.workers():
            record = await self._registrar().restore(stored, planner)
            if record is None:
                self._await_client(stored)
                continue
            # Same memory, new plan: the worker's grants still mean its blocks.
            self._grants.rebind(record.key, record.generation)
            log.info(
                "worker_restored",
                worker=str(record.key),
                generation=record.generation,
                previous_generation=stored.generation,
                planner=planner.info.name,
                previous_planner=stored.planner,
            )
            self._restored_unattached.add(record.key)
            self._spawn(self._expect_restored_attach(record.key, record.generation))
        self._update_gauges()

    def _await_client(self, stored: StoredWorker) -> None:
        """Its client re-registers when it re-attaches; the stored geometry
        is dropped so nothing stale is ever served, and peers are told to
        retry meanwhile (UNAVAILABLE)."""
        self._returning[stored.worker] = _Returning(
            stored, [e for _, e in self._store.pending_events(stored.worker)]
        )
        self._store.delete_worker(stored.worker)
        self._awaiting[stored.worker] = time.monotonic() + self._config.restore_attach_grace_s

    async def _expect_attach(
        self, key: WorkerKey, generation: int, grace_s: float, what: str
    ) -> None:
        """A restored (or newly registered) worker whose client never
        attaches is gone."""
        await asyncio.sleep(grace_s)
        record = self._table.find(key)
        if record is not None and self._table.subscriber_count(key) == 0:
            log.warning(f"{what}_worker_never_attached", worker=str(key), generation=generation)
            await self.worker_gone(key)

    async def _expect_restored_attach(self, key: WorkerKey, generation: int) -> None:
        try:
            grace_s = self._config.restore_attach_grace_s
            await self._expect_attach(key, generation, grace_s, "restored")
        finally:
            self._restored_unattached.discard(key)

    async def _expect_first_attach(self, key: WorkerKey, generation: int) -> None:
        try:
            await self._expect_attach(key, generation, self._config.attach_grace_s, "registered")
        finally:
            self._unattached.discard(key)

    def worker_for_peer(self, key: WorkerKey) -> WorkerRecord:
        """A worker a peer asks for: NOT_FOUND if unknown, UNAVAILABLE while
        it is expected back after a daemon restart."""
        record = self._table.find(key)
        if record is not None:
            return record
        if self._awaiting.get(key, 0.0) > time.monotonic():
            raise Unavailable(f"worker {key} is re-registering after a kvmapd restart; retry")
        return self._table.get(key)

    async def register(
        self,
        geometry: WorkerGeometry,
        planner: Planner,
        caller: PeerCred | None = None,
    ) -> WorkerRecord:
        """Registry.RegisterWorker: register (or replace) the worker, then
        settle what it had before (``registered``). ``caller``: who calls
        (a live worker is replaced only by its own uid)."""
        key = check_requested(geometry.worker, "worker")
        self.check_replacer(key, caller)
        uid = None if caller is None else caller.uid
        record = await self._registrar().register(geometry, planner, caller_uid=uid)
        if uid is None:
            self._owners.pop(record.key, None)
        else:
            self._owners[record.key] = uid
        self.registered(record)
        return record

    def registered(self, record: WorkerRecord) -> None:
        """A worker registered (or re-registered): its grants hold only if
        it returned over the very memory it had."""
        returning = self._returning.pop(record.key, None)
        if returning is not None and self._same_memory(returning.stored, record.key):
            # Its blocks still hold what was granted, and its undelivered
            # events still apply.
            self._grants.rebind(record.key, record.generation)
            self._events.requeue(record.key, returning.events)
            log.info(
                "worker_returned",
                worker=str(record.key),
                generation=record.generation,
                events=len(returning.events),
            )
        else:
            # New (or replaced) memory: block ids granted before may now hold
            # other requests' KV.
            self._grants.drop_worker(record.key)
        self._restored_unattached.discard(record.key)
        self._awaiting.pop(record.key, None)
        if self._table.subscriber_count(record.key) == 0 and record.key not in self._unattached:
            # Released after attach_grace_s unless its worker attaches; one
            # timer per worker however often it registers meanwhile.
            self._unattached.add(record.key)
            self._spawn(self._expect_first_attach(record.key, record.generation))
        self._update_gauges()
        self._events.publish_map_changed(record)

    def _same_memory(self, before: StoredWorker, key: WorkerKey) -> bool:
        """Whether ``key``'s registration just stored is over the same memory
        objects (same identity: process, device and inode, path or CUDA
        handle), at the same offsets, with the same geometry as ``before``."""
        try:
            now = self._store.worker(key)
        except StateStoreError as err:
            # Unsure, so the safe answer: the grants go.
            log.error("worker_identity_unread", worker=str(key), error=str(err))
            return False
        if now is None or now.reopen != before.reopen:
            return False
        mine, had = now.geometry, before.geometry
        if mine is None or had is None:
            return False
        try:
            validate_geometry(mine)
            validate_geometry(had)
        except KvmapError:
            return False
        return mine == had and _handle_offsets(mine) == _handle_offsets(had)

    async def deregister(self, key: WorkerKey) -> WorkerRecord:
        """Registry.DeregisterWorker: the worker and its grants go."""
        record = await self._registrar().deregister(key)
        self._owners.pop(key, None)
        self._grants.drop_worker(key)
        self._update_gauges()
        return record

    async def worker_gone(self, key: WorkerKey) -> None:
        """The worker's Attach stream ended: release everything it had."""
        log.info("worker_gone", worker=str(key))
        try:
            # Released even when the store cannot record it: its client is gone.
            await self._registrar().deregister(key, forget_unsaved=True)
        except NotFound:
            return  # deregistered meanwhile
        self._owners.pop(key, None)
        self._grants.drop_worker(key)
        self._update_gauges()


def _handle_offsets(geometry: WorkerGeometry) -> list[tuple[str, int]]:
    """Where each allocation starts in its memory object (geometries
    compare equal whatever their handles)."""
    return [(alloc.id, handle_offset(alloc)) for alloc in geometry.allocations]
