"""State store faults against real daemons, each fault made for real:

- a corrupt store (garbage in the database file): the daemon moves it aside,
  says so in an error log line naming both paths, and starts empty;
- an unusable state dir (under a regular file; immutable): exit status 2
  and one line on stderr naming it;
- a full disk during RegisterWorker: the daemon runs under RLIMIT_FSIZE
  (writes past it fail with EFBIG, which SQLite reports as a bare I/O error,
  not SQLITE_FULL; the store reads the cause off its files): a registration
  too big for what is left is RESOURCE_EXHAUSTED naming the limit, changes
  nothing, and the daemon serves on;
- a store that turns read-only under a running daemon: its WAL and database
  made immutable (``chattr +i``: even root's writes through the daemon's open
  descriptors fail, which a chmod would not do) — UNAVAILABLE, nothing
  changed, the daemon serves on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from security_support import CALL_TIMEOUT_S, Live, ShmWorker

from kvmap.client.fd_handoff import sealed_memfd, send_fds
from kvmap.daemon.adapters.state_store import DB_NAME
from kvmap.tools.launch import START_TIMEOUT_S, DaemonProc, local_env, start_daemon
from kvmap.v1 import registry_pb2, types_pb2

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

Code = grpc.StatusCode
FSIZE_LIMIT = 1 << 20  # 1 MiB: start-up and a small worker fit, a 2 MB registration does not


def _kvmapd(workdir: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "kvmap.daemon.cli.kvmapd", "serve",
        "--socket", str(workdir / "d.sock"), "--listen", "127.0.0.1:0",
        "--ready-file", str(workdir / "d.ready"), "--log-format", "json", *extra,
    ]  # fmt: skip


# Sets the file-size limit, then becomes kvmapd (exec keeps the limit). Python
# ignores SIGXFSZ, so a write past the limit fails with EFBIG, not a kill.
_WITH_FSIZE_LIMIT = (
    "import os, resource, sys; "
    "resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), resource.RLIM_INFINITY)); "
    "os.execv(sys.argv[2], sys.argv[2:])"
)


def _spawn_limited(workdir: Path, fsize: int, *extra: str) -> DaemonProc:
    """``launch.start_daemon`` under RLIMIT_FSIZE.

    The limit holds for every file of the process; UCX's shared-memory
    transport backs its segments with files (4 MB each), which on a node live
    on another file system than the state dir. So UCX uses System V shared
    memory instead here: only the store meets the limit, as only the state
    dir's disk would be full."""
    log_path = workdir / "d.log"
    env = {**local_env(workdir), "UCX_TLS": "^posix"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", _WITH_FSIZE_LIMIT, str(fsize), *_kvmapd(workdir, *extra)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=workdir,
        )
    ready = workdir / "d.ready"
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait(10)
            raise AssertionError(f"kvmapd did not start:\n{log_path.read_text()}")
        time.sleep(0.05)
    info = json.loads(ready.read_text())
    return DaemonProc(
        proc, str(workdir / "d.sock"), int(info["tcp_port"]), info["instance"], info["agent"],
        workdir, log_path,
    )  # fmt: skip


def _log_events(daemon: DaemonProc) -> list[dict[str, object]]:
    events = []
    for line in daemon.log().splitlines():
        if line.startswith("{"):
            events.append(json.loads(line))
    return events


