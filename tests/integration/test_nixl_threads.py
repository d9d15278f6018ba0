"""``nixl_threads``: the daemons' NIXL agents run UCX threads of their own,
which post and progress a large transfer's descriptors in chunks at once.
Real daemons (separate processes, real NIXL over UCX on loopback) pull
scattered blocks between real shared-memory KV caches; NIXL's chunk size
is lowered (``NIXL_MIN_CHUNK_SIZE``, read by NIXL at each transfer) so that
these small transfers are cut into chunks, as a full-scale pull of
thousands of descriptors is."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvmap.tools.grants import granted
from kvmap.tools.launch import DaemonProc, WorkerProc, start_daemon, start_worker

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

BLOCKS = 64
GEO = ("--blocks", str(BLOCKS), "--block-tokens", "32", "--mla-layers", "6")
GEO += ("--indexer-layers", "3")


def _ready_line(daemon: DaemonProc) -> dict[str, Any]:
    """The daemon's ``kvmapd_ready`` log line."""
    deadline = time.monotonic() + 10.0
    while True:
        for line in daemon.log().splitlines():
            if '"kvmapd_ready"' in line:
                parsed: dict[str, Any] = json.loads(line)
                return parsed
        if time.monotonic() > deadline:
            raise AssertionError(f"no kvmapd_ready line:\n{daemon.log()}")
        time.sleep(0.05)


@pytest.fixture
def threaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[DaemonProc, WorkerProc, DaemonProc, WorkerProc]]:
    """A prefill and a decode daemon with two UCX threads each (baseline
    decode planner: a descriptor per layer and block), NIXL chunks of at
    most 8 descriptors."""
    monkeypatch.setenv("NIXL_MIN_CHUNK_SIZE", "4")
    monkeypatch.setenv("NIXL_MAX_CHUNK_SIZE", "8")
    with contextlib.ExitStack() as stack:
        sides: list[tuple[DaemonProc, WorkerProc]] = []
        for name, planner, extra in (
            ("prefill", "coalesce", ("--fill",)),
            ("decode", "baseline", ()),
        ):
            flags = ("--planner", planner, "--nixl-threads", "2")
            d = start_daemon(tmp_path / name, *flags, name=name)
            stack.callback(_exits_cleanly, d)
            w = start_worker(d, name, *GEO, *extra)
            stack.callback(w.stop)  # before its daemon (callbacks run last first)
            sides.append((d, w))
        (pd, pw), (dd, dw) = sides
        yield pd, pw, dd, dw


def _exits_cleanly(daemon: DaemonProc) -> None:
    assert daemon.terminate() == 0, daemon.log()


def test_threaded_agents_pull_every_byte_and_say_so(
    threaded: tuple[DaemonProc, WorkerProc, DaemonProc, WorkerProc],
) -> None:
    """Both daemons report the UCX threads NIXL runs for their agents (read
    back from NIXL, not from the flag), and scattered pulls whose
    descriptors NIXL posts in chunks on those threads, several at once,
    move exactly the granted blocks (every byte checked against the
    prefill worker's pattern)."""
    prefill, pw, decode, dw = threaded
    assert _ready_line(prefill)["nixl_threads"] == 2
    assert _ready_line(decode)["nixl_threads"] == 2
    results = []
    for r in range(3):
        remote = [(b * 7 + r) % BLOCKS for b in range(24)]
        local = [(b * 5 + 3 * r + 1) % BLOCKS for b in range(24)]
        cmd = {
            "cmd": "pull",
            "request_id": f"threaded-{r}",
            "remote_target": prefill.tcp_target,
            "remote_worker": {"engine_id": "prefill"},
            "groups": [
                {"group": 0, "local": local, "remote": remote},
                {"group": 1, "local": local, "remote": remote},
            ],
        }
        results.append(dw.call(granted(pw, cmd)))
    assert all(r["ok"] and r["bad_blocks"] == 0 for r in results), results
    # A descriptor per layer and block on the baseline side: 24 x 9 of them,
    # cut into chunks of at most 8.
    assert all(r["stats"]["descriptors"] >= 24 * 9 for r in results), results


def test_no_threads_is_the_nixl_thread_alone(tmp_path: Path) -> None:
    """``--nixl-threads 0``: NIXL runs no UCX threads for the agent (what the
    daemon reports is NIXL's own answer)."""
    d = start_daemon(tmp_path / "solo", "--nixl-threads", "0", name="solo")
    try:
        assert _ready_line(d)["nixl_threads"] == 0
    finally:
        assert d.terminate() == 0, d.log()
