"""A daemon killed by a fatal signal (a native library's segfault, an
abort) leaves every thread's Python stack in its log, in the JSON log
format too, where fds 1 and 2 are a pipe: the dump goes to the real
stderr, ahead of UCX's own handler; and what native code wrote into the
pipe just before the death is still wrapped and logged by the wrapper
process, which outlives the daemon only that long."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from kvmap.tools.launch import start_daemon

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

# Bounds the wait for the log below, not a speed requirement.
HANG_GUARD_S = 30.0


@pytest.mark.parametrize("signum", [signal.SIGSEGV, signal.SIGABRT])
def test_a_fatal_signal_leaves_the_threads_stacks_in_the_log(
    tmp_path: Path, signum: signal.Signals
) -> None:
    """The dump names the signal and shows the event loop's thread inside
    the daemon's own code; the process still dies of a signal (the dump
    does not swallow it)."""
    daemon = start_daemon(tmp_path / "d", name="kvmapd")
    daemon.proc.send_signal(signum)
    rc = daemon.proc.wait(30)
    log = daemon.log()
    assert rc < 0, f"exit status {rc}\n{log[-3000:]}"
    name = "Segmentation fault" if signum == signal.SIGSEGV else "Aborted"
    assert f"Fatal Python error: {name}" in log, log[-3000:]
    dump = log[log.index("Fatal Python error") :]
    assert "Thread 0x" in dump
    assert "asyncio/base_events.py" in dump and "kvmap/daemon/cli/kvmapd.py" in dump


def test_native_lines_written_just_before_a_death_reach_the_log(tmp_path: Path) -> None:
    """What a native library writes to fd 2 right before the daemon dies
    (an abort's own message, UCX's last error) is wrapped and logged even
    though the daemon never runs again: here the daemon is frozen
    (SIGSTOP), a line goes into its fd 2 from outside, and it is killed.
    Its wrapper is a process of its own, which also ignores the signals
    meant for the daemon and ends once the daemon's end of the pipe is
    closed."""
    daemon = start_daemon(tmp_path / "d", name="kvmapd")
    pid = daemon.proc.pid
    os.kill(pid, signal.SIGSTOP)
    with open(f"/proc/{pid}/fd/2", "w") as native:  # the daemon's fd 2: the pipe
        native.write("E1202 12:00:00.000000 1 native.cc:1] the last native words\n")
    daemon.proc.kill()
    assert daemon.proc.wait(30) == -signal.SIGKILL
    deadline = time.monotonic() + HANG_GUARD_S
    while "the last native words" not in daemon.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = [json.loads(line) for line in daemon.log().splitlines() if "last native" in line]
    assert [(x["level"], x["logger"]) for x in lines] == [("error", "native")]


def test_the_wrapper_outlives_nothing(tmp_path: Path) -> None:
    """A daemon stopped as usual (SIGTERM) leaves no wrapper process behind:
    it was reaped, and every line reached the log before the daemon exited."""
    daemon = start_daemon(tmp_path / "d", name="kvmapd")
    children = Path(f"/proc/{daemon.proc.pid}/task/{daemon.proc.pid}/children")
    (wrapper,) = (int(c) for c in children.read_text().split())
    assert daemon.terminate() == 0
    assert not Path(f"/proc/{wrapper}").exists()
    assert json.loads(daemon.log().splitlines()[-1])["event"] == "kvmapd_stopped"
