"""What must outlive the daemon, in an embedded SQLite database in
``--state-dir``: registered workers (their registration request, which holds
the geometry) and how to re-open each allocation without the worker,
per-worker generation counters (monotonic across restarts), and pending
notifications for workers (transfer-finished events not yet delivered).

Its interface speaks domain types (a ``WorkerGeometry`` with its handles, a
``core.worker_events`` event, a ``Grant``); the rows keep their wire forms
(a ``RegisterWorkerRequest``, an ``AttachResponse``, a
``GrantTransferRequest``), converted here by the core's converters, so a
store written by any kvmapd reads back in any other.

Every write is one transaction, in WAL mode: a ``kill -9`` loses nothing
that was acknowledged (a commit is in the WAL file before it returns). What
describes this machine's workers (their registrations, generations, the
daemon's agents) is also synced to the disk before it returns
(synchronous=FULL). What describes one request's life (a grant, its uses,
a transfer-finished event and its acknowledgement) is not
(synchronous=NORMAL; ``_unsynced``): it is about blocks of a worker's
memory on this machine, which a power loss or a kernel crash takes with it,
and a daemon's crash or restart, the failures the store is there for, loses
none of it either way. A synced grant cost the owner's event loop ~0.6 ms
of CPU and ~1.3 ms of waiting for the disk per request here, a synced use
~0.3 ms per pull (SQLite's WAL on the bench machine's disk).
Without a state dir the store is an in-memory database, so the daemon has
one code path.

Faults are mapped into the error tree by ``store_faults``, and only there
(this module's methods raise what it maps): a full disk (or
the process's file-size limit) is ``StoreFull`` (RESOURCE_EXHAUSTED), a
read-only, unwritable, locked or failing store is ``StoreUnavailable``
(UNAVAILABLE), each with one line naming the database. A failed write is
rolled back, so the store holds what it held before. On open, a store that
is not a database or fails its integrity check is moved aside (kept for
inspection as ``<name>.corrupt-<UTC time>``, with its WAL) and a new one is
made: workers re-register through their sessions, so nothing is lost.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Concatenate, ParamSpec, TypeVar

import numpy as np
import structlog

from kvmap.core import convert
from kvmap.core.errors import KvmapError
from kvmap.core.event_wire import event_from_proto, event_to_proto
from kvmap.core.geometry import WorkerGeometry, WorkerKey
from kvmap.core.grants import Access, BlockIds, Grant, UnreadRelease
from kvmap.core.worker_events import WorkerEvent
from kvmap.daemon.adapters.store_faults import (
    STORE_SUFFIXES,
    StateStoreError,
    StoreCorrupt,
    StoreFull,
    StoreUnavailable,
    store_error,
)
from kvmap.v1 import registry_pb2

# The fault types are part of this module's interface: callers catch them here.
__all__ = [
    "DB_NAME",
    "Reopen",
    "StateStore",
    "StateStoreError",
    "StoreCorrupt",
    "StoreFull",
    "StoreUnavailable",
    "StoredWorker",
    "store_error",
]

log = structlog.get_logger("kvmapd.state_store")

SCHEMA_VERSION = 1
DB_NAME = "kvmapd.sqlite3"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS generations (
    worker TEXT PRIMARY KEY,
    generation INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS workers (
    worker TEXT PRIMARY KEY,
    request BLOB NOT NULL,
    reopen TEXT NOT NULL,
    planner TEXT NOT NULL,
    generation INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS pending_events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    worker TEXT NOT NULL,
    event BLOB NOT NULL
);-- Per-request capabilities (engine.grants), by the SHA-256 digest of the
-- capability, never the capability itself; groups is a GrantTransferRequest
-- holding only its groups (BlockGrant messages) and its unread_release.
CREATE TABLE IF NOT EXISTS grants (
    digest BLOB PRIMARY KEY,
    worker TEXT NOT NULL,
    generation INTEGER NOT NULL,
    request_id TEXT NOT NULL,
    groups BLOB NOT NULL,
    expires_unix_ms INTEGER NOT NULL,
    max_uses INTEGER NOT NULL,
    uses INTEGER NOT NULL
);
"""


