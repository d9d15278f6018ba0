"""The half-open guard (adapters/tcp_keepalive.py) on real sockets of this
process: a sweep arms every TCP connection, accepted or dialled, IPv4 and
IPv6, with keepalive and a user timeout; it leaves listeners and Unix
sockets alone, looks at each socket once, and arms a connection made after
an earlier sweep on the next."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from kvmap.daemon.adapters.tcp_keepalive import PROBE_INTERVAL_S, PROBES, HalfOpenGuard, Keepalive


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as s:
        yield s


def _pair(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    dialled = socket.create_connection(listener.getsockname()[:2])
    accepted, _ = listener.accept()
    return dialled, accepted


def _armed(sock: socket.socket) -> tuple[int, int, int, int, int]:
    return (
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
    )


def test_a_sweep_arms_tcp_connections_and_nothing_else(listener: socket.socket) -> None:
    """Both ends of a loopback connection get SO_KEEPALIVE, the idle time, the probes and a
    user timeout of idle + probes x interval; the listener and a Unix socket pair keep
    their options; a second sweep arms nothing; a connection made later is armed by the
    next sweep."""
    keepalive = Keepalive(idle_s=7)
    guard = HalfOpenGuard(keepalive)
    dialled, accepted = _pair(listener)
    left, right = socket.socketpair()
    with dialled, accepted, left, right:
        assert _armed(accepted)[0] == 0  # what UCX's accepted sockets look like
        assert guard.sweep() >= 2
        expected = (1, 7, PROBE_INTERVAL_S, PROBES, (7 + PROBES * PROBE_INTERVAL_S) * 1000)
        assert _armed(dialled) == expected and _armed(accepted) == expected
        assert keepalive.dead_after_s == 7 + PROBES * PROBE_INTERVAL_S
        assert listener.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0
        assert left.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0
        assert guard.sweep() == 0
        later, later_accepted = _pair(listener)
        with later, later_accepted:
            assert _armed(later_accepted)[0] == 0
            assert guard.sweep() == 2
            assert _armed(later_accepted) == expected


def test_a_sweep_arms_ipv6_connections_too() -> None:
    """An accepted IPv6 connection (peers on IPv6 pod networks) is armed like an IPv4 one."""
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    try:
        server = socket.create_server(("::1", 0), family=socket.AF_INET6)
    except OSError as err:
        pytest.skip(f"no ::1 here: {err}")
    with server:
        dialled = socket.create_connection(server.getsockname()[:2])
        accepted, _ = server.accept()
        with dialled, accepted:
            HalfOpenGuard(Keepalive(idle_s=5)).sweep()
            assert _armed(accepted)[:2] == (1, 5)


def test_a_sweep_of_an_unreadable_fd_folder_arms_nothing(tmp_path: object) -> None:
    """Without /proc (a folder that does not exist) a sweep arms nothing and raises nothing."""
    assert HalfOpenGuard(Keepalive(idle_s=5), fd_dir="/nonexistent/fd").sweep() == 0
