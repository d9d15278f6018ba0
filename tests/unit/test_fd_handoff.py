"""The fd hand-off socket end to end: a real asyncio server in this process,
the worker-side client sending real memfds over SCM_RIGHTS."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from kvmap.client.fd_handoff import fd_socket_path, send_credentials, send_fds
from kvmap.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from kvmap.daemon.adapters.fd_handoff import FdHandoffServer

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
    """Sent memfds come back under a token as the same files (new fds the
    caller owns), with the sender's credentials; discard closes them and the
    token is then unknown; close() removes the socket and leaks no fd."""
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
    """An unknown token is NotFound; an index outside the batch is an
    InvalidArgument naming the field and the batch size."""
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


def test_tokens_expire_at_their_ttl_and_their_fds_are_closed(sock_dir: Path) -> None:
    """With an explicit clock: a batch is kept before its token's ttl ends and
    expired (fds closed, token unknown) once it has, exactly once."""
    path = sock_dir / "s.fds"
    fds = _memfds(2)
    ttl = 60.0  # far beyond the test: only the explicit clock below expires it

    async def body(server: FdHandoffServer) -> None:
        await asyncio.to_thread(lambda: None)  # start the thread pool before the baseline
        baseline = _open_fds()
        sent_after = time.monotonic()
        token = await _send(path, fds)
        received_by = time.monotonic()
        assert _open_fds() - baseline  # the daemon holds copies
        assert server.expire(now=sent_after + ttl - 1.0) == 0
        assert server.pending_tokens == 1
        os.close(server.claim(token, 0))  # still claimable
        assert server.expire(now=received_by + ttl) == 1
        assert server.pending_tokens == 0
        assert _open_fds() == baseline
        with pytest.raises(NotFound):
            server.claim(token, 0)
        assert server.expire(now=received_by + 2 * ttl) == 0  # expired once

    try:
        _serve(path, body, token_ttl_s=ttl)
    finally:
        _close(fds)


def test_the_reaper_expires_tokens_by_itself(sock_dir: Path) -> None:
    """Nobody calls expire(): the server's own reaper closes an expired batch
    (the test waits for that event; its timeout is the hang guard)."""
    path = sock_dir / "s.fds"
    fds = _memfds(2)

    async def body(server: FdHandoffServer) -> None:
        await asyncio.to_thread(lambda: None)  # start the thread pool before the baseline
        baseline = _open_fds()
        token = await _send(path, fds)
        assert server.pending_tokens == 1
        while server.pending_tokens:  # pending_tokens itself expires nothing
            await asyncio.sleep(0.01)
        assert _open_fds() == baseline
        with pytest.raises(NotFound):
            server.claim(token, 0)

    try:
        _serve(path, body, token_ttl_s=0.2)
    finally:
        _close(fds)


def test_too_many_fds_in_one_batch(sock_dir: Path) -> None:
    """A batch above the limit is refused (nothing kept, nothing leaked); one
    at the limit is accepted."""
    path = sock_dir / "s.fds"
    fds = _memfds(5)
    baseline = _open_fds()

    async def body(server: FdHandoffServer) -> None:
        with pytest.raises(InvalidArgument, match="batch of 5 fds exceeds the limit"):
            await _send(path, fds)
        assert server.pending_tokens == 0
        await _send(path, fds[:4])  # at the limit is fine

    try:
        _serve(path, body, max_fds_per_batch=4)
        assert _open_fds() == baseline
    finally:
        _close(fds)


def test_too_many_pending_tokens(sock_dir: Path) -> None:
    """Beyond the pending-batch limit the client gets ResourceExhausted; once a
    batch is discarded, a new one is accepted."""
    path = sock_dir / "s.fds"
    fds = _memfds(1)

    async def body(server: FdHandoffServer) -> None:
        first = await _send(path, fds)
        await _send(path, fds)
        with pytest.raises(ResourceExhausted, match="2 fd batches already pending"):
            await _send(path, fds)
        server.discard(first)
        await _send(path, fds)

    try:
        _serve(path, body, max_pending_tokens=2)
    finally:
        _close(fds)


def test_credential_tokens_never_lock_their_uid_out(sock_dir: Path) -> None:
    """A uid that keeps fetching credential tokens (a client refetches one
    whenever a call is refused) gets each one, and its next fd batches get
    in too: its oldest credential tokens are forgotten to make room, never a
    pending fd batch; a uid whose share is full of fd batches is refused."""
    path = sock_dir / "s.fds"
    fds = _memfds(1)

    async def body(server: FdHandoffServer) -> None:
        batch = await _send(path, fds)
        credentials = [await asyncio.to_thread(send_credentials, str(path), 5.0) for _ in range(5)]
        assert server.pending_tokens == 3  # the batch and the two newest credential tokens
        server.peer(batch)  # still pending, with its fd
        for token in credentials[-2:]:
            server.peer(token)
        for token in credentials[:-2]:
            with pytest.raises(NotFound):
                server.peer(token)
        # A new fd batch takes the place of the oldest credential token left,
        # and with none left (the share is all fd batches) it is refused.
        second = await _send(path, fds)
        third = await _send(path, fds)
        for token in (batch, second, third):
            server.peer(token)
        with pytest.raises(NotFound):
            server.peer(credentials[-1])
        with pytest.raises(ResourceExhausted, match="fd batches pending"):
            await _send(path, fds)

    try:
        _serve(path, body, max_pending_tokens=8, max_pending_tokens_per_uid=3)
    finally:
        _close(fds)


def test_client_errors_without_a_daemon(sock_dir: Path) -> None:
    """Without a daemon the client says kvmapd is not running; an empty fd
    list is an InvalidArgument; the socket path derives from the gRPC one."""
    fds = _memfds(1)
    try:
        with pytest.raises(Unavailable, match="kvmapd is not running"):
            send_fds(str(sock_dir / "nobody.fds"), fds, 1.0)
        with pytest.raises(InvalidArgument, match="no fds"):
            send_fds(str(sock_dir / "nobody.fds"), [], 1.0)
    finally:
        _close(fds)
    assert fd_socket_path("/run/kvmap/kvmapd.sock") == "/run/kvmap/kvmapd.sock.fds"


def test_client_bad_fd(sock_dir: Path) -> None:
    """Sending a closed fd number is the client's InvalidArgument, and the
    server keeps nothing."""
    path = sock_dir / "s.fds"
    fd = 1_000_000  # above any open fd: EBADF

    async def body(server: FdHandoffServer) -> None:
        with pytest.raises(InvalidArgument, match="cannot send fds"):
            await _send(path, [fd])
        assert server.pending_tokens == 0

    _serve(path, body)


def test_garbage_message_is_rejected(sock_dir: Path) -> None:
    """A message that is not the hand-off protocol gets an INVALID_ARGUMENT
    reply and no batch is kept."""
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
    """A dead daemon's socket file is replaced; a live server's is not taken
    over (Unavailable) and keeps working; a non-socket file is refused."""
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
