"""Per-request capabilities against real daemons, tried as an attacker would:
a stranger on the Peer port announces transfers of the prefill worker's
blocks with no capability, a made-up one, one granted for another request,
or for other blocks; with an expired one; with one a decode already used;
and a stranger's NIXL agent sends a "done" notification for another agent's
lease. Each is refused (or ignored) and changes nothing: no lease, the same
state, the prefill worker not told (its next event is the next good pull's).
"""

from __future__ import annotations

import json
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from security_support import (
    CALL_TIMEOUT_S,
    Cluster,
    Code,
    announcement,
    expect_transfer,
    start_cluster,
)

from kvmap.tools.launch import local_env
from kvmap.v1 import admin_pb2, admin_pb2_grpc, peer_pb2, registry_pb2, types_pb2

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

DENIED = "capability does not allow this transfer"


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from start_cluster(tmp_path_factory.mktemp("caps"))


class Events:
    """The prefill worker's events on an Attach stream of the test's own."""

    def __init__(self, c: Cluster) -> None:
        self._call = c.p.registry.Attach(registry_pb2.AttachRequest(worker=c.pw.worker_id))
        self._queue: queue.Queue[registry_pb2.AttachResponse] = queue.Queue()
        assert next(self._call).HasField("attached")
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for event in self._call:
                self._queue.put(event)
        except grpc.RpcError:
            return

    def next_finished(self) -> str:
        while True:
            event = self._queue.get(timeout=CALL_TIMEOUT_S)
            if event.HasField("transfer_finished"):
                return event.transfer_finished.request_id

    def close(self) -> None:
        self._call.cancel()


@pytest.fixture
def events(c: Cluster) -> Iterator[Events]:
    e = Events(c)
    yield e
    e.close()


def stats(c: Cluster) -> admin_pb2.GetStatsResponse:
    return admin_pb2_grpc.AdminStub(c.p.unix).GetStats(admin_pb2.GetStatsRequest(), timeout=10)


def begin(c: Cluster, capability: str, **kw: Any) -> tuple[Code, str, str]:
    """A stranger's BeginTransfer of block 1 of group 0 of the prefill worker
    (unless ``kw`` says otherwise): (status, details, lease token)."""
    try:
        resp = c.p.peer.BeginTransfer(announcement(c, capability, **kw), timeout=10)
    except grpc.RpcError as err:
        return err.code(), err.details() or "", ""
    return Code.OK, "", resp.transfer_token


def good_pull(c: Cluster, events: Events, request_id: str) -> None:
    """A legitimate pull; the prefill worker's next event must be its own."""
    groups = [{"group": 0, "local": [0], "remote": [0]}]
    assert c.transfer(c.spec(groups, request_id=request_id), write=False) == (Code.OK, "")
    expect_transfer(c.dw, c.pw, 0, [0], [0])
    assert events.next_finished() == request_id


def assert_unchanged(c: Cluster, before: str, leases: int) -> None:
    assert stats(c).leases == leases
    assert c.p.snapshot() == before
    c.assert_all_intact("after a refused announcement")


