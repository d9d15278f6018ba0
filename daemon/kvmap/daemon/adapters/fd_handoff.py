"""The fd hand-off socket: how a worker's shared-memory fds reach the daemon.

gRPC cannot carry file descriptors, so next to the gRPC socket the daemon
listens on a second Unix socket (``<grpc socket>.fds``, mode 0660). A worker
sends a batch of fds in one ``sendmsg`` (SCM_RIGHTS) and gets a token back;
``RegisterWorker`` then names each fd as ``ShmFdHandle{token, index}`` and the
registrar ``claim``s it. A message of no fds gets a *credential token*: the
sender's SO_PEERCRED under a secret, which Registry calls present (metadata
``kvmap-peer-token``) to say which uid is calling (gRPC cannot tell).

Wire protocol (SOCK_SEQPACKET, so each message arrives whole):

    worker -> daemon   b"kvmap-fds/1 <n>"  + SCM_RIGHTS carrying n fds
    daemon -> worker   b"OK <token>"  or  b"ERR <GRPC_STATUS_NAME> <message>"

``claim`` returns a *duplicate* of the stored fd, owned by the caller: a
registration that fails half-way can be retried with the same token. The
batch's own fds are closed by ``discard`` (call it once a registration has
succeeded) or when the token expires (default 120 s), so a worker that never
registers leaks nothing. The number of fds per batch and of pending tokens
are bounded, and so are the pending tokens and fds of each sending uid (so
one socket-group member cannot crowd out the others). The sender's
SO_PEERCRED (pid, uid, gid) is logged and kept with the batch.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import errno
import os
import secrets
import socket
import stat
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from kvmap.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)

log = structlog.get_logger("kvmapd.fd_handoff")

PROTOCOL = b"kvmap-fds/1"
SCM_MAX_FD = 253  # the kernel's limit of fds in one SCM_RIGHTS message
DEFAULT_TOKEN_TTL_S = 120.0
DEFAULT_MAX_FDS_PER_BATCH = SCM_MAX_FD
# Tokens are cheap (the fds are what is bounded tightly); a batch of no fds
# is a credential token, which each client process keeps one or two of.
DEFAULT_MAX_PENDING_TOKENS = 256
# Per sending uid (SO_PEERCRED), so that one socket-group member cannot fill
# the daemon's fd table or take every token: half the tokens, and fds for a
# TP-8 pod registering every layer's storage at once.
DEFAULT_MAX_PENDING_TOKENS_PER_UID = DEFAULT_MAX_PENDING_TOKENS // 2
DEFAULT_MAX_PENDING_FDS_PER_UID = 2048
DEFAULT_MAX_CONNECTIONS = 16
DEFAULT_IO_TIMEOUT_S = 5.0
_HEADER_MAX = 64
# accept() failures that say the process or system is short of something
# (descriptors above all): the listener waits and accepts again, from
# ACCEPT_PAUSE_S doubling up to ACCEPT_PAUSE_MAX_S, rather than end.
_ACCEPT_SHORTAGES = frozenset(
    {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED, errno.EPROTO}
)
ACCEPT_PAUSE_S = 0.05
ACCEPT_PAUSE_MAX_S = 1.0
_UCRED = struct.Struct("3i")


def fd_socket_path(grpc_socket_path: str) -> str:
    """Where the fd hand-off socket lives, given the gRPC Unix socket's path."""
    return f"{grpc_socket_path}.fds"


