"""A daemon killed by a fatal signal (a native library's segfault, an
abort) leaves every thread's Python stack in its log, in the JSON log
format too, where fds 1 and 2 are a pipe to a thread that dies with the
process: the dump goes to the real stderr, ahead of UCX's own handler."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from kvmap.tools.launch import start_daemon

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


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
