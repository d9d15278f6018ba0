"""A completed transfer's grant use and its worker's event are written in
one transaction (``StateStore.record_use``): both survive a killed daemon,
or (when the write fails) neither is stored."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvmap.core.geometry import WorkerKey
from kvmap.core.grants import Grant
from kvmap.core.worker_events import TransferDirection, TransferFinished
from kvmap.daemon.adapters.state_store import StateStore

_COMPLETE = """
import os, sys
from dataclasses import replace
import numpy as np
from kvmap.daemon.adapters.state_store import StateStore
from kvmap.core.geometry import WorkerKey
from kvmap.core.grants import Grant
from kvmap.core.worker_events import TransferDirection, TransferFinished
w = WorkerKey("p", 0, 0, 0)
store = StateStore(sys.argv[1])
kept = Grant(digest=b"k" * 32, worker=w, generation=1, request_id="kept",
    blocks={0: np.arange(4, dtype=np.int64)}, expires_unix_ms=1 << 50, max_uses=2)
spent = replace(kept, digest=b"s" * 32, request_id="spent", max_uses=1)
store.save_grant(kept)
store.save_grant(spent)
def event(request_id):
    return TransferFinished(request_id, TransferDirection.PULLED_FROM, "peer")
a = store.record_use(replace(kept, uses=1), w, event("kept"))
b = store.record_use(replace(spent, uses=1), w, event("spent"))
c = store.record_use(None, w, event("revoked"))
sys.stdout.write(f"{a} {b} {c}\\n"); sys.stdout.flush()
os.kill(os.getpid(), 9)
"""


def test_a_recorded_use_survives_a_killed_daemon(tmp_path: Path) -> None:
    """A process records three completions and is killed (SIGKILL, no
    close): a grant with a use left keeps its count, a used-up grant is
    gone, and each completion's event waits under the id it was given."""
    proc = subprocess.run(
        [sys.executable, "-c", _COMPLETE, str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == -9, proc.stderr
    ids = [int(i) for i in proc.stdout.split()]
    store = StateStore(str(tmp_path))
    assert [(g.request_id, g.uses, g.max_uses) for g in store.grants()] == [("kept", 1, 2)]
    pending = store.pending_events(WorkerKey("p", 0, 0, 0))
    assert [(i, e.request_id) for i, e in pending if isinstance(e, TransferFinished)] == list(
        zip(ids, ["kept", "spent", "revoked"], strict=True)
    )


def test_a_failed_record_stores_neither_the_use_nor_the_event(tmp_path: Path) -> None:
    """When the event cannot be inserted, the grant's use is rolled back
    with it: the store holds what it held before."""
    store = StateStore(str(tmp_path))
    w = WorkerKey("p", 0, 0, 0)
    grant = Grant(
        digest=b"k" * 32,
        worker=w,
        generation=1,
        request_id="r",
        blocks={0: np.arange(4, dtype=np.int64)},
        expires_unix_ms=1 << 50,
        max_uses=2,
    )
    store.save_grant(grant)
    store._db.execute(
        "CREATE TRIGGER no_events BEFORE INSERT ON pending_events "
        "BEGIN SELECT RAISE(ABORT, 'no events'); END"
    )
    event = TransferFinished("r", TransferDirection.UNSPECIFIED, "")
    used = Grant(**{**grant.__dict__, "uses": 1})
    with pytest.raises(sqlite3.IntegrityError):
        store.record_use(used, w, event)
    assert [g.uses for g in store.grants()] == [0]
    spent = Grant(**{**grant.__dict__, "uses": 2})
    with pytest.raises(sqlite3.IntegrityError):
        store.record_use(spent, w, event)
    assert [g.uses for g in store.grants()] == [0]
    assert store.pending_events(w) == []
    assert not store._db.in_transaction
