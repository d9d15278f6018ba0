"""The runtime directory, the lock files and the state directory against a local squatter
(issue 24): real `kvmapd serve` processes, paths planted in tmp_path the way another local user
would plant them in /tmp."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from kvmap.tools.launch import local_env, start_daemon
from kvmap.v1 import region_maps_pb2, region_maps_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _serve(tmp_path: Path, socket: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """Run `kvmapd serve` on ``socket`` to its end (it is expected to refuse to start)."""
    return subprocess.run(
        [
            sys.executable, "-m", "kvmap.daemon.cli.kvmapd", "serve",
            "--socket", str(socket), "--listen", "127.0.0.1:0", *extra,
        ],
        check=False, capture_output=True, text=True, timeout=60, env=local_env(tmp_path),
    )  # fmt: skip


def _one_line(done: subprocess.CompletedProcess[str]) -> str:
    """The one error line of a refused start (the start-up config log line may precede it)."""
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("kvmapd: ")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    return errors[0]


def test_a_world_writable_runtime_dir_is_refused(tmp_path: Path) -> None:
    """A squatter's pre-created 0777 runtime dir makes kvmapd exit 2 with one line naming the
    directory and its mode; no socket or lock is created in it."""
    run_dir = tmp_path / "kvmap-squatted"
    run_dir.mkdir()
    os.chmod(run_dir, 0o777)
    line = _one_line(_serve(tmp_path, run_dir / "kvmapd.sock"))
    assert str(run_dir) in line and "writable by anyone" in line and "0777" in line, line
    assert list(run_dir.iterdir()) == []


def test_a_symlinked_runtime_dir_is_refused(tmp_path: Path) -> None:
    """A runtime dir that is a symbolic link (to a directory of the attacker's) is not followed:
    exit 2 naming it, nothing created behind the link."""
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    link = tmp_path / "kvmap-link"
    link.symlink_to(target)
    line = _one_line(_serve(tmp_path, link / "kvmapd.sock"))
    assert str(link) in line and "symbolic link" in line, line
    assert list(target.iterdir()) == []


def test_a_symlinked_lock_is_neither_followed_nor_truncated(tmp_path: Path) -> None:
    """A `<socket>.lock` planted as a symbolic link to someone's file: kvmapd exits 2 naming the
    lock, and the file keeps its bytes (it used to be truncated to the daemon's PID)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o770)
    victim = tmp_path / "victim.conf"
    victim.write_bytes(b"precious contents\n" * 100)
    lock = run_dir / "kvmapd.sock.lock"
    lock.symlink_to(victim)
    line = _one_line(_serve(tmp_path, run_dir / "kvmapd.sock"))
    assert str(lock) in line and "symbolic link" in line, line
    assert victim.read_bytes() == b"precious contents\n" * 100
    assert not (run_dir / "kvmapd.sock").exists()


def test_a_hard_linked_lock_is_not_truncated(tmp_path: Path) -> None:
    """A `<socket>.lock` that is a second name of another file (a hard link) is refused too,
    the file untouched."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o770)
    victim = tmp_path / "victim.conf"
    victim.write_bytes(b"keep me\n")
    os.link(victim, run_dir / "kvmapd.sock.lock")
    line = _one_line(_serve(tmp_path, run_dir / "kvmapd.sock"))
    assert "hard links" in line, line
    assert victim.read_bytes() == b"keep me\n"


def _workers(target: str) -> int:
    with grpc.insecure_channel(target) as ch:
        resp = region_maps_pb2_grpc.RegionMapsStub(ch).ListWorkers(
            region_maps_pb2.ListWorkersRequest(), timeout=10
        )
    return len(resp.workers)


def test_a_second_daemon_on_the_same_state_dir_is_refused(tmp_path: Path) -> None:
    """A second kvmapd on another socket but a live daemon's --state-dir exits 2 with one line
    naming the directory and the first daemon's PID; the first keeps serving its store."""
    state = tmp_path / "state"
    first = start_daemon(tmp_path / "a", "--state-dir", str(state), name="a")
    try:
        line = _one_line(_serve(tmp_path, tmp_path / "b.sock", "--state-dir", str(state)))
        assert str(state) in line and f"pid {first.proc.pid}" in line, line
        assert not (tmp_path / "b.sock").exists()
        assert _workers(first.unix_target) == 0  # still serving
    finally:
        first.stop()
    again = start_daemon(tmp_path / "c", "--state-dir", str(state), name="c")
    again.stop()  # the lock went with the first daemon