REFUSED = {
    "no capability": lambda c: ("", {}),
    "made-up capability": lambda c: ("A" * 43, {}),
    "capability of another request": lambda c: (c.pw.grant("other", {0: [1]}), {}),
    "a block outside the grant": lambda c: (
        c.pw.grant("req", {0: [1]}),
        {"groups": [types_pb2.BlockGrant(transfer_group=0, block_ids=[1, 2])]},
    ),
    "a group outside the grant": lambda c: (
        c.pw.grant("req", {0: [1]}),
        {"groups": [types_pb2.BlockGrant(transfer_group=1, block_ids=[1])]},
    ),
    "no blocks named": lambda c: (c.pw.grant("req", {0: [1]}), {"groups": []}),
    "999,999 blocks of a made-up request": lambda c: (
        "",
        {"request_id": "made-up", "blocks": 999_999},
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_an_announcement_the_capability_does_not_allow_is_refused(
    c: Cluster, events: Events, case: str
) -> None:
    """Pins: BeginTransfer checks the capability against the worker, the
    request id and every named block before it changes anything; each
    refusal is PERMISSION_DENIED with one message, no lease is made, and the
    prefill worker hears nothing."""
    before, leases = c.p.snapshot(), stats(c).leases
    capability, kw = REFUSED[case](c)
    code, details, _ = begin(c, capability, **kw)
    assert (code, details) == (Code.PERMISSION_DENIED, DENIED)
    assert_unchanged(c, before, leases)
    good_pull(c, events, f"good-{case[:12]}")


def test_an_expired_capability_is_failed_precondition(c: Cluster, events: Events) -> None:
    """Pins the expiry: once the wall clock passes the expiry the daemon
    stated, its capability is FAILED_PRECONDITION and makes no lease."""
    before, leases = c.p.snapshot(), stats(c).leases
    capability = c.pw.expired_grant("req", {0: [1]})
    code, details, _ = begin(c, capability)
    assert code is Code.FAILED_PRECONDITION, details
    assert "expired" in details, details
    assert_unchanged(c, before, leases)
    # Through a decode daemon the expiry reaches the caller as it is: not
    # mistaken for a stale region map (which a new handshake would cure).
    spec = c.spec([{"group": 0, "local": [0], "remote": [1]}], request_id="req",
                  capability=capability)  # fmt: skip
    code, details = c.transfer(spec, write=False)
    assert code is Code.FAILED_PRECONDITION, details
    assert "expired" in details and "stale" not in details, details
    assert_unchanged(c, before, leases)
    good_pull(c, events, "good-after-expired")


def test_a_used_capability_is_refused_to_another_agent_and_to_its_decode(
    c: Cluster, events: Events
) -> None:
    """Pins single use: the decode's completed pull consumes the capability;
    a stranger presenting it afterwards is refused, and so is a second pull
    by the decode itself (PERMISSION_DENIED passed through to its caller)."""
    cap = c.pw.grant("once", {0: [3]})
    spec = c.spec([{"group": 0, "local": [3], "remote": [3]}], request_id="once", capability=cap)
    assert c.transfer(spec, write=False) == (Code.OK, "")
    expect_transfer(c.dw, c.pw, 0, [3], [3])
    assert events.next_finished() == "once"
    before, leases = c.p.snapshot(), stats(c).leases
    code, details, _ = begin(
        c, cap, request_id="once", groups=[types_pb2.BlockGrant(transfer_group=0, block_ids=[3])]
    )
    assert (code, details) == (Code.PERMISSION_DENIED, DENIED)
    code, details = c.transfer(spec, write=False)
    assert code is Code.PERMISSION_DENIED and details.endswith(DENIED), details
    assert_unchanged(c, before, leases)
    good_pull(c, events, "good-after-reuse")


def test_the_decode_refuses_a_pull_without_capability_before_dialling(
    c: Cluster, events: Events
) -> None:
    """Pins the puller's own check: a Pull whose spec has no capability is
    PERMISSION_DENIED and the target named in it is never connected to."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    try:
        target = f"127.0.0.1:{listener.getsockname()[1]}"
        spec = c.spec([{"group": 0, "local": [4], "remote": [4]}], target=target, capability="")
        code, details = c.transfer(spec, write=False)
        assert code is Code.PERMISSION_DENIED, details
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()
    c.assert_all_intact("after a pull without capability")


def _wait_for_log(c: Cluster, needle: str) -> None:
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while needle not in c.p.daemon.log():
        assert time.monotonic() < deadline, f"no {needle!r} in the prefill daemon's log"
        time.sleep(0.05)


def test_a_forged_done_from_another_agent_does_not_free_the_request(
    c: Cluster, events: Events, tmp_path: Path
) -> None:
    """Pins that only the lease holder's notification frees a request: a
    stranger's NIXL agent sends "done" with the token of a lease another
    agent holds; the owner logs it, keeps the lease, and does not tell the
    worker; the holder's EndTransfer then ends the lease."""
    cap = c.pw.grant("held", {0: [5]})
    code, details, token = begin(
        c,
        cap,
        request_id="held",
        peer_agent=f"kvmapd-{stats_of_decode(c)}",
        groups=[types_pb2.BlockGrant(transfer_group=0, block_ids=[5])],
    )
    assert code is Code.OK, details
    leases = stats(c).leases
    served = stats(c).transfers.served_done
    forger = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("nixl_notifier.py")),
         c.p.daemon.tcp_target, "prefill", token, c.p.daemon.secret],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=local_env(tmp_path),
    )  # fmt: skip
    try:
        assert forger.stdout is not None and forger.stdin is not None
        # NIXL may print lines of its own first; ours is the JSON one.
        line = forger.stdout.readline()
        while line and not line.startswith('{"agent"'):
            line = forger.stdout.readline()
        assert json.loads(line or "{}").get("agent", "").startswith("forger-")
        _wait_for_log(c, "notif_from_other_agent")
        forger.stdin.write("\n")
        forger.stdin.flush()
        assert forger.wait(60) == 0
    finally:
        forger.kill()
        forger.wait(10)
    after = stats(c)
    assert (after.leases, after.transfers.served_done) == (leases, served)
    c.p.peer.EndTransfer(peer_pb2.EndTransferRequest(transfer_token=token), timeout=10)
    assert stats(c).leases == leases - 1
    good_pull(c, events, "good-after-forged-done")
    c.assert_all_intact("after a forged notification")


def stats_of_decode(c: Cluster) -> str:
    got = admin_pb2_grpc.AdminStub(c.d.unix).GetStats(admin_pb2.GetStatsRequest(), timeout=10)
    return got.daemon_instance
