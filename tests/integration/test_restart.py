"""Upgrade and restart kvmapd without restarting the worker: ``kill -9`` of
the worker's daemon and a new daemon with another planner, and a live
``kvmapctl replan``, while a peer keeps pulling."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvmap.tools.grants import GrantRefused, grant, granted
from kvmap.tools.launch import DaemonProc, WorkerProc, start_daemon, start_worker
from kvmap.v1 import admin_pb2, admin_pb2_grpc, region_maps_pb2, region_maps_pb2_grpc, types_pb2

pytestmark = pytest.mark.integration

BLOCKS = 32
GEO = ("--blocks", str(BLOCKS), "--block-tokens", "32", "--mla-layers", "4", "--indexer-layers", "2")  # noqa: E501  # fmt: skip


@dataclass
class Puller:
    """Pulls from the prefill worker in a loop, recording every outcome. The
    prefill worker grants each pull first (a refused grant is the attempt's
    outcome: no pull is made without one)."""

    decode: WorkerProc
    owner: WorkerProc
    target: str
    results: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            local = [(i * 3 + b) % BLOCKS for b in range(0, BLOCKS, 3)]
            remote = [(i * 5 + b * 7) % BLOCKS for b in range(len(local))]
            started = time.monotonic()
            cmd = {
                "cmd": "pull",
                "request_id": f"loop-{i}",
                "remote_target": self.target,
                "remote_worker": {"engine_id": "prefill"},
                "groups": [
                    {"group": 0, "local": local, "remote": remote},
                    {"group": 1, "local": local, "remote": remote},
                ],
                "timeout_ms": 5000,
            }
            try:
                out = self.decode.call(granted(self.owner, cmd))
            except GrantRefused as err:
                out = {**err.answer, "stage": "grant"}
            # Stamped when the pull started: one in flight across a cut-off
            # belongs to the time before it.
            self.results.append((started, out))
            i += 1
            time.sleep(0.01)

    def ok_after(self, t: float) -> list[dict[str, Any]]:
        return [out for when, out in self.results if when > t and out["ok"]]

    def failed_after(self, t: float) -> list[dict[str, Any]]:
        return [out for when, out in self.results if when > t and not out["ok"]]


@pytest.fixture
def decode(tmp_path: Path) -> Iterator[tuple[DaemonProc, WorkerProc]]:
    d = start_daemon(tmp_path / "decode", name="decode")
    w = start_worker(d, "decode", *GEO)
    yield d, w
    w.stop()
    assert d.terminate() == 0, d.log()


def region_map(daemon: DaemonProc) -> types_pb2.RegionMap:
    with daemon.channel(tcp=True) as ch:
        return (
            region_maps_pb2_grpc.RegionMapsStub(ch)
            .GetRegionMap(
                region_maps_pb2.GetRegionMapRequest(worker=types_pb2.WorkerId(engine_id="prefill")),
                timeout=10,
            )
            .region_map
        )


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    """Wait for ``predicate`` (an event the test observes), failing after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_kill9_and_restart_with_another_planner(
    tmp_path: Path, decode: tuple[DaemonProc, WorkerProc]
) -> None:
    """kill -9 of the prefill daemon and a new one with another planner and the same state
    directory: pulls in the gap fail with UNAVAILABLE only, the worker process lives on and its
    memory is served again under a new generation and the new planner, the peer re-handshakes and
    drops the dead agent, every pull after the restart verifies, and the same worker process
    re-attaches to the new daemon."""
    state = tmp_path / "state"
    prefill = start_daemon(
        tmp_path / "prefill", "--planner", "coalesce", "--state-dir", str(state), name="prefill"
    )
    worker = start_worker(prefill, "prefill", *GEO, "--fill")
    before = region_map(prefill)
    assert (before.generation, before.planner.name, len(before.regions)) == (1, "coalesce", 2)
    puller = Puller(decode[1], worker, prefill.tcp_target)
    thread = threading.Thread(target=puller.run)
    thread.start()
    restarted: DaemonProc | None = None
    try:
        wait_for(lambda: len(puller.ok_after(0)) >= 5, 60, "pulls before the kill")
        prefill.kill()  # SIGKILL: no drain, no cleanup
        killed_at = time.monotonic()
        # A pull started after the kill has failed: the gap was observed.
        wait_for(lambda: puller.failed_after(killed_at), 60, "a pull to fail in the gap")
        restarted = start_daemon(
            tmp_path / "prefill",
            "--planner", "baseline", "--state-dir", str(state),
            name="prefill", listen=prefill.tcp_target,
        )  # fmt: skip
        back_at = time.monotonic()
        wait_for(lambda: len(puller.ok_after(back_at)) >= 5, 60, "pulls after the restart")
    finally:
        puller.stop.set()
        thread.join(60)

    assert worker.proc.poll() is None, "the worker process exited"
    after = region_map(restarted)
    assert after.generation > before.generation
    assert (after.planner.name, len(after.regions)) == ("baseline", 6)

    # Every failed attempt, including a pull in flight at the kill, fell into the gap.
    gap = [o for _, o in puller.results if not o["ok"]]
    print(f"\nattempts in the gap: {len(gap)} failed, statuses "
          f"{Counter((o.get('stage', 'pull'), o['code']) for o in gap)}")  # fmt: skip
    assert gap, "no attempt fell into the gap"
    # A pull fails only as UNAVAILABLE. The owner's grant before it fails so
    # while its daemon is down, and (FAILED_PRECONDITION) while the restarted
    # daemon has the worker back from the state dir but not yet re-attached.
    assert {o["code"] for o in gap if o.get("stage") != "grant"} <= {"UNAVAILABLE"}, gap
    assert all(
        o["code"] == "UNAVAILABLE"
        or (o["code"] == "FAILED_PRECONDITION" and "no Attach stream" in o["message"])
        for o in gap
        if o.get("stage") == "grant"
    ), gap
    post = [o for w, o in puller.results if w > killed_at and o["ok"]]
    assert post and all(o["bad_blocks"] == 0 for o in post)
    assert all(o["stats"]["remote_generation"] == after.generation for o in post)
    assert any(o["stats"]["handshaked"] for o in post), "the peer never re-handshaked"
    # The peer dropped the dead daemon's agent: one remote agent, the new one.
    with decode[0].channel() as ch:
        peer_stats = admin_pb2_grpc.AdminStub(ch).GetStats(admin_pb2.GetStatsRequest(), timeout=10)
    assert peer_stats.remote_agents == 1

    # The worker's Attach stream came back on the new daemon: one and the same
    # worker process (never re-created) was attached to the killed daemon, then
    # to the new one, as the daemons' own instance ids say.
    def attached_to() -> list[str]:
        events = worker.call({"cmd": "events"})["events"]
        return [e["attached"]["daemon_instance"] for e in events if "attached" in e]

    wait_for(lambda: len(attached_to()) >= 2, 20, "the worker to re-attach")
    instances = attached_to()
    assert prefill.instance != restarted.instance
    assert (instances[0], instances[-1]) == (prefill.instance, restarted.instance), instances

    worker.stop()
    assert restarted.terminate() == 0, restarted.log()


