"""What must outlive the daemon, in an embedded SQLite database in
``--state-dir``: registered workers (their registration request, which holds
the geometry) and how to re-open each allocation without the worker,
per-worker generation counters (monotonic across restarts), and pending
notifications for workers (transfer-finished events not yet delivered).

Every write is one transaction, in WAL mode with synchronous=FULL: a
``kill -9`` loses nothing that was acknowledged. Without a state dir the
store is an in-memory database, so the daemon has one code path.
"""

from __future__ import annotations

import json
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from kvmap.daemon.core.geometry import WorkerKey
from kvmap.v1 import registry_pb2

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
);
"""


def _key(worker: WorkerKey) -> str:
    return json.dumps([worker.engine_id, worker.dp_rank, worker.tp_rank, worker.pp_rank])


def _worker(key: str) -> WorkerKey:
    engine_id, dp, tp, pp = json.loads(key)
    return WorkerKey(str(engine_id), int(dp), int(tp), int(pp))


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
    request: registry_pb2.RegisterWorkerRequest
    reopen: dict[str, Reopen]
    planner: str
    generation: int


class StateStore:
    def __init__(self, state_dir: str) -> None:
        if state_dir:
            Path(state_dir).mkdir(parents=True, exist_ok=True, mode=0o700)
            self.path = os.path.join(state_dir, DB_NAME)
        else:
            self.path = ":memory:"
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        row = self._db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
        if row is None:
            self._db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
        elif int(row[0]) > SCHEMA_VERSION:
            raise RuntimeError(
                f"{self.path}: schema {row[0]} is newer than this kvmapd ({SCHEMA_VERSION})"
            )

    @property
    def persistent(self) -> bool:
        return self.path != ":memory:"

    def close(self) -> None:
        self._db.close()

    # Generations ----------------------------------------------------------

    def generations(self) -> dict[WorkerKey, int]:
        rows = self._db.execute("SELECT worker, generation FROM generations").fetchall()
        return {_worker(k): int(g) for k, g in rows}

    def save_generation(self, worker: WorkerKey, generation: int) -> None:
        self._db.execute(
            "INSERT INTO generations VALUES (?, ?) ON CONFLICT(worker) DO UPDATE "
            "SET generation = max(generation, excluded.generation)",
            (_key(worker), generation),
        )

    # Workers --------------------------------------------------------------

    def save_worker(
        self,
        req: registry_pb2.RegisterWorkerRequest,
        worker: WorkerKey,
        reopen: dict[str, Reopen],
        planner: str,
        generation: int,
    ) -> None:
        doc = json.dumps({k: v.to_json() for k, v in reopen.items()})
        with self._db:  # one transaction: the worker row and its generation
            self._db.execute("BEGIN")
            self._db.execute(
                "INSERT OR REPLACE INTO workers VALUES (?, ?, ?, ?, ?)",
                (_key(worker), req.SerializeToString(), doc, planner, generation),
            )
            self.save_generation(worker, generation)

    def update_plan(self, worker: WorkerKey, planner: str, generation: int) -> None:
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute(
                "UPDATE workers SET planner = ?, generation = ? WHERE worker = ?",
                (planner, generation, _key(worker)),
            )
            self.save_generation(worker, generation)

    def delete_worker(self, worker: WorkerKey) -> None:
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute("DELETE FROM workers WHERE worker = ?", (_key(worker),))
            self._db.execute("DELETE FROM pending_events WHERE worker = ?", (_key(worker),))

    def workers(self) -> list[StoredWorker]:
        out = []
        for key, blob, doc, planner, generation in self._db.execute(
            "SELECT worker, request, reopen, planner, generation FROM workers ORDER BY worker"
        ):
            req = registry_pb2.RegisterWorkerRequest.FromString(blob)
            reopen = {k: Reopen.from_json(v) for k, v in json.loads(doc).items()}
            out.append(StoredWorker(_worker(key), req, reopen, str(planner), int(generation)))
        return out

    # Pending events ---------------------------------------------------------

    def add_event(self, worker: WorkerKey, event: registry_pb2.AttachResponse) -> int:
        cur = self._db.execute(
            "INSERT INTO pending_events (worker, event) VALUES (?, ?)",
            (_key(worker), event.SerializeToString()),
        )
        return int(cur.lastrowid or 0)

    def pending_events(self, worker: WorkerKey) -> list[tuple[int, registry_pb2.AttachResponse]]:
        rows = self._db.execute(
            "SELECT id, event FROM pending_events WHERE worker = ? ORDER BY id", (_key(worker),)
        ).fetchall()
        return [(int(i), registry_pb2.AttachResponse.FromString(b)) for i, b in rows]

    def ack_event(self, event_id: int) -> None:
        self._db.execute("DELETE FROM pending_events WHERE id = ?", (event_id,))
