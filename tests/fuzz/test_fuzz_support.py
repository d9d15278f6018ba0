"""The fuzzers' hang rule against a real in-process gRPC server: a call that
the client's own deadline ends is a hang (the fuzz test fails), while a
DEADLINE_EXCEEDED the server answers itself is a status like any other,
however long either took."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from fuzz_support import DEADLINE, call, call_stream

pytestmark = pytest.mark.timeout(30)

# What kvmapd answers when a transfer runs into its own timeout_ms, and when
# it passes on a peer's DEADLINE_EXCEEDED.
DAEMON_DEADLINES = [
    "transfer fz: no completion in 0.001s",
    "remote daemon 127.0.0.1:1: DEADLINE_EXCEEDED: Deadline Exceeded",
]


class Server:
    """Methods that never answer (until released), or answer DEADLINE_EXCEEDED
    with the request's bytes as details, unary and streaming."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        handlers = {
            "Hang": grpc.unary_unary_rpc_method_handler(self._hang),
            "Expired": grpc.unary_unary_rpc_method_handler(self._expired),
            "HangStream": grpc.unary_stream_rpc_method_handler(self._hang_stream),
            "ExpiredStream": grpc.unary_stream_rpc_method_handler(self._expired_stream),
        }
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("t.Fuzz", handlers),)
        )
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")

    def _hang(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self.release.wait(20)
        return b""

    def _expired(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, request.decode())

    def _hang_stream(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        yield b"first"
        self.release.wait(20)

    def _expired_stream(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        yield b"first"
        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, request.decode())

    def unary(self, name: str) -> Any:
        return self.channel.unary_unary(f"/t.Fuzz/{name}")

    def stream(self, name: str) -> Any:
        return self.channel.unary_stream(f"/t.Fuzz/{name}")

    def close(self) -> None:
        self.release.set()
        self.channel.close()
        self.server.stop(grace=None)


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.close()


def test_no_answer_before_the_client_deadline_is_a_hang(server: Server) -> None:
    """A unary or streaming call that the client's deadline ends (the server
    never answered) raises: the fuzz example fails as a hang."""
    with pytest.raises(AssertionError, match="a hang"):
        call(server.unary("Hang"), b"", "Hang", timeout=0.2)
    with pytest.raises(AssertionError, match="a hang"):
        call_stream(server.stream("HangStream"), b"", "HangStream", timeout=0.2)


@pytest.mark.parametrize("details", DAEMON_DEADLINES)
def test_the_daemons_own_deadline_exceeded_is_a_status(server: Server, details: str) -> None:
    """A DEADLINE_EXCEEDED the daemon answers itself (a transfer's timeout_ms,
    a peer's deadline passed on) is returned as the outcome, with its details
    and any messages streamed before it."""
    out = call(server.unary("Expired"), details.encode(), "Expired", timeout=10)
    assert (out.code, out.details) == (DEADLINE, details)
    out = call_stream(server.stream("ExpiredStream"), details.encode(), "Expired", timeout=10)
    assert (out.code, out.details, out.responses) == (DEADLINE, details, [b"first"])
