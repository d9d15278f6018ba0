"""The fd hand-off socket's accept loop, with a real asyncio server in this
process and the worker's real client: it waits out a process that has run
out of descriptors (EMFILE) and accepts again once some are free; a loop
that ends anyway says so (logged at error, ``on_listener_dead``)."""

from __future__ import annotations

import asyncio
import errno
import os
import resource
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from kvmap.client.fd_handoff import send_fds
from kvmap.daemon.adapters.fd_handoff import FdHandoffServer

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def sock_path() -> Iterator[str]:
    # Short path: a Unix socket path must fit in 108 bytes.
    with tempfile.TemporaryDirectory(prefix="kvfd", dir="/tmp") as d:
        yield str(Path(d) / "kvmapd.sock.fds")


class Exhausted:
    """This process out of descriptors: the soft RLIMIT_NOFILE just above the
    highest fd open, every lower free number taken by /dev/null. ``free``
    gives ``n`` back; leaving closes the rest and restores the limit."""

    def __enter__(self) -> Exhausted:
        self._limits = resource.getrlimit(resource.RLIMIT_NOFILE)
        highest = max(int(n) for n in os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 1, self._limits[1]))
        self.fillers: list[int] = []
        while True:
            try:
                self.fillers.append(os.open("/dev/null", os.O_RDONLY))
            except OSError as err:
                assert err.errno == errno.EMFILE, err
                return self

    def free(self, n: int) -> None:
        for _ in range(n):
            os.close(self.fillers.pop())

    def __exit__(self, *exc: object) -> None:
        self.free(len(self.fillers))
        resource.setrlimit(resource.RLIMIT_NOFILE, self._limits)


def test_the_accept_loop_waits_out_a_shortage_of_descriptors(sock_path: str) -> None:
    """A worker connects while the daemon's process has no descriptor left: accept() fails
    EMFILE, the loop logs fd_handoff_accept_failed and waits instead of ending, and once
    descriptors are free again it accepts the waiting worker, whose batch arrives under a
    token (its memfd claimable). (Pins the EMFILE back-off of FdHandoffServer._accept_loop;
    without it the loop died and the worker never heard back.)"""
    memfd = os.memfd_create("kv")

    async def main() -> tuple[str, list[dict[str, Any]], int]:
        server = FdHandoffServer(sock_path)
        await server.start()
        try:
            with capture_logs() as logs:
                with Exhausted() as fds:
                    # One fd for the worker's socket; the daemon has none to accept it.
                    fds.free(1)
                    sending = asyncio.create_task(
                        asyncio.to_thread(send_fds, sock_path, [memfd], 10.0)
                    )
                    while not any(e["event"] == "fd_handoff_accept_failed" for e in logs):
                        await asyncio.sleep(0.05)
                token = await sending
            claimed = server.claim(token, 0)
            os.close(claimed)
            return token, logs, claimed
        finally:
            await server.close()

    try:
        token, logs, claimed = asyncio.run(main())
    finally:
        os.close(memfd)
    assert token and claimed >= 0
    failed = [e for e in logs if e["event"] == "fd_handoff_accept_failed"]
    assert failed[0]["error"] == os.strerror(errno.EMFILE), failed
    assert not [e for e in logs if e["event"] == "fd_handoff_listener_dead"]


def test_a_loop_that_ends_is_logged_and_reported(sock_path: str) -> None:
    """When accept() fails for a reason no wait cures (EBADF, from the event loop's
    sock_accept, the one part faked here), the loop ends, fd_handoff_listener_dead is logged at
    error and on_listener_dead hears the error (the daemon turns its health NOT_SERVING on it)."""
    heard: list[BaseException] = []

    async def broken_accept(sock: Any) -> Any:
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))

    async def main() -> list[dict[str, Any]]:
        asyncio.get_running_loop().sock_accept = broken_accept  # type: ignore[method-assign]
        server = FdHandoffServer(sock_path)
        server.on_listener_dead = heard.append
        with capture_logs() as logs:
            await server.start()
            try:
                while not heard:
                    await asyncio.sleep(0.02)
            finally:
                await server.close()
        return logs

    logs = asyncio.run(main())
    assert isinstance(heard[0], OSError), heard
    dead = [e for e in logs if e["event"] == "fd_handoff_listener_dead"]
    assert dead and dead[0]["log_level"] == "error", logs
