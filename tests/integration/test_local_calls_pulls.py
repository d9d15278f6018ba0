"""Workers pull through the decode daemon's local calls socket when it has
one, and over gRPC when it does not (``--no-local-calls``, or a daemon that
predates the socket): real daemons in their own processes, stand-in workers
whose ``kvmap.client`` chooses, real NIXL over UCX on loopback, every block
verified byte for byte."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvmap.core.config import LOCAL_CALLS_SUFFIX
from kvmap.tools.grants import granted
from kvmap.tools.launch import DaemonProc, WorkerProc, start_daemon, start_worker

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

BLOCKS = 32
GEO = ("--blocks", str(BLOCKS), "--block-tokens", "32", "--mla-layers", "3")


def _accepted(path: str) -> int:
    """Connections the daemon holds on the Unix socket ``path`` (the
    kernel lists each accepted one under the listener's path)."""
    lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    # Columns: Num RefCount Protocol Flags Type St Inode Path. Flags has
    # __SO_ACCEPTCON (0x10000) on the listening socket only.
    return sum(
        1 for line in lines if line.endswith(" " + path) and not int(line.split()[3], 16) & 0x10000
    )


@contextlib.contextmanager
def _pair(
    tmp: Path, *decode_flags: str, prefill_flags: tuple[str, ...] = ()
) -> Iterator[tuple[DaemonProc, DaemonProc, WorkerProc, WorkerProc]]:
    with contextlib.ExitStack() as stack:
        prefill = start_daemon(tmp / "p", "--planner", "coalesce", *prefill_flags, name="p")
        stack.callback(prefill.stop)
        pw = start_worker(prefill, "prefill", *GEO, "--fill")
        stack.callback(pw.stop)
        decode = start_daemon(tmp / "d", "--planner", "coalesce", *decode_flags, name="d")
        stack.callback(decode.stop)
        dw = start_worker(decode, "decode", *GEO)
        stack.callback(dw.stop)
        yield prefill, decode, pw, dw


def _pulls(prefill_target: str, pw: WorkerProc, dw: WorkerProc, n: int) -> list[dict[str, Any]]:
    out = []
    for r in range(n):
        local = [(b * 7 + r) % BLOCKS for b in range(8)]
        remote = [(b * 5 + 3 * r) % BLOCKS for b in range(8)]
        cmd = {
            "cmd": "pull",
            "request_id": f"local-{r}",
            "remote_target": prefill_target,
            "remote_worker": {"engine_id": "prefill"},
            "groups": [{"group": 0, "local": local, "remote": remote}],
        }
        out.append(dw.call(granted(pw, cmd)))
    return out


def test_pulls_go_on_the_local_calls_socket_and_land(tmp_path: Path) -> None:
    """The decode daemon's ``<socket>.calls`` exists (0660); a worker's pulls
    land byte for byte, and the daemon holds two of the worker's connections
    on that socket: its Attach stream's, and one for all its pulls (the
    client used it, and kept one connection for them all)."""
    with _pair(tmp_path) as (prefill, decode, pw, dw):
        path = decode.socket + LOCAL_CALLS_SUFFIX
        assert Path(path).stat().st_mode & 0o777 == 0o660
        results = _pulls(prefill.tcp_target, pw, dw, 3)
        assert all(r["ok"] and r["bad_blocks"] == 0 for r in results), results
        assert _accepted(path) == 2


def test_without_the_socket_pulls_go_over_grpc(tmp_path: Path) -> None:
    """A decode daemon started with ``--no-local-calls`` has no such socket,
    and the same client's pulls land over gRPC."""
    with _pair(tmp_path, "--no-local-calls") as (prefill, decode, pw, dw):
        assert not Path(decode.socket + LOCAL_CALLS_SUFFIX).exists()
        results = _pulls(prefill.tcp_target, pw, dw, 2)
        assert all(r["ok"] and r["bad_blocks"] == 0 for r in results), results
