"""One daemon per socket path: an flock'ed lock file beside the socket that
holds the owner's PID.

The kernel releases an flock when its holder dies however it dies, so a
daemon that was killed (even with SIGKILL) leaves a free lock and a stale
socket file the next daemon may take over; a live one keeps the lock, and a
second daemon is refused before it touches the live socket.
"""

from __future__ import annotations

import fcntl
import os


class SocketInUse(Exception):
    """Another live process holds the socket path."""

    def __init__(self, socket: str, pid: str) -> None:
        super().__init__(
            f"socket {socket} is in use by another kvmapd (pid {pid or 'unknown'}); "
            "stop it or choose another --socket"
        )
        self.socket = socket
        self.pid = pid


class SocketLock:
    """Held from ``acquire`` until ``release`` (or the process's end)."""

    def __init__(self, socket: str) -> None:
        self.socket = socket
        self.path = f"{socket}.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o660)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            raise SocketInUse(self.socket, pid) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Let the lock go. The file stays: unlinking it could let two
        successors lock two different files under one name."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
