"""Start kvmapd and demo-worker processes and talk to them: used by
``kvmapd demo``, the benchmarks and the integration tests. Each daemon gets a
Unix socket in a private directory and a free 127.0.0.1 port, and reports
where it listens through a ready file; every wait is bounded."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

import grpc

from kvmap.tools.netbed import Node, node_env
from kvmap.tools.peers import SESSION_ENV, peer_channel, read_secret, session_peer_secret

START_TIMEOUT_S = 60.0
PEER_SECRET_FLAG = "--peer-secret-file"


class Process(Protocol):
    """A started Python process, as the launchers use it: a
    ``subprocess.Popen`` with text pipes, or a process forked some other way
    (``Forker``) that offers the same part of its interface."""

    @property
    def pid(self) -> int: ...
    @property
    def stdin(self) -> IO[str] | None: ...
    @property
    def stdout(self) -> IO[str] | None: ...
    @property
    def returncode(self) -> int | None: ...
    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


class Forker(Protocol):
    """Starts ``python *argv`` as ``start_python`` does, by forking a
    process that has imported its modules already."""

    def spawn(self, argv: list[str], env: dict[str, str], cwd: Path, stderr: Path) -> Process: ...


# The forker for processes that import ``preload`` (``sys_path`` first),
# whose own environment ``env_of(its folder)`` gives (None: ``local_env``);
# or None, to start them afresh.
ForkerFor = Callable[
    [Sequence[str], Sequence[str], Callable[[Path], dict[str, str]] | None], Forker | None
]

# Every process started here, in order, so that a caller that failed halfway
# (a test assertion, an interrupted demo) can still reap what it started.
_started: list[subprocess.Popen[Any] | Process] = []
# The log file of each, by the same index: a failed test shows the logs of
# what it started (``started_logs``), a rare failure in CI included.
_started_logs: list[Path] = []
# Set by a caller that starts many Python processes (the test suite, whose
# zygotes are tests/support/zygote.py): they are forked from a process that
# has imported their modules instead of importing torch (~2 CPU-s a worker)
# or vLLM (~8 an engine) each. None: every process starts afresh, as in a
# demo or a benchmark.
_forker_for: ForkerFor | None = None


def _track(proc: subprocess.Popen[Any] | Process, log_path: Path) -> None:
    _started.append(proc)
    _started_logs.append(log_path)


def fork_from(factory: ForkerFor | None) -> None:
    """Start the Python processes of this process (``spawn_worker``, and
    callers of ``forker_for``) with the forkers ``factory`` gives; None:
    start them afresh."""
    global _forker_for  # noqa: PLW0603 -- one choice for the process
    _forker_for = factory


def forker_for(
    preload: Sequence[str],
    sys_path: Sequence[str] = (),
    env_of: Callable[[Path], dict[str, str]] | None = None,
) -> Forker | None:
    """The forker for processes that import ``preload`` (``fork_from``), or
    None: ``start_python`` starts them afresh."""
    return None if _forker_for is None else _forker_for(preload, sys_path, env_of)


def start_python(
    argv: list[str],
    env: dict[str, str],
    cwd: Path,
    log_path: Path,
    forker: Forker | None,
    *,
    node: Node | None = None,
) -> subprocess.Popen[str] | Process:
    """``python *argv`` (``-m MODULE ...`` or ``SCRIPT ...``) in ``cwd``
    with ``env``, stdin and stdout piped (text), stderr to ``log_path``:
    forked by ``forker`` when there is one (``forker_for``), or started
    afresh, inside a test bed's ``node`` if one is given (a namespace is
    entered at exec)."""
    if forker is not None and node is None:
        return forker.spawn(argv, env, cwd, log_path)
    command = [sys.executable, *argv]
    with open(log_path, "w") as log:
        return subprocess.Popen(
            node.argv(command) if node is not None else command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
            cwd=cwd,
        )


def started_count() -> int:
    """A mark for ``kill_started(since=...)``."""
    return len(_started)


def started_logs(since: int = 0) -> list[Path]:
    """The log files of the processes started through this module since
    the mark (``started_count``), in start order."""
    return _started_logs[since:]


def kill_started(since: int = 0) -> int:
    """Kill the processes started through this module since the mark that
    still run; returns how many there were."""
    alive = [p for p in _started[since:] if p.poll() is None]
    for p in alive:
        p.kill()
    for p in alive:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(10)
    return len(alive)


atexit.register(kill_started)


def local_env(tmp: Path) -> dict[str, str]:
    """Environment of a child process that must stay on this machine: UCX
    listens on loopback only (and starts without its memory hooks) and
    temporary files stay in ``tmp``."""
    env = dict(os.environ)
    env["UCX_NET_DEVICES"] = "lo"
    # What kvmapd sets for itself (adapters/nixl_agent.py): UCX's memory
    # hooks cost every NIXL agent ~0.4 s of CPU at its start, and neither
    # the daemons, the bench's raw agents nor vLLM's NixlConnector use them.
    env.setdefault("UCX_MEM_EVENTS", "no")
    env["TMPDIR"] = str(tmp)
    env["PYTHONUNBUFFERED"] = "1"
    env[SESSION_ENV] = str(session_peer_secret())
    return env


@dataclass
class DaemonProc:
    proc: subprocess.Popen[bytes]
    socket: str
    tcp_port: int
    instance: str
    agent: str
    workdir: Path
    log_path: Path
    # The peer secret it was started with ("" for none): what its TCP
    # callers of Peer and RegionMaps present.
    secret: str = ""
    # The address its TCP listener is on: loopback, or the address of the
    # test bed's node it runs on (``node``; kvmap.tools.netbed).
    host: str = "127.0.0.1"
    node: Node | None = None

    @property
    def unix_target(self) -> str:
        return f"unix://{self.socket}"

    @property
    def tcp_target(self) -> str:
        return f"{self.host}:{self.tcp_port}"

    def channel(self, tcp: bool = False, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A channel to the Unix socket, or to the TCP port presenting the
        daemon's peer secret as its peers do."""
        if tcp:
            return peer_channel(self.tcp_target, self.secret, options)
        return grpc.insecure_channel(self.unix_target, options=list(options))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(f"kvmapd did not exit on SIGTERM\n{self.log()}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM, and SIGKILL if it does not exit in time (cleanup paths)."""
        try:
            self.terminate(timeout)
        except AssertionError:
            self.kill()


def _with_peer_secret(extra: Sequence[str]) -> tuple[list[str], str]:
    """The flags, with this process's shared peer secret unless they name
    one (``--peer-secret-file ""``: none, the default configuration), and
    the secret the daemon will hold."""
    args = list(extra)
    if PEER_SECRET_FLAG in args:
        path = args[args.index(PEER_SECRET_FLAG) + 1]
        return args, read_secret(path) if path else ""
    path = str(session_peer_secret())
    return [*args, PEER_SECRET_FLAG, path], read_secret(path)


def _wait_ready(proc: subprocess.Popen[bytes], ready: Path, log_path: Path) -> dict[str, Any]:
    """The daemon's ready file, once it is written (bounded)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready.exists():
        if proc.poll() is not None:
            raise AssertionError(f"kvmapd exited {proc.returncode}:\n{log_path.read_text()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"kvmapd not ready in {START_TIMEOUT_S}s:\n{log_path.read_text()}")
        time.sleep(0.05)
    info: dict[str, Any] = json.loads(ready.read_text())
    return info


def start_daemon(
    workdir: Path,
    *extra: str,
    name: str = "kvmapd",
    listen: str = "127.0.0.1:0",
    node: Node | None = None,
) -> DaemonProc:
    """Start ``kvmapd serve`` in ``workdir``; it shares this process's peer
    secret with the other daemons started here unless ``extra`` names one.
    On a test bed's ``node`` it runs in the node's namespace, listens on the
    node's address (``listen`` names the port) and its UCX uses the node's
    link over TCP only."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = local_env(workdir)
    if node is not None:
        env = node_env(env)
        listen = node.hostport(int(listen.rpartition(":")[2]))
    flags, secret = _with_peer_secret(extra)
    sock = workdir / f"{name}.sock"
    ready = workdir / f"{name}.ready"
    log_path = workdir / f"{name}.log"
    # A ready file left by a killed predecessor must not pass for this one's.
    ready.unlink(missing_ok=True)
    args = [
        sys.executable,
        "-m",
        "kvmap.daemon.cli.kvmapd",
        "serve",
        "--socket",
        str(sock),
        "--listen",
        listen,
        "--ready-file",
        str(ready),
        "--log-format",
        "json",
        *flags,
    ]
    if node is not None:
        args = node.argv(args)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir)
    _track(proc, log_path)
    info = _wait_ready(proc, ready, log_path)
    return DaemonProc(
        proc=proc,
        socket=str(sock),
        tcp_port=int(info["tcp_port"]),
        instance=info["instance"],
        agent=info["agent"],
        workdir=workdir,
        log_path=log_path,
        secret=secret,
        host=node.address if node is not None else "127.0.0.1",
        node=node,
    )


