"""The workers' event outbox: every event for a worker (a transfer finished,
a use released, its map changed) is persisted before it is published to
the worker's Attach streams, so a restart between the two loses nothing.
The Attach stream (``api.services``) replays what is stored, then live
events, and acknowledges each it sent."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import structlog

from kvmap.core.geometry import WorkerKey
from kvmap.core.grants import Grant
from kvmap.core.worker_events import RegionMapChanged, TransferFinished, WorkerEvent
from kvmap.daemon.adapters.state_store import StateStore, StateStoreError
from kvmap.daemon.engine.grants import GrantTable
from kvmap.daemon.engine.workers import WorkerRecord, WorkerTable

log = structlog.get_logger("kvmapd")


class EventOutbox:
    """Persists and publishes the workers' events."""

    def __init__(self, table: WorkerTable, store: StateStore, grants: GrantTable) -> None:
        self._table = table
        self._store = store
        self._grants = grants

    def tell_finished(
        self,
        key: WorkerKey,
        done: TransferFinished,
        used: Grant | None,
        store_use: bool = False,
    ) -> None:
        """Send the worker a finished transfer (or released use), with its
        grant's count, so its blocks are freed once no use is left. Persisted
        until an Attach stream has sent it: a restart between the
        notification and the worker loses nothing. With ``store_use`` the
        grant's use (``used``, which ``GrantTable.complete`` left unstored)
        is stored with the event."""
        event = done
        if used is not None:
            event = replace(done, uses=used.uses, max_uses=used.max_uses, exhausted=used.exhausted)
        if store_use:
            event_id = self._persist_use_and_event(key, event, used)
        else:
            event_id = self.persist(key, event)
        self._table.publish(key, event, event_id)

    def _persist_use_and_event(
        self, key: WorkerKey, event: TransferFinished, used: Grant | None
    ) -> int:
        """A completed transfer's grant use and its event, in one transaction
        (one sync of the store per completion, not two). A store that cannot
        take it gets each written on its own, as before: whatever it can
        keep is kept, and each refusal is logged as it always was."""
        try:
            return self._store.record_use(used, key, event)
        except StateStoreError:
            if used is not None:
                self._grants.persist_use(used)
            return self.persist(key, event)

    def persist(self, key: WorkerKey, event: WorkerEvent) -> int:
        """The event's id in the store; 0 (sent live only) when the store
        cannot take it: the progress loop must go on whatever the disk does."""
        try:
            return self._store.add_event(key, event)
        except StateStoreError as err:
            log.error("event_not_stored", worker=str(key), error=str(err))
            return 0

    def requeue(self, key: WorkerKey, events: Sequence[WorkerEvent]) -> None:
        """Store again the events a returning worker had not been sent (its
        Attach sends them); one the store cannot take is logged and lost, as
        a live event would be."""
        for event in events:
            self.persist(key, event)

    def publish_map_changed(self, record: WorkerRecord) -> None:
        changed = RegionMapChanged(generation=record.generation, planner=record.model.planner)
        self._table.publish(record.key, changed)
