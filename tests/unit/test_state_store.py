"""The state store's faults, each made real in SQLite: a full database
(``max_page_count``), a read-only connection (``query_only``), a file that is
not a database, a damaged page, a state dir that cannot be made. The adapter
is the one place that maps them: RESOURCE_EXHAUSTED / UNAVAILABLE with one
line naming the database, the store unchanged, and a damaged store moved
aside on open."""

from __future__ import annotations

import os
import sqlite3
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from structlog.testing import capture_logs

from kvmap.core.errors import ErrorCode, status_of
from kvmap.core.geometry import (
    AllocationSpec,
    CudaIpcHandle,
    DeviceKind,
    DeviceRef,
    ShmFdHandle,
    ShmPathHandle,
    WorkerGeometry,
    WorkerKey,
)
from kvmap.core.grants import Grant
from kvmap.core.worker_events import TransferDirection, TransferFinished
from kvmap.daemon.adapters.state_store import (
    DB_NAME,
    StateStore,
    StateStoreError,
    StoreFull,
    StoreUnavailable,
    store_error,
)
from kvmap.v1 import registry_pb2

W1 = WorkerKey("one", 0, 0, 0)
W2 = WorkerKey("two", 0, 0, 0)


# A worker's event, as the owner's side stores one.
EVENT = TransferFinished("r", TransferDirection.PULLED_FROM, "peer")


def _geometry(engine: str, padding: int = 0) -> WorkerGeometry:
    # The layout string only makes the stored blob as big as a test needs.
    return WorkerGeometry(WorkerKey(engine), "x" * padding or "BLHNC", 16, allocations=(), views=())


def _saved(path: Path) -> StateStore:
    store = StateStore(str(path))
    store.save_worker(_geometry("one"), {}, "coalesce", 1)
    return store


def _contents(store: StateStore) -> tuple[object, ...]:
    return (
        [(s.worker, s.generation, s.planner) for s in store.workers()],
        store.generations(),
        store.pending_events(W1),
    )


def _fill(store: StateStore) -> None:
    """Cap the database at the pages it has: the next page it needs is a
    real SQLITE_FULL."""
    pages = store._db.execute("PRAGMA page_count").fetchone()[0]
    store._db.execute(f"PRAGMA max_page_count={pages}")


def test_a_full_store_is_resource_exhausted_and_keeps_what_it_had(tmp_path: Path) -> None:
    """SQLITE_FULL during a write: StoreFull (RESOURCE_EXHAUSTED) with one line naming the
    database, and the rolled-back transaction left the store as it was; a write that fits still
    works afterwards."""
    store = _saved(tmp_path)
    before = _contents(store)
    _fill(store)
    with pytest.raises(StoreFull) as caught:
        store.save_worker(_geometry("two", padding=200_000), {}, "coalesce", 1)
    code, message = status_of(caught.value)
    assert code is ErrorCode.RESOURCE_EXHAUSTED
    assert message == f"state store {tmp_path / DB_NAME} is full: database or disk is full"
    assert "\n" not in message
    assert _contents(store) == before
    store.save_generation(W1, 2)  # fits in the pages it has
    assert store.generations()[W1] == 2
    store.close()


def test_a_read_only_store_is_unavailable_and_keeps_what_it_had(tmp_path: Path) -> None:
    """SQLITE_READONLY on every kind of write (worker, generation, delete, event): StoreUnavailable
    (UNAVAILABLE) saying the store is read-only, and nothing changed."""
    store = _saved(tmp_path)
    before = _contents(store)
    store._db.execute("PRAGMA query_only=1")
    writes = [
        lambda: store.save_worker(_geometry("two"), {}, "coalesce", 1),
        lambda: store.save_generation(W1, 9),
        lambda: store.delete_worker(W1),
        lambda: store.add_event(W1, EVENT),
    ]
    for write in writes:
        with pytest.raises(StoreUnavailable) as caught:
            write()
        code, message = status_of(caught.value)
        assert code is ErrorCode.UNAVAILABLE
        assert message == (
            f"state store {tmp_path / DB_NAME} is read-only: attempt to write a readonly database"
        )
    assert _contents(store) == before
    store.close()


