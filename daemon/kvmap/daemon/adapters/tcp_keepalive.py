"""Keepalive probes on every TCP connection the daemon holds, UCX's own
included, so that a peer whose node or link vanished without a FIN is
noticed and its connection closed.

Why it is needed: UCX (1.23, NIXL 1.5.1) sets ``SO_KEEPALIVE`` only on the
TCP connections it dials; the ones its listener accepts (every decode peer
that reads from this daemon dials in) get none. A peer whose link went
down, or whose node was powered off, never sends a FIN, so those sockets
stay ESTABLISHED for good, and UCX keeps the endpoint and the fd: measured
on a test bed, about three fds per vanished peer, never given back (2,288
after 2,000 churned peers, 40 % of them gone by a link failure). gRPC's own
keepalive pings cover only gRPC's connections.

What this does: a sweep lists the daemon's fds (``/proc/self/fd``), and
arms each TCP stream socket not yet seen with ``SO_KEEPALIVE``
(``idle_s`` of silence, then ``PROBES`` probes ``PROBE_INTERVAL_S`` apart)
and ``TCP_USER_TIMEOUT`` (the same bound for data sent and never
acknowledged, which keepalive alone does not cover). The kernel then fails
the socket of a peer that stopped answering, UCX's own error path
(``ucx_error_handling_mode: peer``) fails the endpoint and closes it, and
the fd is back. The sockets are reached through a ``dup`` of the fd: the
options belong to the socket, so UCX's fd gets them; the duplicate is
closed at once. A live peer answers the probes from its kernel, however
busy or stopped (SIGSTOP) its process is: only a peer whose machine or
link is gone is cut.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import structlog

log = structlog.get_logger("kvmapd.tcp_keepalive")

PROBES = 3
PROBE_INTERVAL_S = 2
_FD_DIR = "/proc/self/fd"


@dataclass(frozen=True)
class Keepalive:
    """The probing of one socket: ``idle_s`` of silence, then ``PROBES``
    probes; a connection whose peer is gone is closed ``dead_after_s``
    after its last sign of life."""

    idle_s: int

    @property
    def dead_after_s(self) -> int:
        return self.idle_s + PROBES * PROBE_INTERVAL_S

    def arm(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, self.idle_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, PROBE_INTERVAL_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, PROBES)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, self.dead_after_s * 1000)


def _is_connection(sock: socket.socket) -> bool:
    """A TCP stream over IPv4 or IPv6 that is not a listener."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
        return False
    return not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)


class HalfOpenGuard:
    """Arms the daemon's TCP connections (``sweep``, called every few
    seconds); each socket is looked at once (by its inode)."""

    def __init__(self, keepalive: Keepalive, fd_dir: str = _FD_DIR) -> None:
        self.keepalive = keepalive
        self._fd_dir = fd_dir
        self._seen: set[str] = set()
        self.armed_total = 0

    def sweep(self) -> int:
        """Arm the TCP connections opened since the last sweep; how many."""
        sockets = self._sockets()
        armed = 0
        for link, fd in sockets.items():
            if link not in self._seen and self._arm(fd):
                armed += 1
        # Forget closed sockets: an inode number may come back.
        self._seen = set(sockets)
        self.armed_total += armed
        return armed

    def _sockets(self) -> dict[str, int]:
        """Open socket fds by their link ("socket:[inode]")."""
        out: dict[str, int] = {}
        try:
            names = os.listdir(self._fd_dir)
        except OSError:
            return out
        for name in names:
            try:
                link = os.readlink(f"{self._fd_dir}/{name}")
            except OSError:
                continue  # closed meanwhile
            if link.startswith("socket:["):
                out[link] = int(name)
        return out

    def _arm(self, fd: int) -> bool:
        """Arm the socket behind ``fd`` if it is a TCP connection. The fd may
        have been closed, or reused, since it was listed: then the socket
        now behind it is looked at, and arming any TCP connection is safe."""
        try:
            dup = os.dup(fd)
        except OSError:
            return False
        try:
            sock = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            return False
        with sock:  # closes the duplicate only
            try:
                if not _is_connection(sock):
                    return False
                self.keepalive.arm(sock)
            except OSError as err:  # reset meanwhile: nothing left to arm
                log.debug("keepalive_not_armed", fd=fd, error=str(err))
                return False
        return True