def test_live_replan_without_restart(tmp_path: Path, decode: tuple[DaemonProc, WorkerProc]) -> None:
    """kvmapctl replan switches a live daemon's planner while a peer keeps pulling: no pull fails or
    misreads, later pulls see generation 2, and the worker gets a region_map_changed event."""
    prefill = start_daemon(tmp_path / "prefill", "--planner", "coalesce", name="prefill")
    worker = start_worker(prefill, "prefill", *GEO, "--fill")
    puller = Puller(decode[1], worker, prefill.tcp_target)
    thread = threading.Thread(target=puller.run)
    thread.start()
    try:
        wait_for(lambda: len(puller.ok_after(0)) >= 5, 60, "pulls before the replan")
        replanned = subprocess.run(
            [sys.executable, "-m", "kvmap.daemon.cli.kvmapctl", "--target", f"unix://{prefill.socket}",
             "replan", "--planner", "baseline"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert replanned.returncode == 0, replanned.stderr
        assert "generation 2" in replanned.stdout
        at = time.monotonic()
        wait_for(lambda: len(puller.ok_after(at)) >= 5, 60, "pulls after the replan")
    finally:
        puller.stop.set()
        thread.join(60)
    assert all(o["ok"] for _, o in puller.results), [o for _, o in puller.results if not o["ok"]]
    assert all(o["bad_blocks"] == 0 for _, o in puller.results)
    after = [o for w, o in puller.results if w > at]
    assert all(o["stats"]["remote_generation"] == 2 for o in after)
    assert region_map(prefill).planner.name == "baseline"
    wait_for(
        lambda: any(
            e.get("region_map_changed", {}).get("generation") == "2"
            for e in worker.call({"cmd": "events"})["events"]
        ),
        10,
        "the region_map_changed event",
    )
    worker.stop()
    assert prefill.terminate() == 0, prefill.log()


def test_sighup_replans_from_the_config_file(tmp_path: Path) -> None:
    """SIGHUP makes the daemon re-read its config file and replan with the planner named there
    (generation 2)."""
    config = tmp_path / "kvmapd.toml"
    config.write_text('planner = "coalesce"\n')
    daemon = start_daemon(tmp_path / "d", "--config", str(config), name="prefill")
    worker = start_worker(daemon, "prefill", *GEO)
    assert region_map(daemon).planner.name == "coalesce"
    config.write_text('planner = "baseline"\n')
    os.kill(daemon.proc.pid, 1)  # SIGHUP
    wait_for(lambda: region_map(daemon).planner.name == "baseline", 20, "the SIGHUP replan")
    assert region_map(daemon).generation == 2
    worker.stop()
    assert daemon.terminate() == 0, daemon.log()


def test_a_grant_at_once_after_the_daemon_is_back_succeeds(tmp_path: Path) -> None:
    """The owner's first grant once its restarted daemon is ready is granted.
    The worker's channel failed its calls while the daemon was down, so it
    waits out a reconnect backoff when the daemon comes back; the client
    must connect for the call instead of failing it with the old connect
    error (seen as a prefill engine's first requests after a kvmapd upgrade
    not offered to decode, their KV recomputed)."""
    state = tmp_path / "state"
    prefill = start_daemon(tmp_path / "prefill", "--state-dir", str(state), name="prefill")
    worker = start_worker(prefill, "prefill", *GEO)
    restarted: DaemonProc | None = None
    blocks = [{"group": 0, "blocks": [1, 2, 3]}]
    try:
        assert grant(worker, "before", blocks)
        prefill.kill()
        # Grants while it is down fail at once, each a failed connect that
        # lengthens the channel's reconnect backoff up to its longest.
        codes = []
        for i in range(12):
            with pytest.raises(GrantRefused) as refused:
                grant(worker, f"down-{i}", blocks)
            codes.append(refused.value.answer["code"])
            time.sleep(0.1)
        assert set(codes) == {"UNAVAILABLE"}, codes
        restarted = start_daemon(
            tmp_path / "prefill", "--state-dir", str(state),
            name="prefill", listen=prefill.tcp_target,
        )  # fmt: skip
        assert grant(worker, "after", blocks)
    finally:
        worker.stop()
        if restarted is not None:
            assert restarted.terminate() == 0, restarted.log()
