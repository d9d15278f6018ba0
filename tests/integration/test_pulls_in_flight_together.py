"""Many pulls in flight at once through one decode daemon to one owner: their
BeginTransfer calls share the owner's channel, and those that queue behind a
call in flight go together as one message of the owner's
BeginTransferStream (``peer_batches``, ``peer_stream``).
Real daemons (separate processes, real NIXL over UCX on loopback) and
stand-in workers on real shared memory: every pull lands byte for byte,
the owner hears each one's completion, and no lease is left behind."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvmap.tools.grants import granted
from kvmap.tools.launch import DaemonProc, WorkerProc, start_daemon, start_worker
from kvmap.v1 import admin_pb2, admin_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

BLOCKS = 64
GEO = ("--blocks", str(BLOCKS), "--block-tokens", "32", "--mla-layers", "4")
GEO += ("--indexer-layers", "2")
DECODE_WORKERS = 6
PULLS_EACH = 3


@pytest.fixture
def pod(tmp_path: Path) -> Iterator[tuple[DaemonProc, WorkerProc, DaemonProc, list[WorkerProc]]]:
    """A prefill daemon and worker; one decode daemon with several workers."""
    with contextlib.ExitStack() as stack:
        prefill = start_daemon(tmp_path / "prefill", "--planner", "coalesce", name="prefill")
        stack.callback(prefill.stop)
        pw = start_worker(prefill, "prefill", *GEO, "--fill")
        stack.callback(pw.stop)
        decode = start_daemon(tmp_path / "decode", "--planner", "coalesce", name="decode")
        stack.callback(decode.stop)
        workers = []
        for i in range(DECODE_WORKERS):
            w = start_worker(decode, f"decode{i}", *GEO)
            stack.callback(w.stop)
            workers.append(w)
        yield prefill, pw, decode, workers


def _leases(daemon: DaemonProc) -> int:
    with grpc.insecure_channel(daemon.unix_target) as ch:
        stats = admin_pb2_grpc.AdminStub(ch).GetStats(admin_pb2.GetStatsRequest(), timeout=10)
    return int(stats.leases)


def test_pulls_in_flight_together_all_land_and_end_their_leases(
    pod: tuple[DaemonProc, WorkerProc, DaemonProc, list[WorkerProc]],
) -> None:
    """Six decode workers of one daemon pull from one owner at once, three pulls each:
    every pull is DONE with every block byte-exact, and once they are, the owner holds no
    lease (each ended by its completion notification)."""
    prefill, pw, _, workers = pod
    results: dict[str, dict[str, Any]] = {}

    def plan(i: int, r: int) -> dict[str, Any]:
        local = [(b * 7 + r + i) % BLOCKS for b in range(12)]
        remote = [(b * 5 + 3 * r + 2 * i) % BLOCKS for b in range(12)]
        return {
            "cmd": "pull",
            "request_id": f"together-{i}-{r}",
            "remote_target": prefill.tcp_target,
            "remote_worker": {"engine_id": "prefill"},
            "groups": [
                {"group": 0, "local": local, "remote": remote},
                {"group": 1, "local": local, "remote": remote},
            ],
        }

    # Granted up front: the prefill worker answers one command at a time.
    pulls = [[granted(pw, plan(i, r)) for r in range(PULLS_EACH)] for i in range(len(workers))]
    gate = threading.Barrier(len(workers))

    def run(worker: WorkerProc, cmds: list[dict[str, Any]]) -> None:
        gate.wait()
        for cmd in cmds:
            results[cmd["request_id"]] = worker.call(cmd)

    threads = [
        threading.Thread(target=run, args=(w, p)) for w, p in zip(workers, pulls, strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert len(results) == DECODE_WORKERS * PULLS_EACH
    assert all(r["ok"] and r["bad_blocks"] == 0 for r in results.values()), results
    deadline = time.monotonic() + 10
    while _leases(prefill) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _leases(prefill) == 0