@functools.lru_cache(maxsize=4096)
def _key(worker: WorkerKey) -> str:
    # Cached: every grant use and event of a worker writes its key (a frozen
    # WorkerKey), and the JSON encoder costs more than the write in memory.
    return json.dumps([worker.engine_id, worker.dp_rank, worker.tp_rank, worker.pp_rank])


def _worker(key: str) -> WorkerKey:
    engine_id, dp, tp, pp = json.loads(key)
    return WorkerKey(str(engine_id), int(dp), int(tp), int(pp))


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _mapped(
    method: Callable[Concatenate[StateStore, _P], _R],
) -> Callable[Concatenate[StateStore, _P], _R]:
    """A store method whose SQLite faults come out as StateStoreErrors."""

    @functools.wraps(method)
    def run(self: StateStore, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return method(self, *args, **kwargs)
        except sqlite3.DatabaseError as err:
            mapped = store_error(self.path, err)
            if mapped is None:
                raise
            raise mapped from err

    return run


def _prepare_dir(state_dir: str) -> None:
    """Make the state directory, or say in one line why it cannot be used."""
    try:
        Path(state_dir).mkdir(parents=True, exist_ok=True, mode=0o700)
    except FileExistsError as err:
        raise StoreUnavailable(f"state directory {state_dir} is not a directory") from err
    except OSError as err:
        raise StoreUnavailable(
            f"state directory {state_dir} cannot be created: {err.strerror or err}"
        ) from err
    if not os.access(state_dir, os.W_OK | os.X_OK):
        raise StoreUnavailable(f"state directory {state_dir} is not writable")


@dataclass(frozen=True)
class Reopen:
    """How to open an allocation again without its worker's help."""

    path: str = ""  # a path the daemon can open (shm_path handles)
    pid: int = 0  # or: the worker process holding the object open ...
    dev: int = 0  # ... and the (st_dev, st_ino) that identify it there
    ino: int = 0
    cuda_ipc: bytes = b""

    def to_json(self) -> dict[str, object]:
        return {
            "path": self.path,
            "pid": self.pid,
            "dev": self.dev,
            "ino": self.ino,
            "cuda_ipc": self.cuda_ipc.hex(),
        }

    @classmethod
    def from_json(cls, d: dict[str, object]) -> Reopen:
        return cls(
            path=str(d.get("path", "")),
            pid=int(str(d.get("pid", 0))),
            dev=int(str(d.get("dev", 0))),
            ino=int(str(d.get("ino", 0))),
            cuda_ipc=bytes.fromhex(str(d.get("cuda_ipc", ""))),
        )


@dataclass(frozen=True)
class StoredWorker:
    worker: WorkerKey
    # The registration as it was stored, handles included (not validated
    # again); None when this kvmapd cannot read it (``problem`` says why).
    geometry: WorkerGeometry | None
    reopen: dict[str, Reopen]
    planner: str
    generation: int
    problem: str = ""


class StateStore:
    def __init__(self, state_dir: str) -> None:
        if state_dir:
            _prepare_dir(state_dir)
            self.path = os.path.join(state_dir, DB_NAME)
        else:
            self.path = ":memory:"
        try:
            self._db = self._open()
        except StoreCorrupt as err:
            if not self.persistent:
                raise
            aside = self._move_aside()
            log.error(
                "state_store_corrupt",
                path=self.path,
                moved_to=aside,
                error=str(err),
                action="moved aside; starting with an empty store (workers re-register)",
            )
            self._db = self._open()

    @_mapped
    def _open(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            self._prepare(db)
        except BaseException:
            db.close()
            raise
        return db

    def _prepare(self, db: sqlite3.Connection) -> None:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        # Damage in pages no start-up query reads would otherwise surface in
        # the middle of some later RPC.
        problems = [str(row[0]) for row in db.execute("PRAGMA quick_check").fetchall()]
        if problems != ["ok"]:
            raise StoreCorrupt(f"state store {self.path} is corrupt: {problems[0][:200]}")
        db.executescript(_SCHEMA)
        row = db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
        if row is None:
            db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
        elif int(row[0]) > SCHEMA_VERSION:
            raise StoreUnavailable(
                f"state store {self.path}: schema {row[0]} is newer than this kvmapd "
                f"({SCHEMA_VERSION})"
            )
        # A write at every start: a store that cannot take one fails the
        # start, with its reason, rather than the first RPC that writes.
        db.execute(
            "INSERT OR REPLACE INTO meta VALUES ('opened', ?)", (datetime.now(UTC).isoformat(),)
        )

    def _move_aside(self) -> str:
        """Keep a damaged database (and its WAL) for inspection, out of the way."""
        aside = f"{self.path}.corrupt-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S.%fZ')}"
        try:
            for suffix in STORE_SUFFIXES:
                if os.path.lexists(self.path + suffix):
                    os.replace(self.path + suffix, aside + suffix)
        except OSError as err:
            raise StoreUnavailable(
                f"state store {self.path} is corrupt and cannot be moved aside: "
                f"{err.strerror or err}"
            ) from err
        return aside

    @property
    def persistent(self) -> bool:
        return self.path != ":memory:"

    def close(self) -> None:
        self._db.close()

    @contextlib.contextmanager
    def _unsynced(self) -> Iterator[None]:
        """The writes inside commit without syncing the disk (see the
        module's docstring for which writes and why); every other write
        still syncs."""
        self._db.execute("PRAGMA synchronous=NORMAL")
        try:
            yield
        finally:
            self._db.execute("PRAGMA synchronous=FULL")

    # This daemon's NIXL agents -------------------------------------------

    @_mapped
    def record_agent(self, agent: str, keep: int) -> list[str]:
        """Store ``agent`` as the daemon's newest and return the ``keep``
        before it, newest first (a restarted puller names them to owners
        whose grants a dead one still claims)."""
        row = self._db.execute("SELECT value FROM meta WHERE key='agents'").fetchone()
        try:
            stored = json.loads(row[0]) if row is not None else []
        except ValueError:
            stored = []
        if not isinstance(stored, list):
            stored = []
        before = [a for a in stored if isinstance(a, str) and a and a != agent][:keep]
        self._db.execute(
            "INSERT OR REPLACE INTO meta VALUES ('agents', ?)", (json.dumps([agent, *before]),)
        )
        return before

    # Generations ----------------------------------------------------------

    @_mapped
    def generations(self) -> dict[WorkerKey, int]:
        rows = self._db.execute("SELECT worker, generation FROM generations").fetchall()
        return {_worker(k): int(g) for k, g in rows}

    @_mapped
    def save_generation(self, worker: WorkerKey, generation: int) -> None:
        self._db.execute(
            "INSERT INTO generations VALUES (?, ?) ON CONFLICT(worker) DO UPDATE "
            "SET generation = max(generation, excluded.generation)",
            (_key(worker), generation),
        )

    # Workers --------------------------------------------------------------

    @_mapped
    def save_worker(
        self,
        geometry: WorkerGeometry,
        reopen: dict[str, Reopen],
        planner: str,
        generation: int,
    ) -> None:
        worker = geometry.worker
        blob = convert.geometry_to_proto(geometry).SerializeToString()
        doc = json.dumps({k: v.to_json() for k, v in reopen.items()})
        with self._db:  # one transaction: the worker row and its generation
            self._db.execute("BEGIN")
            self._db.execute(
                "INSERT OR REPLACE INTO workers VALUES (?, ?, ?, ?, ?)",
                (_key(worker), blob, doc, planner, generation),
            )
            self.save_generation(worker, generation)

    @_mapped
    def update_plan(self, worker: WorkerKey, planner: str, generation: int) -> None:
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute(
                "UPDATE workers SET planner = ?, generation = ? WHERE worker = ?",
                (planner, generation, _key(worker)),
            )
            self.save_generation(worker, generation)

    @_mapped
    def delete_worker(self, worker: WorkerKey) -> None:
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute("DELETE FROM workers WHERE worker = ?", (_key(worker),))
            self._db.execute("DELETE FROM pending_events WHERE worker = ?", (_key(worker),))

    @_mapped
    def workers(self) -> list[StoredWorker]:
        return [
            _stored(*row)
            for row in self._db.execute(
                "SELECT worker, request, reopen, planner, generation FROM workers ORDER BY worker"
            )
        ]

    @_mapped
    def worker(self, worker: WorkerKey) -> StoredWorker | None:
        """One stored worker, or None."""
        row = self._db.execute(
            "SELECT worker, request, reopen, planner, generation FROM workers WHERE worker = ?",
            (_key(worker),),
        ).fetchone()
        return None if row is None else _stored(*row)

    # Pending events ---------------------------------------------------------

    @_mapped
    def add_event(self, worker: WorkerKey, event: WorkerEvent) -> int:
        with self._unsynced():
            cur = self._db.execute(
                "INSERT INTO pending_events (worker, event) VALUES (?, ?)",
                (_key(worker), event_to_proto(event).SerializeToString()),
            )
        return int(cur.lastrowid or 0)

    @_mapped
    def record_use(self, grant: Grant | None, worker: WorkerKey, event: WorkerEvent) -> int:
        """A completed transfer in one transaction (never one of them
        without the other): its grant's use (``grant`` as it is after: kept
        with its count, or deleted once used up; None when the grant is
        gone) and the worker's event. Returns the event's id. A failure
        stores nothing."""
        with self._unsynced(), self._db:
            self._db.execute("BEGIN")
            if grant is not None and grant.exhausted:
                self._delete_grants([grant.digest])
            elif grant is not None:
                self._update_grant(grant)
            cur = self._db.execute(
                "INSERT INTO pending_events (worker, event) VALUES (?, ?)",
                (_key(worker), event_to_proto(event).SerializeToString()),
            )
        return int(cur.lastrowid or 0)

    @_mapped
    def pending_events(self, worker: WorkerKey) -> list[tuple[int, WorkerEvent]]:
        """The worker's undelivered events, oldest first; one this kvmapd
        cannot tell (a newer one's kind) is left out."""
        rows = self._db.execute(
            "SELECT id, event FROM pending_events WHERE worker = ? ORDER BY id", (_key(worker),)
        ).fetchall()
        events = [
            (int(i), event_from_proto(registry_pb2.AttachResponse.FromString(b))) for i, b in rows
        ]
        return [(i, e) for i, e in events if e is not None]

    def ack_event(self, event_id: int) -> None:
        """Forget a delivered event. Delivery is at least once, so an ack the
        store cannot take only means the event is sent again after a restart:
        logged, not raised (an Attach stream must not end over it).

        Like the event it acknowledges, it is written without syncing the
        disk (``_unsynced``)."""
        try:
            self._delete_event(event_id)
        except StateStoreError as err:
            log.warning("event_ack_not_stored", event_id=event_id, error=str(err))

    @_mapped
    def _delete_event(self, event_id: int) -> None:
        with self._unsynced():
            self._db.execute("DELETE FROM pending_events WHERE id = ?", (event_id,))

    # Grants -------------------------------------------------------------------

    @_mapped
    def save_grant(self, grant: Grant, named: Sequence[tuple[int, BlockIds]] = ()) -> None:
        """Store a new grant. ``named``, when given, is its blocks as the
        worker named them (the same ids, in the request's order, which
        reading a grant back does not depend on: its ids are sorted then):
        the request's own repeated fields go into the blob in one copy each,
        where the grant's arrays would be handed over id by id."""
        groups = registry_pb2.GrantTransferRequest(
            # In the blob, not a column: a store written before the field
            # reads as UNSPECIFIED (the layout decides, as it did then).
            unread_release=registry_pb2.UnreadRelease.ValueType(grant.unread_release),
            # A store written before the field reads as READ: what every
            # grant was then.
            access=registry_pb2.GrantAccess.ValueType(grant.access),
        )
        for g, ids in named or grant.blocks.items():
            # Added in place: a BlockGrant made first would be copied in again.
            listed = ids.tolist() if isinstance(ids, np.ndarray) else ids
            groups.groups.add(transfer_group=g, block_ids=listed)
        with self._unsynced():
            self._insert_grant(grant, groups.SerializeToString())

    def _insert_grant(self, grant: Grant, blob: bytes) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO grants VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                grant.digest,
                _key(grant.worker),
                grant.generation,
                grant.request_id,
                blob,
                grant.expires_unix_ms,
                grant.max_uses,
                grant.uses,
            ),
        )

    @_mapped
    def update_grant(self, grant: Grant) -> None:
        """What changes over a grant's life: its uses, its generation and
        (once, when its first claim fixes an open grant's) its use count."""
        with self._unsynced():
            self._update_grant(grant)

    def _update_grant(self, grant: Grant) -> None:
        self._db.execute(
            "UPDATE grants SET generation = ?, uses = ?, max_uses = ? WHERE digest = ?",
            (grant.generation, grant.uses, grant.max_uses, grant.digest),
        )

    @_mapped
    def delete_grants(self, digests: Sequence[bytes]) -> None:
        with self._unsynced(), self._db:
            self._db.execute("BEGIN")
            self._delete_grants(digests)

    def _delete_grants(self, digests: Sequence[bytes]) -> None:
        self._db.executemany("DELETE FROM grants WHERE digest = ?", [(d,) for d in digests])

    @_mapped
    def grants(self) -> list[Grant]:
        out = []
        for digest, key, generation, request_id, blob, expires, max_uses, uses in self._db.execute(
            "SELECT digest, worker, generation, request_id, groups, expires_unix_ms, max_uses, "
            "uses FROM grants"
        ):
            stored = registry_pb2.GrantTransferRequest.FromString(blob)
            groups = stored.groups
            out.append(
                Grant(
                    digest=bytes(digest),
                    worker=_worker(key),
                    generation=int(generation),
                    request_id=str(request_id),
                    blocks={
                        g.transfer_group: np.sort(np.asarray(g.block_ids, dtype=np.int64))
                        for g in groups
                    },
                    expires_unix_ms=int(expires),
                    max_uses=int(max_uses),
                    uses=int(uses),
                    unread_release=_unread_release(stored.unread_release),
                    access=_access(stored.access),
                )
            )
        return out


def _unread_release(value: int) -> UnreadRelease:
    """A stored choice; one this kvmapd does not know (written by a newer
    one) reads as REFUSED: refusing an unread release is always safe."""
    try:
        return UnreadRelease(value)
    except ValueError:
        return UnreadRelease.REFUSED


def _access(value: int) -> Access:
    """A stored access; UNSPECIFIED (a store of a kvmapd before the field)
    reads as READ, and one this kvmapd does not know as WRITE: a write grant
    admits no read, so an unknown direction never reads a worker's KV."""
    if value == 0:
        return Access.READ
    try:
        return Access(value)
    except ValueError:
        return Access.WRITE


def _stored(key: str, blob: bytes, doc: str, planner: str, generation: int) -> StoredWorker:
    """A ``workers`` row as the worker it stores."""
    req = registry_pb2.RegisterWorkerRequest.FromString(blob)
    reopen = {k: Reopen.from_json(v) for k, v in json.loads(doc).items()}
    try:
        geometry: WorkerGeometry | None = convert.geometry_from_proto(req)
        problem = ""
    except KvmapError as err:
        geometry, problem = None, str(err)
    return StoredWorker(_worker(key), geometry, reopen, str(planner), int(generation), problem)
