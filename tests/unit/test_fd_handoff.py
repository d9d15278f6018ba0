"""The fd hand-off socket end to end: a real asyncio server in this process,
the worker-side client sending real memfds over SCM_RIGHTS."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from kvmap.client import errors as client_errors
from kvmap.client.fd_handoff import fd_socket_path, send_fds
from kvmap.daemon.adapters.fd_handoff import FdHandoffServer
from kvmap.daemon.core.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable

pytestmark = pytest.mark.timeout(30)
T = TypeVar("T")


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    # Short path: a Unix socket path must fit in 108 bytes.
    with tempfile.TemporaryDirectory(prefix="kvfd", dir="/tmp") as d:
        yield Path(d)


def _open_fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd")}


def _memfds(n: int) -> list[int]:
    fds = []
    for i in range(n):
        fd = os.memfd_create(f"kv{i}")
        os.ftruncate(fd, 4096 * (i + 1))
        fds.append(fd)
    return fds


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _serve(path: Path, body: Callable[[FdHandoffServer], Awaitable[T]], **kw: Any) -> T:
    """Run ``body`` against a started server, then close it."""

    async def main() -> T:
        server = FdHandoffServer(str(path), **kw)
        await server.start()
        try:
            return await body(server)
        finally:
            await server.close()

    return asyncio.run(main())


async def _send(path: Path, fds: list[int], timeout: float = 5.0) -> str:
    # The client is synchronous (it runs in the worker); keep the loop free.
    return await asyncio.to_thread(send_fds, str(path), fds, timeout)


def test_token_flow(sock_dir: Path) -> None:
    path = sock_dir / "kvmapd.sock.fds"
    worker_fds = _memfds(3)
    baseline = _open_fds()

    async def body(server: FdHandoffServer) -> None:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
        token = await _send(path, worker_fds)
        assert len(token) == 32 and int(token, 16) >= 0
        assert server.pending_tokens == 1 and server.pending_fds == 3
        assert server.peer(token).pid == os.getpid()
        assert server.peer(token).uid == os.getuid()
        for i, fd in enumerate(worker_fds):
            mine = server.claim(token, i, "allocations[0].shm_fd")
            try:
                # The same object as the worker's, and this copy is ours to close.
                assert os.fstat(mine).st_ino == os.fstat(fd).st_ino
                assert os.fstat(mine).st_size == 4096 * (i + 1)
                assert mine not in worker_fds
            finally:
                os.close(mine)
        # Claiming again works (a failed registration may retry) until discarded.
        os.close(server.claim(token, 0))
        server.discard(token)
        assert server.pending_fds == 0
        with pytest.raises(NotFound, match=r"^allocations\[0\]\.shm_fd\.token: unknown"):
            server.claim(token, 0, "allocations[0].shm_fd")

    try:
        _serve(path, body)
        assert not path.exists()  # close() removes the socket file
        assert _open_fds() == baseline  # every received fd was closed
    finally:
        _close(worker_fds)


def test_unknown_token_and_bad_index(sock_dir: Path) -> None:
    path = sock_dir / "s.fds"
    fds = _memfds(2)

    async def body(server: FdHandoffServer) -> None:
        with pytest.raises(NotFound, match="unknown or expired"):
            server.claim("0" * 32, 0, "allocations[1].shm_fd")
        token = await _send(path, fds)
        with pytest.raises(InvalidArgument) as err:
            server.claim(token, 2, "allocations[1].shm_fd")
        assert err.value.field == "allocations[1].shm_fd.index"
        assert err.value.problem == "index 2 outside the batch of 2 fds"

    try:
        _serve(path, body)
    finally:
        _close(fds)


def test_tokens_expire_and_their_fds_are_closed(sock_dir: Path) -> None:
    path = sock_dir / "s.fds"
    fds = _memfds(2)

    async def body(server: FdHandoffServer) -> None:
        await asyncio.to_thread(lambda: None)  # start the thread pool before the baseline
        baseline = _open_fds()
        token = await _send(path, fds)
        assert _open_fds() - baseline  # the daemon holds copies
        await asyncio.sleep(0.6)  # the reaper runs every ttl/4
        assert server.pending_tokens == 0
        assert _open_fds() == baseline
        with pytest.raises(NotFound):
            server.claim(token, 0)

    try:
        _serve(path, body, token_ttl_s=0.2)
    finally:
        _close(fds)


def test_too_many_fds_in_one_batch(sock_dir: Path) -> None:
    path = sock_dir / "s.fds"
    fds = _memfds(5)
    baseline = _open_fds()

    async def body(server: FdHandoffServer) -> None:
        with pytest.raises(client_errors.InvalidArgument, match="batch of 5 fds exceeds the limit"):
            await _send(path, fds)
        assert server.pending_tokens == 0
        await _send(path, fds[:4])  # at the limit is fine

    try:
        _serve(path, body, max_fds_per_batch=4)
        assert _open_fds() == baseline
    finally:
        _close(fds)


def test_too_many_pending_tokens(sock_dir: Path) -> None:
    path = sock_dir / "s.fds"
    fds = _memfds(1)

    async def body(server: FdHandoffServer) -> None:
        first = await _send(path, fds)
        await _send(path, fds)
        with pytest.raises(client_errors.ResourceExhausted, match="2 fd batches already pending"):
            await _send(path, fds)
        server.discard(first)
        await _send(path, fds)

    try:
        _serve(path, body, max_pending_tokens=2)
    finally:
        _close(fds)


def test_client_errors_without_a_daemon(sock_dir: Path) -> None:
    fds = _memfds(1)
    try:
        with pytest.raises(client_errors.Unavailable, match="kvmapd is not running"):
            send_fds(str(sock_dir / "nobody.fds"), fds, 1.0)
        with pytest.raises(client_errors.InvalidArgument, match="no fds"):
            send_fds(str(sock_dir / "nobody.fds"), [], 1.0)
    finally:
        _close(fds)
    assert fd_socket_path("/run/kvmap/kvmapd.sock") == "/run/kvmap/kvmapd.sock.fds"


def test_client_bad_fd(sock_dir: Path) -> None:
    path = sock_dir / "s.fds"
    fd = 1_000_000  # above any open fd: EBADF

    async def body(server: FdHandoffServer) -> None:
        with pytest.raises(client_errors.InvalidArgument, match="cannot send fds"):
            await _send(path, [fd])
        assert server.pending_tokens == 0

    _serve(path, body)


def test_garbage_message_is_rejected(sock_dir: Path) -> None:
    path = sock_dir / "s.fds"

    async def body(server: FdHandoffServer) -> None:
        def talk() -> bytes:
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
                s.settimeout(5)
                s.connect(str(path))
                s.send(b"hello")
                return s.recv(4096)

        reply = await asyncio.to_thread(talk)
        assert reply.startswith(b"ERR INVALID_ARGUMENT expected kvmap-fds/1 <n>")
        assert server.pending_tokens == 0

    _serve(path, body)


def test_stale_socket_is_replaced_and_live_one_is_not(sock_dir: Path) -> None:
    path = sock_dir / "s.fds"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stale.bind(str(path))
    stale.close()  # a crashed daemon's leftover file

    async def body(server: FdHandoffServer) -> None:
        second = FdHandoffServer(str(path))
        with pytest.raises(Unavailable, match="already listening"):
            await second.start()
        fds = _memfds(1)
        try:
            await _send(path, fds)  # the first server still works
        finally:
            _close(fds)

    _serve(path, body)

    path.write_text("not a socket")
    with pytest.raises(FailedPrecondition, match="not a socket"):
        _serve(path, lambda s: asyncio.sleep(0))