def test_an_ack_the_store_cannot_take_is_logged_and_the_event_stays(tmp_path: Path) -> None:
    """Delivery is at least once: an ack on a read-only store does not raise (an Attach stream
    must not end over it), is logged, and the event stays pending for the next stream."""
    store = _saved(tmp_path)
    event_id = store.add_event(W1, EVENT)
    store._db.execute("PRAGMA query_only=1")
    with capture_logs() as logs:
        store.ack_event(event_id)
    assert [e["event"] for e in logs] == ["event_ack_not_stored"]
    assert [i for i, _ in store.pending_events(W1)] == [event_id]
    store.close()


def test_a_request_s_writes_skip_the_disk_sync_a_worker_s_writes_keep_it(tmp_path: Path) -> None:
    """What one request's life writes (its grant, the grant's changes, a
    use with its event, an event, an ack) commits with
    ``synchronous=NORMAL``, the whole transaction inside; what describes
    the machine's workers (a registration, a generation, a re-plan, a
    removal, the daemon's agents) keeps FULL; FULL is in force after
    either, and after a write the store refused."""
    store = _saved(tmp_path)
    seen: list[str] = []
    store._db.set_trace_callback(seen.append)

    def level() -> int:
        return int(store._db.execute("PRAGMA synchronous").fetchone()[0])

    grant = Grant(
        digest=b"g" * 32, worker=W1, generation=1, request_id="r",
        blocks={0: np.array([3, 5], dtype=np.int64)}, expires_unix_ms=2**62, max_uses=2,
    )  # fmt: skip
    used = replace(grant, uses=1)
    first = store.add_event(W1, EVENT)
    unsynced = {
        "save_grant": lambda: store.save_grant(grant),
        "update_grant": lambda: store.update_grant(used),
        "record_use": lambda: store.record_use(used, W1, EVENT),
        "add_event": lambda: store.add_event(W1, EVENT),
        "ack_event": lambda: store.ack_event(first),
        "delete_grants": lambda: store.delete_grants([grant.digest]),
    }
    for name, write in unsynced.items():
        seen.clear()
        write()
        assert seen[0] == "PRAGMA synchronous=NORMAL", name
        assert seen[-1] == "PRAGMA synchronous=FULL", name
        assert not any("synchronous" in s for s in seen[1:-1]), name
        assert any(s.startswith(("INSERT", "UPDATE", "DELETE")) for s in seen), name
        assert level() == 2, name
    synced = {
        "save_worker": lambda: store.save_worker(_geometry("two"), {}, "coalesce", 1),
        "save_generation": lambda: store.save_generation(W2, 3),
        "update_plan": lambda: store.update_plan(W2, "baseline", 4),
        "delete_worker": lambda: store.delete_worker(W2),
        "record_agent": lambda: store.record_agent("agent-2", 4),
    }
    for name, write in synced.items():
        seen.clear()
        write()
        assert not any("synchronous" in s for s in seen), name
        assert level() == 2, name
    store._db.execute("PRAGMA query_only=1")
    store.ack_event(first + 1)  # refused: logged, as before
    with pytest.raises(StateStoreError):
        store.save_grant(grant)
    assert level() == 2
    store.close()
    # All of it is in the WAL file: a store opened again (as after a kill -9) has it.
    again = StateStore(str(tmp_path))
    assert [g.request_id for g in again.grants()] == []  # deleted last
    assert [w.worker for w in again.workers()] == [W1]
    assert again.generations()[W2] == 4
    again.close()


def test_bugs_are_not_mapped_to_faults(tmp_path: Path) -> None:
    """A constraint violation is a bug, not a fault of the disk: store_error leaves it alone (it
    reports INTERNAL as any bug does)."""
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE t (x INTEGER PRIMARY KEY)")
    db.execute("INSERT INTO t VALUES (1)")
    with pytest.raises(sqlite3.IntegrityError) as caught:
        db.execute("INSERT INTO t VALUES (1)")
    assert store_error("p", caught.value) is None


