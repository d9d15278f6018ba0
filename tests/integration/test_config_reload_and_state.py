"""What a running kvmapd does with its configuration and state, as an
operator meets it: a replan is stored (a ``kill -9`` and a restart never hand
out its generation again), a SIGHUP with a bad value changes nothing and says
so in one line, keys that need a restart are named, and under
``--log-format json`` every line the process writes is a JSON object."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvmap.tools.grants import granted
from kvmap.tools.launch import DaemonProc, start_daemon, start_worker
from kvmap.v1 import admin_pb2, admin_pb2_grpc, region_maps_pb2, region_maps_pb2_grpc, types_pb2

pytestmark = pytest.mark.integration

GEO = ("--blocks", "16", "--block-tokens", "16", "--mla-layers", "2", "--indexer-layers", "1")


def _region_map(daemon: DaemonProc) -> types_pb2.RegionMap:
    with daemon.channel() as ch:
        request = region_maps_pb2.GetRegionMapRequest(worker=types_pb2.WorkerId(engine_id="w"))
        return region_maps_pb2_grpc.RegionMapsStub(ch).GetRegionMap(request, timeout=10).region_map


def _wait_for(predicate: Any, timeout: float, what: str) -> None:
    """Wait for ``predicate`` (an event the test observes), failing after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _served(daemon: DaemonProc) -> bool:
    try:
        _region_map(daemon)
    except grpc.RpcError:  # not registered again yet: keep waiting
        return False
    return True


def _events(daemon: DaemonProc, name: str) -> list[dict[str, Any]]:
    """The daemon's JSON log records called ``name``."""
    records = (json.loads(line) for line in daemon.log().splitlines() if line.startswith("{"))
    return [r for r in records if r.get("event") == name]


def test_a_replan_survives_kill_9(tmp_path: Path) -> None:
    """Replan, kill -9, restart on the same state directory: the worker comes back under a
    generation above the replan's (the replan was stored, so its number is never handed out
    again, for another plan)."""
    state = str(tmp_path / "state")
    daemon = start_daemon(tmp_path / "d", "--state-dir", state)
    worker = start_worker(daemon, "w", *GEO)
    try:
        with daemon.channel() as ch:
            admin_pb2_grpc.AdminStub(ch).Replan(
                admin_pb2.ReplanRequest(planner="baseline"), timeout=20
            )
        replanned = _region_map(daemon).generation
        assert replanned == 2
        daemon.kill()  # SIGKILL: nothing is flushed or cleaned up
        daemon = start_daemon(tmp_path / "d", "--state-dir", state)
        _wait_for(lambda: _served(daemon), 60, "the worker served again")
        assert _region_map(daemon).generation > replanned
    finally:
        worker.stop()
        daemon.stop()


def test_sighup_refuses_a_bad_value_and_names_restart_keys(tmp_path: Path) -> None:
    """A SIGHUP after a bad planner is written is refused in one log line naming the key, the
    value and the file, and the running configuration stays (no replan); a later good edit
    replans with the new planner and names the changed key that only a restart applies."""
    config = tmp_path / "kvmapd.toml"
    config.write_text('planner = "coalesce"\n')
    daemon = start_daemon(tmp_path / "d", "--config", str(config))
    worker = start_worker(daemon, "w", *GEO)
    try:
        config.write_text('planner = "nosuch"\n')
        os.kill(daemon.proc.pid, signal.SIGHUP)
        _wait_for(lambda: _events(daemon, "config_reload_refused"), 20, "the refusal")
        refusal = _events(daemon, "config_reload_refused")[0]
        assert refusal["level"] == "error"
        assert all(s in refusal["error"] for s in ("planner", '"nosuch"', str(config)))
        assert (_region_map(daemon).generation, _region_map(daemon).planner.name) == (
            1, "coalesce"
        )  # fmt: skip
        config.write_text('planner = "baseline"\ndrain_seconds = 3.0\n')
        os.kill(daemon.proc.pid, signal.SIGHUP)
        _wait_for(lambda: _region_map(daemon).planner.name == "baseline", 20, "the replan")
        assert _region_map(daemon).generation == 2
        restart = _events(daemon, "config_change_needs_restart")
        assert [r["keys"] for r in restart] == [["drain_seconds"]]
        assert restart[0]["level"] == "warning"
    finally:
        worker.stop()
        assert daemon.terminate() == 0, daemon.log()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed when this returns: nothing listens


def _pull(target: str, request_id: str) -> dict[str, Any]:
    return {
        "cmd": "pull", "request_id": request_id, "remote_target": target,
        "remote_worker": {"engine_id": "nobody"}, "timeout_ms": 4000,
        "groups": [{"group": 0, "local": [0, 1], "remote": [0, 1]}],
    }  # fmt: skip


def test_every_line_of_the_daemon_is_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under --log-format json, a daemon run through its start, a pull refused by its allow-list,
    a pull from a peer that is not there and its stop writes nothing but JSON objects, gRPC
    core's own lines (made verbose here) included, wrapped with their level; the failed pulls
    are warnings."""
    monkeypatch.setenv("GRPC_VERBOSITY", "debug")  # native lines for the wrapping to catch
    daemon = start_daemon(tmp_path / "d", "--connect-timeout-s", "1")
    worker = start_worker(daemon, "w", *GEO)
    # Each with a capability (the worker's own grant), so that what refuses
    # them is the allow-list and the missing peer.
    refused = worker.call(granted(worker, _pull("10.255.0.1:50051", "refused")))
    failed = worker.call(granted(worker, _pull(f"127.0.0.1:{_closed_port()}", "no-peer")))
    worker.stop()
    assert daemon.terminate() == 0, daemon.log()
    assert refused["code"] == "PERMISSION_DENIED", refused
    # The missing peer is retried until the pull's deadline.
    assert failed["code"] in ("UNAVAILABLE", "DEADLINE_EXCEEDED"), failed
    lines = daemon.log().splitlines()
    records = [json.loads(line) for line in lines]  # raises on any line that is not JSON
    assert all(isinstance(r, dict) and r.get("level") and r.get("event") for r in records)
    native = [r for r in records if r.get("logger") == "native"]
    assert native, "gRPC core wrote nothing: the wrapping was not exercised"
    glog = {"I": "info", "W": "warning", "E": "error"}
    assert all(r["level"] == glog[r["event"][0]] for r in native if r["event"][:1] in glog)
    rejected = [r for r in records if r["event"] == "rpc_rejected"]
    assert {r["code"] for r in rejected} >= {"PERMISSION_DENIED", failed["code"]}
    assert {r["level"] for r in rejected} == {"warning"}
    # The effective configuration, once serving (before the ready line).
    config = [r for r in records if r["event"] == "kvmapd_config"]
    assert len(config) == 1 and "peer_secret_file" in config[0]
    events = [r["event"] for r in records]
    assert events.index("kvmapd_config") < events.index("kvmapd_stopped")
    assert records[-1]["event"] == "kvmapd_stopped" or any(
        r["event"] == "kvmapd_stopped" for r in records
    )