@dataclass
class WorkerProc:
    """A ``kvmap.tools.demo_worker`` process driven by JSON lines."""

    proc: subprocess.Popen[str] | Process
    ready: dict[str, Any]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def region_map(self) -> dict[str, Any]:
        m: dict[str, Any] = self.ready["region_map"]
        return m

    def call(self, cmd: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = _readline(self.proc, timeout, self.log_path)
        out: dict[str, Any] = json.loads(line)
        return out

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        self._close_pipes()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._close_pipes()

    def _close_pipes(self) -> None:
        """A caller that starts thousands of workers (the churn soak) must
        not keep two pipes of each one that is gone."""
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


def _readline(proc: subprocess.Popen[str] | Process, timeout: float, log_path: Path) -> str:
    assert proc.stdout is not None
    # poll, not select: a caller with over 1,024 fds open (a long soak) is fine.
    poller = select.poll()
    poller.register(proc.stdout, select.POLLIN | select.POLLHUP)
    if not poller.poll(max(0.0, timeout) * 1000):
        raise TimeoutError(f"worker {proc.pid} gave no answer in {timeout}s:\n{_tail(log_path)}")
    line = proc.stdout.readline()
    if not line:
        proc.wait(10)
        raise RuntimeError(f"worker {proc.pid} exited {proc.returncode}:\n{_tail(log_path)}")
    return line


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def spawn_worker(
    daemon: DaemonProc,
    module: str,
    args: list[str],
    log_name: str,
    timeout: float = START_TIMEOUT_S,
) -> WorkerProc:
    """Start ``python -m module --socket <daemon's> *args`` (a JSON-lines
    worker, see ``json_lines``) and wait for its ready line; a worker that
    never gets ready is killed."""
    log_path = daemon.workdir / f"{log_name}.log"
    argv = ["-m", module, "--socket", daemon.socket, *args]
    env, cwd = local_env(daemon.workdir), daemon.workdir
    proc = start_python(argv, env, cwd, log_path, forker_for([module]))
    _track(proc, log_path)
    try:
        ready = json.loads(_readline(proc, timeout, log_path))
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise
    return WorkerProc(proc=proc, ready=ready, log_path=log_path)


def start_worker(
    daemon: DaemonProc,
    engine_id: str,
    *extra: str,
    timeout: float = START_TIMEOUT_S,
    module: str = "kvmap.tools.demo_worker",
) -> WorkerProc:
    """A demo worker (``module``: the CPU one, or ``gpu_demo_worker``)
    registered with ``daemon``."""
    return spawn_worker(
        daemon,
        module,
        ["--engine-id", engine_id, *extra],
        f"worker-{engine_id}",
        timeout,
    )
