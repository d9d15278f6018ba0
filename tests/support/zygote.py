"""Python processes forked from one that has imported their heavy modules:
test support, never shipped (the wheel holds ``kvmap`` only).

A stand-in worker spends ~2 of its CPU seconds importing torch, a vLLM
engine ~8 importing torch and vLLM, and the test suite starts hundreds of
the first and dozens of the second on two cores. A zygote imports them
once; each process is then a fork of it that runs ``python -m MODULE ARGS``
(or ``python SCRIPT ARGS``) with its own environment, directory and stdio,
as ``subprocess.Popen`` would have started it. Only the start differs: the
module runs as ``__main__`` in a process of its own, as it would have.

``tests/conftest.py`` has ``kvmap.tools.launch`` fork the processes it
starts from zygotes (``install``: ``launch.fork_from(zygote_for)``) unless
``ZYGOTE_ENV`` says otherwise.

The process is forked twice and reparented to the caller (which becomes a
child subreaper), so that the caller waits for it and reads its exit status
as from a Popen: ``ForkedProcess`` has the part of Popen's interface the
harness uses. Linux only (``PR_SET_CHILD_SUBREAPER``).

Wire (SOCK_SEQPACKET socketpair): the caller sends one JSON request
``{"argv", "env", "cwd"}`` with three fds (stdin, stdout, stderr) and gets
``{"pid": N}`` or ``{"error": "..."}``.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import json
import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

PR_SET_CHILD_SUBREAPER = 36
# Other than "1" (the default) in the test process's environment: every
# process is started afresh.
ZYGOTE_ENV = "KVMAP_LAUNCH_ZYGOTE"
# Set in every forked process's environment: what it runs may adapt to a
# parent that imported it already (engine_proc reconfigures vLLM's logging).
FORKED_ENV = "KVMAP_FORKED_FROM_ZYGOTE"
_MAX_MESSAGE = 1 << 20
_SPAWN_TIMEOUT_S = 120.0


class ForkedProcess:
    """A process forked by a zygote, reparented to this one."""

    def __init__(self, pid: int, stdin: IO[str], stdout: IO[str], args: list[str]) -> None:
        self.pid = pid
        self.stdin: IO[str] | None = stdin
        self.stdout: IO[str] | None = stdout
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid == self.pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """A running zygote that has imported ``preload`` (module names, with
    ``sys_path`` put first), started with ``env``; its own output goes to
    ``log``."""

    def __init__(
        self, preload: Sequence[str], env: dict[str, str], log: Path, sys_path: Sequence[str] = ()
    ) -> None:
        self.log = log
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        setup = json.dumps({"preload": list(preload), "sys_path": list(sys_path)})
        with open(log, "w") as out:
            # This file as a script: it is test support, not a module of kvmap.
            self.proc = subprocess.Popen(
                [sys.executable, __file__, str(theirs.fileno()), setup],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env=env,
            )
        theirs.close()
        ours.settimeout(_SPAWN_TIMEOUT_S)
        self._control = ours
        # One request and its answer at a time: threads start workers at once.
        self._lock = threading.Lock()

    def spawn(self, argv: list[str], env: dict[str, str], cwd: Path, stderr: Path) -> ForkedProcess:
        """``python *argv`` (``-m MODULE ...`` or ``SCRIPT ...``) in ``cwd``
        with exactly ``env``, stdin and stdout piped (text), stderr to the
        file ``stderr``."""
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err = os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            request = json.dumps({"argv": argv, "env": env, "cwd": str(cwd)}).encode()
            with self._lock:
                socket.send_fds(self._control, [request], [in_r, out_w, err])
                answer = json.loads(self._control.recv(_MAX_MESSAGE))
        finally:
            for fd in (in_r, out_w, err):
                os.close(fd)
        if "pid" not in answer:
            os.close(in_w)
            os.close(out_r)
            raise RuntimeError(f"the zygote could not fork {argv}: {answer}")
        stdin, stdout = os.fdopen(in_w, "w"), os.fdopen(out_r, "r")
        return ForkedProcess(answer["pid"], stdin, stdout, [sys.executable, *argv])

    def close(self) -> None:
        self._control.close()  # the zygote exits at end of file
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


# The test process's zygotes, by what they preloaded.
_zygotes: dict[tuple[tuple[str, ...], tuple[str, ...]], Zygote] = {}
_zygotes_lock = threading.Lock()


def zygote_for(
    preload: Sequence[str],
    sys_path: Sequence[str] = (),
    env_of: Callable[[Path], dict[str, str]] | None = None,
) -> Zygote:
    """This process's zygote that has imported ``preload`` (``sys_path``
    first), started at first use with ``env_of(its own folder)`` (default
    ``launch.local_env``): what ``launch.forker_for`` answers once
    ``install``ed."""
    from kvmap.tools import launch

    key = (tuple(preload), tuple(sys_path))
    with _zygotes_lock:
        if key not in _zygotes:
            home = Path(tempfile.mkdtemp(prefix="kvmap-zygote-"))
            env = (env_of or launch.local_env)(home)
            zygote = Zygote(preload, env, home / "zygote.log", sys_path)
            _zygotes[key] = zygote
            atexit.register(_close_zygote, zygote, home)
        return _zygotes[key]


def _close_zygote(zygote: Zygote, home: Path) -> None:
    """At exit: the zygote, then its folder (its log and what its
    children left in their TMPDIR), so test runs leave nothing in /tmp."""
    zygote.close()
    shutil.rmtree(home, ignore_errors=True)


def install() -> None:
    """Have ``kvmap.tools.launch`` fork the Python processes it starts from
    zygotes when ``ZYGOTE_ENV`` is "1" (the default)."""
    from kvmap.tools import launch

    if os.environ.get(ZYGOTE_ENV, "1") == "1":
        launch.fork_from(zygote_for)


# The zygote's side.


def _run(request: dict[str, Any], fds: list[int], control: socket.socket) -> None:
    """In the forked process: its stdio, environment and directory, then
    its module or script as ``__main__``; never returns."""
    code = 1
    try:
        control.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"], **{FORKED_ENV: "1"})
        os.chdir(request["cwd"])
        tempfile.tempdir = None  # TMPDIR is the process's own
        argv: list[str] = request["argv"]
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        # What the interpreter does at exit: the module's atexit hooks (a
        # span exporter's flush, say) run, then the buffered output goes.
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _fork(request: dict[str, Any], fds: list[int], control: socket.socket) -> int:
    """Fork twice: the new process's pid. The middle process exits at once,
    so the new one is reparented to the subreaper (the caller)."""
    pid_r, pid_w = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.close(pid_r)
        child = os.fork()
        if child == 0:
            os.close(pid_w)
            _run(request, fds, control)
        os.write(pid_w, str(child).encode())
        os._exit(0)
    os.close(pid_w)
    with os.fdopen(pid_r) as r:
        pid = int(r.read())
    os.waitpid(middle, 0)
    return pid


def serve(control: socket.socket) -> int:
    """Fork one process per request until the caller closes its end."""
    while True:
        msg, fds, _, _ = socket.recv_fds(control, _MAX_MESSAGE, 3)
        if not msg:
            return 0
        try:
            answer: dict[str, Any] = {"pid": _fork(json.loads(msg), fds, control)}
        except Exception as err:
            answer = {"error": f"{type(err).__name__}: {err}"}
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        control.send(json.dumps(answer).encode())


def main(argv: list[str]) -> int:
    control = socket.socket(fileno=int(argv[0]))
    setup = json.loads(argv[1])
    sys.path[:0] = setup["sys_path"]
    for name in setup["preload"]:
        importlib.import_module(name)
    return serve(control)


if __name__ == "__main__":
    # Run as a script: the import path starts where ``python -m`` would
    # start it, at the working directory, not at this folder.
    sys.path[0] = os.getcwd()
    sys.exit(main(sys.argv[1:]))
