"""Peer.BeginTransferStream between real daemons: a decode daemon's pulls
from one owner announce themselves on one stream, and a stopping owner ends
the streams open to it: each ends OK (its caller's next call reaches whoever
serves then) rather than being cut off by gRPC when the shutdown's grace
runs out, and the daemon exits 0."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvmap.tools.grants import granted
from kvmap.tools.launch import start_daemon, start_worker
from kvmap.v1 import peer_pb2, peer_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


GEO = ("--blocks", "16", "--block-tokens", "32", "--mla-layers", "2")


def test_pulls_from_one_owner_announce_themselves_on_one_stream(tmp_path: Path) -> None:
    """Three pulls from one owner land, and the owner began each one's lease on the
    same BeginTransferStream call (its debug lines name the RPC and its id), not in
    BeginTransfer calls of their own."""
    owner = start_daemon(tmp_path / "p", "--log-level", "debug", name="prefill")
    try:
        pw = start_worker(owner, "prefill", *GEO, "--fill")
        decode = start_daemon(tmp_path / "d", name="decode")
        try:
            dw = start_worker(decode, "decode", *GEO)
            for i in range(3):
                cmd: dict[str, Any] = {
                    "cmd": "pull",
                    "request_id": f"stream-{i}",
                    "remote_target": owner.tcp_target,
                    "remote_worker": {"engine_id": "prefill"},
                    "groups": [{"group": 0, "local": [i, 5], "remote": [7, i + 2]}],
                }
                got = dw.call(granted(pw, cmd))
                assert got["ok"] and got["bad_blocks"] == 0, got
            dw.stop()
        finally:
            decode.stop()
        pw.stop()
    finally:
        owner.stop()
    lines = [json.loads(line) for line in owner.log().splitlines() if line.startswith("{")]
    begun = [
        (e["request_id"], e["rpc"], e["rpc_id"]) for e in lines if e["event"] == "transfer_begun"
    ]
    assert [(r, rpc) for r, rpc, _ in begun] == [
        (f"stream-{i}", "BeginTransferStream") for i in range(3)
    ], begun
    assert len({rpc_id for _, _, rpc_id in begun}) == 1, begun


def _one_message_then_wait(done: threading.Event) -> Iterator[peer_pb2.BeginTransferStreamRequest]:
    """One (empty) message; the stream stays open, never half-closed by the
    caller, until ``done``: only the owner can end it."""
    yield peer_pb2.BeginTransferStreamRequest()
    done.wait(60)


def test_a_stopping_owner_ends_its_open_streams_ok(tmp_path: Path) -> None:
    """SIGTERM with a stream open (one message answered, the caller still
    sending): the stream ends OK with no more answers, and the owner exits 0."""
    owner = start_daemon(tmp_path / "p", name="prefill")
    done = threading.Event()
    try:
        with owner.channel(tcp=True) as channel:
            stream = peer_pb2_grpc.PeerStub(channel).BeginTransferStream(
                _one_message_then_wait(done), timeout=60
            )
            assert list(next(stream).results) == []  # open and answering
            owner.proc.send_signal(signal.SIGTERM)
            assert list(stream) == []  # no more answers: the owner ended it
            assert stream.code() is grpc.StatusCode.OK, stream.details()
        assert owner.proc.wait(60) == 0, owner.log()
    finally:
        done.set()
        owner.stop()