def test_a_file_that_is_not_a_database_is_moved_aside(tmp_path: Path) -> None:
    """Garbage where the database should be: on open it is renamed to
    <name>.corrupt-<UTC time> with its bytes intact, one error log line names both paths, and the
    store starts empty and writable."""
    garbage = os.urandom(3 * 4096)
    (tmp_path / DB_NAME).write_bytes(garbage)
    with capture_logs() as logs:
        store = StateStore(str(tmp_path))
    (aside,) = tmp_path.glob(f"{DB_NAME}.corrupt-*")
    assert aside.name.endswith("Z") and aside.read_bytes() == garbage
    (line,) = [e for e in logs if e["event"] == "state_store_corrupt"]
    assert line["log_level"] == "error"
    assert (line["path"], line["moved_to"]) == (str(tmp_path / DB_NAME), str(aside))
    assert "file is not a database" in line["error"]
    assert _contents(store) == ([], {}, [])
    store.save_worker(_geometry("one"), {}, "coalesce", 1)
    assert store.generations() == {W1: 1}
    store.close()


def test_a_damaged_page_is_found_on_open_and_moved_aside(tmp_path: Path) -> None:
    """A valid header over a damaged table page (a malformed image, which no start-up query
    needs to read): the integrity check on open finds it and the store is moved aside, its WAL
    with it, rather than failing some later RPC."""
    store = _saved(tmp_path)
    for i in range(50):
        store.save_worker(_geometry(f"w{i}", padding=3000), {}, "c", 1)
    store.close()  # the last connection checkpoints the WAL into the database
    db = tmp_path / DB_NAME
    assert db.stat().st_size > 40 * 4096
    with open(db, "r+b") as f:  # page 21 of 4 KiB: a page of the workers table
        f.seek(20 * 4096)
        f.write(b"\xff" * 4096)
    with capture_logs() as logs:
        store = StateStore(str(tmp_path))
    assert [e["event"] for e in logs] == ["state_store_corrupt"]
    assert len(list(tmp_path.glob(f"{DB_NAME}.corrupt-*"))) >= 1
    assert _contents(store) == ([], {}, [])
    store.close()


def test_a_state_dir_under_a_file_is_one_line_naming_it(tmp_path: Path) -> None:
    """A state dir that cannot be created (under a regular file) or that is a file: StoreUnavailable
    naming the directory, one line."""
    (tmp_path / "file").write_text("")
    with pytest.raises(StoreUnavailable) as caught:
        StateStore(str(tmp_path / "file" / "state"))
    assert str(caught.value) == (
        f"state directory {tmp_path / 'file' / 'state'} cannot be created: Not a directory"
    )
    with pytest.raises(StoreUnavailable) as caught:
        StateStore(str(tmp_path / "file"))
    assert str(caught.value) == f"state directory {tmp_path / 'file'} is not a directory"


def test_a_newer_schema_is_refused_in_one_line(tmp_path: Path) -> None:
    """A store written by a newer kvmapd is not touched: StoreUnavailable naming it and both
    schema versions."""
    store = _saved(tmp_path)
    store._db.execute("UPDATE meta SET value = '99' WHERE key = 'schema'")
    store.close()
    with pytest.raises(StoreUnavailable, match=r"schema 99 is newer than this kvmapd \(1\)$"):
        StateStore(str(tmp_path))
    assert not list(tmp_path.glob("*.corrupt-*"))


def test_without_a_state_dir_the_store_is_in_memory() -> None:
    """No state dir: an in-memory database with the same behaviour (the daemon has one path)."""
    store = StateStore("")
    assert not store.persistent
    store.save_worker(_geometry("one"), {}, "coalesce", 1)
    assert store.generations() == {W1: 1}
    store.close()


