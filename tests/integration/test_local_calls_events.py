"""Workers' Attach streams go on their daemon's local calls socket when it
has one, and over gRPC when it does not: real daemons in their own
processes, stand-in workers whose ``kvmap.client`` chooses, real NIXL over
UCX on loopback. The prefill worker's stream is the one that carries an
event for every pull of its blocks."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_local_calls_pulls import _accepted, _pair, _pulls

from kvmap.core.config import LOCAL_CALLS_SUFFIX
from kvmap.tools.launch import WorkerProc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def _wait(predicate: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _finished(worker: WorkerProc) -> set[str]:
    """Request ids of the TransferFinished events the worker has heard."""
    events = worker.call({"cmd": "events"})["events"]
    return {e["transfer_finished"]["request_id"] for e in events if "transfer_finished" in e}


def _deregistered(log: str) -> list[dict[str, Any]]:
    """The daemon's ``worker_deregistered`` lines for the prefill worker."""
    lines = [json.loads(x) for x in log.splitlines() if x.startswith("{")]
    return [
        x
        for x in lines
        if x.get("event") == "worker_deregistered" and str(x.get("worker")).startswith("prefill")
    ]


def test_the_owners_events_come_on_the_local_calls_socket(tmp_path: Path) -> None:
    """The prefill worker, which makes no pulls, holds exactly one
    connection on its daemon's local calls socket (its Attach stream); an
    event for each pull of its blocks arrives on it; when the worker is
    killed the connection ends and its daemon deregisters it, as for a
    gRPC stream that ends."""
    with _pair(tmp_path) as (prefill, _decode, pw, dw):
        path = prefill.socket + LOCAL_CALLS_SUFFIX
        _wait(lambda: _accepted(path) == 1, "the prefill worker's attach connection")
        results = _pulls(prefill.tcp_target, pw, dw, 3)
        assert all(r["ok"] and r["bad_blocks"] == 0 for r in results), results
        wanted = {f"local-{r}" for r in range(3)}
        _wait(lambda: wanted <= _finished(pw), f"TransferFinished events for {wanted}")
        pw.kill()
        _wait(lambda: _accepted(path) == 0, "the attach connection to end")
        _wait(lambda: bool(_deregistered(prefill.log())), "the killed worker deregistered")
        # By the stream's end on this socket (the line carries the call's context).
        assert _deregistered(prefill.log())[0].get("listener") == "local_calls"


def test_without_the_socket_events_come_over_grpc(tmp_path: Path) -> None:
    """An owner daemon started with ``--no-local-calls``: the same client
    attaches over gRPC, and the pulls' events still arrive."""
    with _pair(tmp_path, prefill_flags=("--no-local-calls",)) as (prefill, _decode, pw, dw):
        assert not Path(prefill.socket + LOCAL_CALLS_SUFFIX).exists()
        results = _pulls(prefill.tcp_target, pw, dw, 2)
        assert all(r["ok"] and r["bad_blocks"] == 0 for r in results), results
        wanted = {f"local-{r}" for r in range(2)}
        _wait(lambda: wanted <= _finished(pw), f"TransferFinished events for {wanted}")
