"""A pull is no port scanner: the daemon's real peer client, handshaking with
targets on 127.0.0.1 that cannot answer, fails the same way for a closed port
(connection refused at once) and a silent one (a listener that never speaks
HTTP/2): UNAVAILABLE with one message, and neither before the connect
timeout."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import pytest

from kvmap.core.errors import KvmapError, Unavailable
from kvmap.core.geometry import WorkerKey
from kvmap.daemon.adapters.peer_client import UNREACHABLE, PeerClient

pytestmark = pytest.mark.timeout(60)

CONNECT_S = 0.5


@pytest.fixture
def closed_port() -> int:
    """A port nothing listens on (picked free, then given back)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A listener whose backlog completes TCP handshakes and that never sends a byte."""
    s = socket.create_server(("127.0.0.1", 0), backlog=16)
    yield int(s.getsockname()[1])
    s.close()


def _handshake(port: int) -> list[tuple[KvmapError, float]]:
    """Two handshakes in a row with ``127.0.0.1:port`` by one client: each
    one's error and seconds."""

    async def once(client: PeerClient) -> tuple[KvmapError, float]:
        started = time.monotonic()
        try:
            await client.handshake(f"127.0.0.1:{port}", WorkerKey("prefill"))
        except KvmapError as err:
            return err, time.monotonic() - started
        raise AssertionError("a handshake with nothing succeeded")

    async def main() -> list[tuple[KvmapError, float]]:
        client = PeerClient(CONNECT_S)
        try:
            return [await once(client), await once(client)]
        finally:
            await client.close()

    return asyncio.run(main())


def test_closed_and_silent_ports_read_alike(closed_port: int, silent_port: int) -> None:
    """Both first handshakes fail Unavailable with the same message (but for the target) and
    only once the connect timeout has passed: the closed port no sooner than the silent one
    (before, 2.70 s UNAVAILABLE against 3.01 s DEADLINE_EXCEEDED told them apart); the second
    handshake with each, its channel still unconnected, fails alike at once. The times are
    printed. (Pins PeerClient._connected.)"""
    closed = _handshake(closed_port)
    silent = _handshake(silent_port)
    print(f"\nclosed port: {[round(t, 2) for _, t in closed]} s, silent port: "
          f"{[round(t, 2) for _, t in silent]} s: {closed[0][0]}")  # fmt: skip
    for port, tries in ((closed_port, closed), (silent_port, silent)):
        for err, _ in tries:
            assert isinstance(err, Unavailable), err
            assert str(err) == f"remote daemon 127.0.0.1:{port}: {UNREACHABLE}"
    assert min(closed[0][1], silent[0][1]) >= CONNECT_S
    assert max(closed[1][1], silent[1][1]) < CONNECT_S
