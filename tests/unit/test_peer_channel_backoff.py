"""The channel a daemon keeps to a peer daemon tries a peer that is down
again within about a second, however long it has been down: pulls retrying
against a restarted (upgraded) owner must reach it soon after it is back,
not after gRPC's default backoff (1 s growing 1.6x per failure, up to two
minutes), during which the channel fails every call at once.

A real gRPC aio channel built with the peer client's options dials a real
listener on 127.0.0.1 that accepts each connection and closes it (a peer
that is not serving): every accept is one connection attempt."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from typing import Any

import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmap.daemon.adapters.peer_client import PEER_CHANNEL_OPTIONS

pytestmark = pytest.mark.timeout(60)

WINDOW_S = 4.0


def connection_attempts(options: list[tuple[str, Any]]) -> int:
    """Connection attempts a channel with ``options`` makes in ``WINDOW_S``
    while its caller keeps calling (every 50 ms) a peer that is not serving."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.1)  # a blocked accept() would not see the close
    port = listener.getsockname()[1]
    accepted: list[float] = []
    over = threading.Event()

    def accept() -> None:
        while not over.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            accepted.append(time.monotonic())
            conn.close()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()

    async def call_for_the_window() -> None:
        channel = aio.insecure_channel(f"127.0.0.1:{port}", options=options)
        stub = health_pb2_grpc.HealthStub(channel)
        end = time.monotonic() + WINDOW_S
        while time.monotonic() < end:
            with contextlib.suppress(aio.AioRpcError):  # every call fails: not serving
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=1, wait_for_ready=False)
            await asyncio.sleep(0.05)
        await channel.close()

    try:
        asyncio.run(call_for_the_window())
    finally:
        over.set()
        thread.join(5)
        listener.close()
    return len(accepted)


def test_a_peer_that_is_down_is_tried_again_within_a_second() -> None:
    """At most ~1 s between attempts (100 ms doubling-ish, capped at 1 s):
    about 8 attempts in 4 s, where gRPC's defaults make 3 (at 0, ~1 and
    ~2.6 s). The bound leaves room for a loaded machine."""
    attempts = connection_attempts(list(PEER_CHANNEL_OPTIONS))
    assert attempts >= 6, attempts
    defaults = connection_attempts([PEER_CHANNEL_OPTIONS[0]])
    assert defaults <= 4, defaults  # what the options are for, on this gRPC
