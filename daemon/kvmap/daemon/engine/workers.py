"""The daemon's table of registered workers: what is mapped and registered
for each, its region map, its generation, and its Attach subscribers.

Mutations happen on the event loop under ``WorkerTable.lock``; releasing NIXL
registrations and mappings is the registration shell's job (``registration``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvmap.core.errors import NotFound
from kvmap.core.geometry import RegionMapModel, WorkerGeometry, WorkerKey
from kvmap.core.worker_events import WorkerEvent
from kvmap.daemon.adapters.nixl_port import DlistHandle, Registration

# (persisted event id or 0, event); (-1, None) is ``STREAM_END``.
QueuedEvent = tuple[int, WorkerEvent | None]
EventQueue = asyncio.Queue[QueuedEvent]

# Queued by ``WorkerTable.end_streams``: the stream that takes it ends.
STREAM_END: QueuedEvent = (-1, None)

# Events a slow Attach reader may have queued before the daemon drops the
# oldest: events are hints (the worker can always re-read state), never a
# reason to grow without bound.
MAX_QUEUED_EVENTS = 4096


@dataclass
class AttachedMemory:
    """A worker's mapped allocations and their NIXL registrations. Shared by
    the records of successive generations when only the plan changes (replan),
    released when the last of them is retired."""

    # Allocation id -> its mapping (``registration.Mapping``).
    mapped: dict[str, Any]
    registrations: list[Registration]
    refs: int = 0

    @property
    def size_bytes(self) -> int:
        return sum(int(m.size) for m in self.mapped.values())

    def base_addresses(self) -> dict[str, int]:
        return {alloc_id: int(m.address) for alloc_id, m in self.mapped.items()}


@dataclass
class WorkerRecord:
    """One registered worker at one generation."""

    geometry: WorkerGeometry
    model: RegionMapModel
    memory: AttachedMemory
    # Local prepped descriptor list: one entry per region per block.
    local_dlist: DlistHandle
    # Transfers in flight against this record (pins keep it from being torn
    # down under a posted NIXL transfer).
    pins: int = 0
    unpinned: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def key(self) -> WorkerKey:
        return self.geometry.worker

    @property
    def generation(self) -> int:
        return self.model.generation

    def pin(self) -> None:
        self.pins += 1
        self.unpinned.clear()

    def unpin(self) -> None:
        self.pins = max(0, self.pins - 1)
        if self.pins == 0:
            self.unpinned.set()


class WorkerTable:
    def __init__(self, on_generation: Callable[[], None] | None = None) -> None:
        self.lock = asyncio.Lock()
        # Told of each generation issued (the churn metric, kvmap_generations).
        self._on_generation = on_generation
        self._records: dict[WorkerKey, WorkerRecord] = {}
        # Last generation issued per worker. Kept after deregistration so a
        # re-registered worker never reuses a generation a peer has cached.
        self._generations: dict[WorkerKey, int] = {}
        self._subscribers: dict[WorkerKey, set[EventQueue]] = {}

    def __len__(self) -> int:
        return len(self._records)

    def records(self) -> list[WorkerRecord]:
        return [self._records[k] for k in sorted(self._records)]

    def find(self, key: WorkerKey) -> WorkerRecord | None:
        return self._records.get(key)

    def get(self, key: WorkerKey) -> WorkerRecord:
        record = self._records.get(key)
        if record is None:
            raise NotFound(f"worker {key} is not registered")
        return record

    def next_generation(self, key: WorkerKey) -> int:
        generation = self._generations.get(key, 0) + 1
        self._generations[key] = generation
        if self._on_generation is not None:
            self._on_generation()
        return generation

    def seed_generation(self, key: WorkerKey, generation: int) -> None:
        """Restore a generation counter (from the state store)."""
        self._generations[key] = max(self._generations.get(key, 0), generation)

    def put(self, record: WorkerRecord) -> WorkerRecord | None:
        """Install a record; returns the one it replaced (to be released)."""
        old = self._records.get(record.key)
        self._records[record.key] = record
        return old

    def pop(self, key: WorkerKey) -> WorkerRecord:
        record = self.get(key)
        del self._records[key]
        return record

    # Attach subscribers -------------------------------------------------

    def subscribe(self, key: WorkerKey) -> EventQueue:
        queue: EventQueue = asyncio.Queue(MAX_QUEUED_EVENTS)
        self._subscribers.setdefault(key, set()).add(queue)
        return queue

    def unsubscribe(self, key: WorkerKey, queue: EventQueue) -> int:
        """Remove a subscriber; returns how many remain for the worker."""
        subs = self._subscribers.get(key, set())
        subs.discard(queue)
        if not subs:
            self._subscribers.pop(key, None)
        return len(subs)

    def end_streams(self) -> None:
        """Tell every Attach stream to end (``STREAM_END``): the daemon is
        stopping, and an open stream would hold the server's shutdown for
        its whole grace period. Workers attach again to the next daemon."""
        for queues in self._subscribers.values():
            for queue in queues:
                _offer(queue, STREAM_END)

    def subscriber_count(self, key: WorkerKey) -> int:
        return len(self._subscribers.get(key, ()))

    def publish(self, key: WorkerKey, event: WorkerEvent, event_id: int = 0) -> None:
        """Queue an event for every Attach stream of the worker. ``event_id``
        names a persisted event, acknowledged once a stream has sent it."""
        for queue in self._subscribers.get(key, ()):
            _offer(queue, (event_id, event))


def _offer(queue: EventQueue, item: QueuedEvent) -> None:
    """Queue ``item``, dropping the oldest queued event when the reader is
    MAX_QUEUED_EVENTS behind (events are hints: never a reason to grow)."""
    if queue.full():
        queue.get_nowait()
    queue.put_nowait(item)