def test_one_worker_is_read_by_its_key(tmp_path: Path) -> None:
    """``worker(key)`` answers the stored worker of that key (the one ``workers()`` lists,
    geometry, planner and generation included), and None for a key never stored or deleted."""
    store = _saved(tmp_path)
    store.save_worker(_geometry("two"), {}, "baseline", 3)
    assert store.worker(W2) == next(w for w in store.workers() if w.worker == W2)
    got = store.worker(W1)
    assert got is not None and (got.planner, got.generation) == ("coalesce", 1)
    assert got.geometry == _geometry("one")
    assert store.worker(WorkerKey("three", 0, 0, 0)) is None
    store.delete_worker(W2)
    assert store.worker(W2) is None
    store.close()


def test_a_grant_stored_from_the_request_s_ids_reads_back_as_the_grant(tmp_path: Path) -> None:
    """``save_grant`` with the blocks as the worker named them (a wire
    container, a list, in the request's order) stores the grant itself:
    read back after a restart it has the grant's sorted ids, group by
    group, and all its other fields."""
    store = _saved(tmp_path)
    wire = registry_pb2.GrantTransferRequest()
    wire.groups.add(transfer_group=0, block_ids=[9, 2, 7])
    named = [(0, wire.groups[0].block_ids), (3, [5, 1])]
    grant = Grant(
        digest=b"n" * 32, worker=W1, generation=1, request_id="r",
        blocks={0: np.array([2, 7, 9]), 3: np.array([1, 5])},
        expires_unix_ms=2**62, max_uses=3, uses=1,
    )  # fmt: skip
    store.save_grant(grant, named=named)
    store.close()
    again = StateStore(str(tmp_path))
    (back,) = again.grants()
    assert {g: ids.tolist() for g, ids in back.blocks.items()} == {0: [2, 7, 9], 3: [1, 5]}
    assert replace(back, blocks=grant.blocks) == replace(grant, blocks=grant.blocks)
    again.close()


def test_a_worker_reads_back_with_its_handles_and_an_unreadable_one_says_why(
    tmp_path: Path,
) -> None:
    """A stored registration (kept as the wire's RegisterWorkerRequest) reads back after a
    restart as the geometry that was saved, each allocation with its handle; a row this kvmapd
    cannot read (a cache kind it does not know) lists with no geometry and the reason, so the
    daemon's start goes on and that worker alone is left to its client."""
    handles = [
        ShmFdHandle("tok", 2, 64),
        ShmPathHandle("/dev/shm/kv", 128),
        CudaIpcHandle(b"h" * 64, 4096, 1 << 20),
    ]
    kinds = [DeviceKind.CPU, DeviceKind.CPU, DeviceKind.CUDA]
    geometry = replace(
        _geometry("one"),
        allocations=tuple(
            AllocationSpec(f"a{i}", 1 << 12, DeviceRef(kind, i, "GPU-1"), handle)
            for i, (kind, handle) in enumerate(zip(kinds, handles, strict=True))
        ),
        tp_size=2,
    )
    store = StateStore(str(tmp_path))
    store.save_worker(geometry, {}, "coalesce", 1)
    store.close()
    store = StateStore(str(tmp_path))
    got = store.worker(W1)
    assert got is not None and got.geometry == geometry and got.problem == ""
    assert [a.handle for a in got.geometry.allocations] == handles
    unknown_kind = registry_pb2.RegisterWorkerRequest(worker={"engine_id": "two"})
    unknown_kind.views.add(layer_name="l", allocation_id="a0", cache_kind=99)  # type: ignore[arg-type]
    store._db.execute(
        "UPDATE workers SET worker = ?, request = ? WHERE worker = ?",
        ('["two", 0, 0, 0]', unknown_kind.SerializeToString(), '["one", 0, 0, 0]'),
    )
    (row,) = store.workers()
    assert (row.worker, row.geometry) == (W2, None)
    assert row.problem == "views[0].cache_kind: unknown cache kind 99"
    store.close()