@dataclass(frozen=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


@dataclass
class FdBatch:
    token: str
    fds: list[int]
    peer: PeerCred
    expires_at: float
    received_at: float = field(default_factory=time.monotonic)


class FdHandoffServer:
    """The daemon side: an asyncio server keeping received fds under tokens."""

    def __init__(
        self,
        path: str,
        *,
        token_ttl_s: float = DEFAULT_TOKEN_TTL_S,
        max_fds_per_batch: int = DEFAULT_MAX_FDS_PER_BATCH,
        max_pending_tokens: int = DEFAULT_MAX_PENDING_TOKENS,
        max_pending_tokens_per_uid: int = DEFAULT_MAX_PENDING_TOKENS_PER_UID,
        max_pending_fds_per_uid: int = DEFAULT_MAX_PENDING_FDS_PER_UID,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        io_timeout_s: float = DEFAULT_IO_TIMEOUT_S,
    ) -> None:
        if not 1 <= max_fds_per_batch <= SCM_MAX_FD:
            raise ValueError(f"max_fds_per_batch must be in 1..{SCM_MAX_FD}")
        self.path = path
        self.token_ttl_s = token_ttl_s
        self.max_fds_per_batch = max_fds_per_batch
        self.max_pending_tokens = max_pending_tokens
        self.max_pending_tokens_per_uid = max_pending_tokens_per_uid
        self.max_pending_fds_per_uid = max_pending_fds_per_uid
        self.max_connections = max_connections
        self.io_timeout_s = io_timeout_s
        self._batches: dict[str, FdBatch] = {}
        self._sock: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._accepting: asyncio.Task[None] | None = None
        self._reaper: asyncio.Task[None] | None = None
        # Told (with the error) if the accept loop ever ends other than by
        # close(): the daemon then reports itself not serving.
        self.on_listener_dead: Callable[[BaseException], None] | None = None

    # -- lifecycle -------------------------------------------------------

    async def start(self) -> None:
        _remove_stale_socket(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.bind(self.path)
            # Before listen(): until then connects are refused, so there is no
            # window in which the socket is reachable with the umask's mode.
            os.chmod(self.path, 0o660)
            sock.listen(self.max_connections)
            sock.setblocking(False)
        except OSError as e:
            sock.close()
            raise Unavailable(f"cannot listen on fd hand-off socket {self.path}: {e}") from e
        self._sock = sock
        loop = asyncio.get_running_loop()
        self._accepting = loop.create_task(self._accept_loop(sock), name="fd-handoff-accept")
        self._accepting.add_done_callback(self._accept_loop_ended)
        self._reaper = loop.create_task(self._reap_loop(), name="fd-handoff-reaper")
        log.info("fd_handoff_listening", path=self.path, token_ttl_s=self.token_ttl_s)

    async def close(self) -> None:
        """Stop listening, close every pending fd and remove the socket file."""
        tasks = [t for t in (self._accepting, self._reaper, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._accepting = self._reaper = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        for token in list(self._batches):
            self.discard(token)

    # -- the registrar's side --------------------------------------------

    def claim(self, token: str, index: int, field: str = "") -> int:
        """A new fd (a dup; the caller owns it) for fd ``index`` of batch ``token``.

        ``field`` is the request path of the handle, e.g. ``allocations[0].shm_fd``.
        """
        prefix = f"{field}." if field else ""
        batch = self._live(token)
        if batch is None:
            raise NotFound(f"{prefix}token: unknown or expired fd hand-off token")
        if not 0 <= index < len(batch.fds):
            raise InvalidArgument(
                f"{prefix}index", f"index {index} outside the batch of {len(batch.fds)} fds"
            )
        try:
            return os.dup(batch.fds[index])
        except OSError as e:
            raise ResourceExhausted(f"{prefix}index: cannot duplicate fd: {e.strerror}") from e

    def peer(self, token: str) -> PeerCred:
        """Who sent batch ``token`` (pid, uid, gid from SO_PEERCRED)."""
        batch = self._live(token)
        if batch is None:
            raise NotFound("unknown or expired fd hand-off token")
        return batch.peer

    def discard(self, token: str) -> None:
        """Close batch ``token``'s fds now (unknown tokens are ignored)."""
        batch = self._batches.pop(token, None)
        if batch is not None:
            _close_all(batch.fds)

    def expire(self, now: float | None = None) -> int:
        """Close every batch whose token has expired; returns how many."""
        now = time.monotonic() if now is None else now
        expired = [t for t, b in self._batches.items() if b.expires_at <= now]
        for token in expired:
            log.info("fd_batch_expired", token=token[:8], fds=len(self._batches[token].fds))
            self.discard(token)
        return len(expired)

    @property
    def pending_tokens(self) -> int:
        return len(self._batches)

    @property
    def pending_fds(self) -> int:
        return sum(len(b.fds) for b in self._batches.values())

    def _live(self, token: str) -> FdBatch | None:
        batch = self._batches.get(token)
        if batch is not None and batch.expires_at <= time.monotonic():
            self.discard(token)
            return None
        return batch

    # -- the socket's side -----------------------------------------------

    async def _accept_loop(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        pause = ACCEPT_PAUSE_S
        while True:
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as e:
                if e.errno not in _ACCEPT_SHORTAGES:
                    raise
                # Out of descriptors (EMFILE): the connection waits in the
                # backlog until some are closed; retrying at once would spin.
                log.warning("fd_handoff_accept_failed", error=e.strerror, retry_in_s=pause)
                await asyncio.sleep(pause)
                pause = min(pause * 2, ACCEPT_PAUSE_MAX_S)
                continue
            pause = ACCEPT_PAUSE_S
            if len(self._tasks) >= self.max_connections:
                conn.close()  # the sender sees the connection end: Unavailable
                continue
            task = loop.create_task(self._serve(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _accept_loop_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return  # close()
        err = task.exception() or RuntimeError("the accept loop returned")
        log.error("fd_handoff_listener_dead", error=str(err) or type(err).__name__)
        self._accepting = None  # reported here; close() has nothing to await
        if self.on_listener_dead is not None:
            self.on_listener_dead(err)

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(min(self.token_ttl_s / 4, 1.0))
            self.expire()

    async def _serve(self, conn: socket.socket) -> None:
        fds: list[int] = []
        token: str | None = None
        try:
            conn.setblocking(False)
            async with asyncio.timeout(self.io_timeout_s):
                data, fds, truncated = await self._receive(conn)
                reply, token = self._accept_batch(conn, data, fds, truncated)
                if token is not None:
                    fds = []  # the batch owns them now
                await asyncio.get_running_loop().sock_sendall(conn, reply)
        except (TimeoutError, OSError) as e:
            if token is not None:
                self.discard(token)  # the worker never learnt its token
            log.warning("fd_handoff_connection_failed", error=str(e) or type(e).__name__)
        finally:
            _close_all(fds)
            conn.close()

    async def _receive(self, conn: socket.socket) -> tuple[bytes, list[int], bool]:
        loop = asyncio.get_running_loop()
        # Room for one fd more than allowed, so "too many" is told apart from
        # the kernel dropping fds for lack of room (MSG_CTRUNC).
        ancbufsize = socket.CMSG_SPACE((self.max_fds_per_batch + 1) * 4)
        while True:
            try:
                data, ancdata, flags, _ = conn.recvmsg(
                    _HEADER_MAX, ancbufsize, socket.MSG_CMSG_CLOEXEC
                )
                break
            except BlockingIOError:
                await _readable(loop, conn)
        fds: list[int] = []
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                arr = array.array("i")
                arr.frombytes(payload[: len(payload) - len(payload) % arr.itemsize])
                fds.extend(arr)
        return data, fds, bool(flags & socket.MSG_CTRUNC)

    def _accept_batch(
        self, conn: socket.socket, data: bytes, fds: list[int], truncated: bool
    ) -> tuple[bytes, str | None]:
        """Validate one received message; store it. Returns the reply and the
        token, or no token when the batch was rejected (its fds stay ours)."""
        proto, _, count = data.partition(b" ")
        if proto != PROTOCOL or not count.isdigit():
            return _err(
                "INVALID_ARGUMENT", f"expected {PROTOCOL.decode()} <n>, got {data[:32]!r}"
            ), None
        n = int(count)
        if n > self.max_fds_per_batch or len(fds) > self.max_fds_per_batch or truncated:
            return _err(
                "INVALID_ARGUMENT",
                f"batch of {max(n, len(fds))} fds exceeds the limit of {self.max_fds_per_batch}",
            ), None
        if n != len(fds):
            return _err("INVALID_ARGUMENT", f"header announces {n} fds, received {len(fds)}"), None
        self.expire()
        peer = _peer_cred(conn)
        self._make_room(peer.uid, n)
        full = self._over_limits(peer.uid, n)
        if full:
            return _err("RESOURCE_EXHAUSTED", f"{full}; register or retry later"), None
        token = secrets.token_hex(16)
        self._batches[token] = FdBatch(token, list(fds), peer, time.monotonic() + self.token_ttl_s)
        log.info(
            "fd_batch_received", token=token[:8], fds=n, pid=peer.pid, uid=peer.uid, gid=peer.gid
        )
        return b"OK " + token.encode(), token

    def _make_room(self, uid: int, n: int) -> None:
        """A credential token (no fds) only says which uid holds it, and a
        client fetches a fresh one whenever it is refused: rather than
        refuse a uid its next token or batch of ``n`` fds once its tokens
        fill its share, forget that uid's oldest credential tokens until
        the new one fits. fd batches are never dropped for it: a share full
        of them is refused as before."""
        while self._over_limits(uid, n):
            mine = [b for b in self._batches.values() if b.peer.uid == uid and not b.fds]
            if not mine:
                return
            oldest = min(mine, key=lambda b: b.received_at)
            del self._batches[oldest.token]

    def _over_limits(self, uid: int, n: int) -> str:
        """Which pending limit a batch of ``n`` fds from ``uid`` would break ("" if none)."""
        if len(self._batches) >= self.max_pending_tokens:
            return (
                f"{len(self._batches)} fd batches already pending (limit {self.max_pending_tokens})"
            )
        mine = [b for b in self._batches.values() if b.peer.uid == uid]
        if len(mine) >= self.max_pending_tokens_per_uid:
            return (
                f"uid {uid} has {len(mine)} fd batches pending (limit"
                f" {self.max_pending_tokens_per_uid} per uid)"
            )
        fds = sum(len(b.fds) for b in mine)
        if fds + n > self.max_pending_fds_per_uid:
            return (
                f"uid {uid} has {fds} fds pending and sends {n} (limit"
                f" {self.max_pending_fds_per_uid} per uid)"
            )
        return ""


def _err(status: str, message: str) -> bytes:
    log.warning("fd_batch_rejected", status=status, reason=message)
    return f"ERR {status} {message}".encode()


def _peer_cred(conn: socket.socket) -> PeerCred:
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return PeerCred(pid, uid, gid)


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    fut: asyncio.Future[None] = loop.create_future()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    loop.add_reader(sock.fileno(), ready)
    try:
        await fut
    finally:
        loop.remove_reader(sock.fileno())


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _remove_stale_socket(path: str) -> None:
    """A previous daemon's socket file is removed; a live daemon's is not."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise FailedPrecondition(f"fd hand-off path {path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        os.unlink(path)  # nobody listens: left over from a crash
        return
    except OSError as e:
        raise FailedPrecondition(f"fd hand-off path {path} is in use: {e}") from e
    finally:
        probe.close()
    raise Unavailable(f"another process is already listening on {path}")
