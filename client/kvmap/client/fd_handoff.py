"""Worker side of the fd hand-off socket (see ``kvmap.daemon.adapters.fd_handoff``).

gRPC cannot carry file descriptors: the worker sends its shared-memory fds
in one ``sendmsg`` (SCM_RIGHTS) over ``<grpc socket>.fds`` and gets a token
that its ``RegisterWorker`` request then names in ``ShmFdHandle{token, index}``.

Wire protocol (SOCK_SEQPACKET):

    worker -> daemon   b"kvmap-fds/1 <n>"  + SCM_RIGHTS carrying n fds
    daemon -> worker   b"OK <token>"  or  b"ERR <GRPC_STATUS_NAME> <message>"

A message of no fds gets a credential token (``send_credentials``).
The fds are duplicated into the daemon by the kernel; the worker keeps (and
must not close before registering) its own. Imports nothing from the daemon.
"""

from __future__ import annotations

import array
import fcntl
import os
import socket
from collections.abc import Sequence

from kvmap.client.errors import from_status
from kvmap.core.errors import DeadlineExceeded, InvalidArgument, Unavailable

PROTOCOL = b"kvmap-fds/1"
SCM_MAX_FD = 253  # the kernel's limit of fds in one SCM_RIGHTS message
_REPLY_MAX = 4096
# The gRPC metadata key of a credential token (``send_credentials``).
PEER_TOKEN_METADATA = "kvmap-peer-token"
# Seals every memfd for the daemon carries: no shrinking (the daemon's
# mapping would fault with SIGBUS, and it refuses an fd without this seal), no
# growing, and no further seals (nobody may seal writes away from the worker).
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def sealed_memfd(name: str, size: int) -> int:
    """A new memfd of ``size`` bytes that can never shrink or grow (the
    caller owns the fd): what a worker hands the daemon."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def is_sealed(fd: int) -> bool:
    """Whether the object behind ``fd`` can no longer shrink."""
    try:
        return bool(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK)
    except OSError:  # EINVAL: a file that takes no seals at all
        return False


def fd_socket_path(grpc_socket_path: str) -> str:
    """Where the daemon's fd hand-off socket lives, given its gRPC socket's path."""
    return f"{grpc_socket_path}.fds"


def send_fds(socket_path: str, fds: Sequence[int], timeout: float) -> str:
    """Send ``fds`` to the daemon in one message; return the token for them.

    Raises ``Unavailable`` when no daemon listens at ``socket_path``,
    ``DeadlineExceeded`` after ``timeout`` seconds, ``InvalidArgument`` for a
    bad fd list, and the daemon's own status (``ResourceExhausted`` when too
    many batches are pending, ...) when it rejects the batch.
    """
    if not fds:
        raise InvalidArgument("", "no fds to send")
    return _send(socket_path, fds, timeout)


def send_credentials(socket_path: str, timeout: float) -> str:
    """A credential token: a message of no fds, which the daemon answers with
    a token bound to this process's uid (SO_PEERCRED). Registry calls present
    it as metadata ``PEER_TOKEN_METADATA``: gRPC does not tell the daemon
    who calls, and a worker's calls are honoured only from the uid that
    registered it."""
    return _send(socket_path, (), timeout)


def credential_metadata(grpc_socket_path: str, timeout: float = 5.0) -> tuple[tuple[str, str]]:
    """gRPC metadata for raw Registry calls to the daemon at
    ``grpc_socket_path``: a fresh credential token (valid 120 s)."""
    token = send_credentials(fd_socket_path(grpc_socket_path), timeout)
    return ((PEER_TOKEN_METADATA, token),)


def _send(socket_path: str, fds: Sequence[int], timeout: float) -> str:
    if len(fds) > SCM_MAX_FD:
        raise InvalidArgument("", f"{len(fds)} fds in one batch; at most {SCM_MAX_FD}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(socket_path)
        except (FileNotFoundError, ConnectionRefusedError) as e:
            raise Unavailable(
                f"kvmapd is not running: nothing listens on fd hand-off socket {socket_path}"
                f" ({e.strerror})"
            ) from e
        header = PROTOCOL + b" %d" % len(fds)
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        try:
            sock.sendmsg([header], rights)
        except OSError as e:
            if isinstance(e, TimeoutError):
                raise
            # EBADF: one of the fds is not open in this process.
            raise InvalidArgument("", f"cannot send fds {list(fds)}: {e.strerror}") from e
        reply = sock.recv(_REPLY_MAX)
    except TimeoutError as e:
        raise DeadlineExceeded(f"fd hand-off to {socket_path}: no reply in {timeout}s") from e
    except OSError as e:
        raise Unavailable(f"fd hand-off to {socket_path} failed: {e}") from e
    finally:
        sock.close()
    return _parse_reply(reply, socket_path)


def _parse_reply(reply: bytes, socket_path: str) -> str:
    if reply.startswith(b"OK "):
        return reply[3:].decode("ascii").strip()
    if reply.startswith(b"ERR "):
        status, _, message = reply[4:].decode("utf-8", "replace").partition(" ")
        raise from_status(status, f"fd hand-off rejected: {message}")
    if not reply:
        raise Unavailable(f"kvmapd closed the fd hand-off connection at {socket_path}")
    raise Unavailable(f"unexpected fd hand-off reply from {socket_path}: {reply[:64]!r}")