def _register_big(live: Live, engine: str, views: int, name_bytes: int) -> tuple[Code, str]:
    """A registration whose stored request is about ``views * name_bytes`` bytes: adjacent
    one-byte views over a fresh memfd."""
    req = registry_pb2.RegisterWorkerRequest(
        worker=types_pb2.WorkerId(engine_id=engine), kv_cache_layout="BLHNC", block_size_tokens=16
    )
    fd = sealed_memfd(engine, views)
    try:
        token = send_fds(live.daemon.socket + ".fds", [fd], 10)
        req.allocations.add(
            id="a",
            size_bytes=views,
            device=types_pb2.Device(type=types_pb2.DEVICE_TYPE_CPU),
            shm_fd=types_pb2.ShmFdHandle(token=token, index=0),
        )
        for i in range(views):
            req.views.add(
                layer_name=f"{i:0{name_bytes}d}", allocation_id="a", transfer_group=0,
                cache_kind=types_pb2.CACHE_KIND_MLA, dtype="uint8", offset_bytes=i,
                block_len_bytes=1, block_stride_bytes=views, num_blocks=1,
            )  # fmt: skip
        try:
            live.registry.RegisterWorker(req, timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as err:
            return err.code(), err.details() or ""
        return Code.OK, ""
    finally:
        os.close(fd)


def test_a_corrupt_store_is_moved_aside_and_the_daemon_starts_empty(tmp_path: Path) -> None:
    """Garbage in the state database: the daemon starts and is healthy with no workers, the
    garbage is kept byte for byte as kvmapd.sqlite3.corrupt-<UTC time>, an error log line names
    both paths, and the new store works (a worker registers and survives a restart)."""
    state = tmp_path / "state"
    state.mkdir()
    garbage = os.urandom(16 * 4096)
    (state / DB_NAME).write_bytes(garbage)
    daemon = start_daemon(tmp_path / "d", "--state-dir", str(state), name="d")
    live = Live(daemon)
    worker = ShmWorker(live, "after-corruption", 8, seed=5)
    try:
        live.assert_healthy()
        assert live.snapshot().startswith('[{"daemon_instance"')
        assert "workers" not in json.loads(live.snapshot())[0]
        (aside,) = state.glob(f"{DB_NAME}.corrupt-*")
        assert aside.read_bytes() == garbage
        (line,) = [e for e in _log_events(daemon) if e["event"] == "state_store_corrupt"]
        assert line["level"] == "error"
        assert (line["path"], line["moved_to"]) == (str(state / DB_NAME), str(aside))
        worker.register()
        live.close()
        assert daemon.terminate() == 0, daemon.log()[-4000:]
        again = start_daemon(tmp_path / "d", "--state-dir", str(state), name="d")
        try:
            assert not [e for e in _log_events(again) if e["event"] == "state_store_corrupt"]
            assert list(state.glob(f"{DB_NAME}.corrupt-*")) == [aside]
        finally:
            assert again.terminate() == 0, again.log()[-4000:]
    finally:
        live.close()
        daemon.stop()
        worker.close()


def _assert_one_line_exit_2(result: subprocess.CompletedProcess[str], path: Path) -> str:
    """The daemon's one line (under ``--log-format json`` a JSON error record
    whose ``problem`` is the line), naming ``path``."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    record = json.loads(lines[0])
    assert record["level"] == "error" and record["event"] == "kvmapd_start_refused", record
    line = str(record["problem"])
    assert str(path) in line
    return line


def test_a_state_dir_under_a_regular_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """A state dir that cannot be created (its parent is a regular file): exit status 2, one line
    on stderr naming the path and why, no traceback."""
    (tmp_path / "file").write_text("")
    state = tmp_path / "file" / "state"
    result = subprocess.run(
        _kvmapd(tmp_path, "--state-dir", str(state)),
        check=False, capture_output=True, text=True, env=local_env(tmp_path), cwd=tmp_path,
        timeout=60,
    )  # fmt: skip
    line = _assert_one_line_exit_2(result, state)
    assert line == f"kvmapd: state directory {state} cannot be created: Not a directory"


def test_a_state_dir_the_daemon_cannot_write_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """The state dir exists but is immutable (``chattr +i``: not even root may create a file in
    it; the daemon runs as root here, so permission bits would not stop it): exit status 2, one
    line on stderr naming the directory, no traceback, and nothing was created in it."""
    state = tmp_path / "state"
    state.mkdir()
    try:
        _chattr("+i", state)
    except (OSError, subprocess.CalledProcessError) as err:
        pytest.skip(f"cannot make a directory immutable here: {err}")
    try:
        result = subprocess.run(
            _kvmapd(tmp_path, "--state-dir", str(state)),
            check=False, capture_output=True, text=True, env=local_env(tmp_path), cwd=tmp_path,
            timeout=60,
        )  # fmt: skip
    finally:
        _chattr("-i", state)
    line = _assert_one_line_exit_2(result, state)
    assert line == f"kvmapd: state directory {state} is not writable"
    assert list(state.iterdir()) == []


def test_a_full_disk_during_register_worker_is_resource_exhausted(tmp_path: Path) -> None:
    """Under RLIMIT_FSIZE the store cannot grow past 1 MiB: a small worker registers, a 2 MB
    registration is RESOURCE_EXHAUSTED with one line naming the store and the limit, the worker
    list and region maps are unchanged, and the daemon keeps serving (health, ListWorkers, a
    registration that fits)."""
    state = tmp_path / "state"
    daemon = _spawn_limited(tmp_path, FSIZE_LIMIT, "--state-dir", str(state))
    live = Live(daemon)
    small = ShmWorker(live, "small", 8, seed=6)
    again = ShmWorker(live, "small-again", 8, seed=7)
    try:
        small.register()
        before = live.snapshot()
        code, message = _register_big(live, "big", views=16_384, name_bytes=120)
        assert code is Code.RESOURCE_EXHAUSTED, (code, message)
        db = state / DB_NAME
        assert message == (
            f"state store {db} is full: {db}-wal reached the file-size limit "
            f"(RLIMIT_FSIZE {FSIZE_LIMIT} bytes)"
        )
        assert live.snapshot() == before
        live.assert_healthy()
        assert not live.crashes()
        again.register()
        assert len(json.loads(live.snapshot())[0]["workers"]) == 2
        live.close()
        assert daemon.terminate() == 0, daemon.log()[-4000:]
    finally:
        live.close()
        daemon.stop()
        small.close()
        again.close()


def _chattr(flag: str, *paths: Path) -> None:
    subprocess.run(["chattr", flag, *map(str, paths)], check=True, capture_output=True)


def test_a_store_made_read_only_under_the_daemon_is_unavailable(tmp_path: Path) -> None:
    """The store's WAL becomes immutable while the daemon runs: RegisterWorker is
    UNAVAILABLE with one line naming the store and the file it cannot write, nothing changed, and
    the daemon keeps serving; once writable again, the same registration works."""
    state = tmp_path / "state"
    daemon = start_daemon(tmp_path / "d", "--state-dir", str(state), name="d")
    live = Live(daemon)
    first = ShmWorker(live, "first", 8, seed=8)
    second = ShmWorker(live, "second", 8, seed=9)
    db = state / DB_NAME
    frozen: list[Path] = []
    try:
        first.register()
        before = live.snapshot()
        wal = Path(f"{db}-wal")  # where every transaction is written first
        try:
            _chattr("+i", wal)
        except (OSError, subprocess.CalledProcessError) as err:
            pytest.skip(f"cannot make the store immutable here: {err}")
        frozen = [wal]
        with pytest.raises(grpc.RpcError) as caught:
            second.register()
        assert caught.value.code() is Code.UNAVAILABLE, caught.value
        assert caught.value.details() == f"state store {db} is read-only: {db}-wal is not writable"
        assert live.snapshot() == before
        live.assert_healthy()
        assert not live.crashes()
        _chattr("-i", *frozen)
        frozen = []
        second.register()
        assert len(json.loads(live.snapshot())[0]["workers"]) == 2
        live.close()
        assert daemon.terminate() == 0, daemon.log()[-4000:]
    finally:
        if frozen:
            _chattr("-i", *frozen)
        live.close()
        daemon.stop()
        first.close()
        second.close()
