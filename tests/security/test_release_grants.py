"""Releasing a grant's use (BeginTransferRequest.release) against real
daemons, tried as an attacker would: a stranger on the Peer port releases
with no capability, a made-up one, one for another request, blocks named, a
count past the bound or another than the grant's; a replay of a release; a
release of an expired grant. Each is refused with a precise status and
changes nothing: the grant keeps its uses (the legitimate pull still works)
and the prefill worker hears nothing but what really happened."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from security_support import CALL_TIMEOUT_S, Cluster, Code, expect_transfer, start_cluster

from kvmap.v1 import peer_pb2, registry_pb2, transfers_pb2, types_pb2

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

DENIED = "capability does not allow this transfer"


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from start_cluster(tmp_path_factory.mktemp("release"))


class Finished:
    """The prefill worker's TransferFinished events on an Attach stream of the test's own."""

    def __init__(self, c: Cluster) -> None:
        self._call = c.p.registry.Attach(registry_pb2.AttachRequest(worker=c.pw.worker_id))
        self._queue: queue.Queue[registry_pb2.TransferFinishedEvent] = queue.Queue()
        assert next(self._call).HasField("attached")
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for event in self._call:
                if event.HasField("transfer_finished"):
                    self._queue.put(event.transfer_finished)
        except grpc.RpcError:
            return

    def next(self) -> registry_pb2.TransferFinishedEvent:
        return self._queue.get(timeout=CALL_TIMEOUT_S)

    def close(self) -> None:
        self._call.cancel()


@pytest.fixture
def finished(c: Cluster) -> Iterator[Finished]:
    f = Finished(c)
    yield f
    f.close()


def open_grant(
    c: Cluster, request_id: str, *, ttl_ms: int = 0
) -> registry_pb2.GrantTransferResponse:
    resp = c.p.registry.GrantTransfer(
        registry_pb2.GrantTransferRequest(
            worker=c.pw.worker_id,
            request_id=request_id,
            groups=[types_pb2.BlockGrant(transfer_group=0, block_ids=[1])],
            ttl_ms=ttl_ms,
            open_uses=True,
        ),
        timeout=CALL_TIMEOUT_S,
    )
    assert resp.open_uses
    return resp


def stranger_release(c: Cluster, capability: str, **kw: Any) -> tuple[Code, str]:
    """A stranger's release on the prefill daemon's Peer port: (status, details)."""
    fields: dict[str, Any] = {
        "request_id": "rel",
        "worker": types_pb2.WorkerId(engine_id="prefill"),
        "peer_agent": "mallory",
        "capability": capability,
        "readers": 1,
        "release": True,
    }
    fields.update(kw)
    try:
        c.p.peer.BeginTransfer(peer_pb2.BeginTransferRequest(**fields), timeout=10)
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
    return Code.OK, ""


def pull(c: Cluster, request_id: str, capability: str, readers: int) -> tuple[Code, str]:
    spec = c.spec([{"group": 0, "local": [1], "remote": [1]}], request_id=request_id,
                  capability=capability)  # fmt: skip
    spec.readers = readers
    return c.transfer(spec, write=False)


def release(c: Cluster, request_id: str, capability: str, readers: int) -> tuple[Code, str]:
    """The decode daemon releases its use (its worker needs no block)."""
    spec = transfers_pb2.TransferSpec(
        request_id=request_id,
        local_worker=types_pb2.WorkerId(engine_id="decode"),
        remote_target=c.p.daemon.tcp_target,
        remote_worker=types_pb2.WorkerId(engine_id="prefill"),
        capability=capability,
        readers=readers,
        release=True,
    )
    return c.transfer(spec, write=False)


REFUSED = {
    "no capability": (lambda cap: ("", {}), Code.PERMISSION_DENIED, DENIED),
    "made-up capability": (lambda cap: ("A" * 43, {}), Code.PERMISSION_DENIED, DENIED),
    "another request": (
        lambda cap: (cap, {"request_id": "other"}), Code.PERMISSION_DENIED, DENIED
    ),
    "blocks named": (
        lambda cap: (cap, {"groups": [types_pb2.BlockGrant(transfer_group=0, block_ids=[1])]}),
        Code.INVALID_ARGUMENT, "groups: a release names no blocks",
    ),
    "65 readers": (lambda cap: (cap, {"readers": 65}), Code.INVALID_ARGUMENT, "readers: 65"),
    "another count": (
        lambda cap: (cap, {"readers": 3}), Code.FAILED_PRECONDITION,
        "admits 2 readers; the caller declared 3",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_release_the_capability_does_not_allow_changes_nothing(
    c: Cluster, finished: Finished, case: str
) -> None:
    """An open grant fixed at 2 readers by a first pull; each hostile release is refused
    with its status and spends nothing: the second reader's pull still completes, and the
    prefill worker's next event is that pull's, the grant's last use."""
    cap = open_grant(c, "rel").capability
    assert pull(c, "rel", cap, 2) == (Code.OK, "")
    first = finished.next()
    assert (first.uses, first.max_uses, first.exhausted) == (1, 2, False)
    capability, kw = REFUSED[case][0](cap)
    code, details = stranger_release(c, capability, **kw)
    assert code is REFUSED[case][1] and REFUSED[case][2] in details, (code, details)
    assert pull(c, "rel", cap, 2) == (Code.OK, "")
    expect_transfer(c.dw, c.pw, 0, [1], [1])
    last = finished.next()
    assert (last.request_id, last.released, last.exhausted) == ("rel", False, True)


def test_a_release_is_heard_once_and_its_replay_refused(c: Cluster, finished: Finished) -> None:
    """The decode releases its one use of an open grant: the prefill worker hears it released
    and used up; the same release replayed (by the decode, or a stranger) is
    PERMISSION_DENIED, as is a pull with the capability, and the worker hears nothing more."""
    cap = open_grant(c, "once").capability
    assert release(c, "once", cap, 1) == (Code.OK, "")
    done = finished.next()
    assert (done.request_id, done.released, done.uses, done.max_uses, done.exhausted) == (
        "once", True, 1, 1, True,
    )  # fmt: skip
    code, details = release(c, "once", cap, 1)
    assert code is Code.PERMISSION_DENIED and details.endswith(DENIED), details
    assert stranger_release(c, cap, request_id="once") == (Code.PERMISSION_DENIED, DENIED)
    code, details = pull(c, "once", cap, 1)
    assert code is Code.PERMISSION_DENIED, details
    good = open_grant(c, "after-replay").capability
    assert pull(c, "after-replay", good, 1) == (Code.OK, "")
    assert finished.next().request_id == "after-replay"


def test_a_release_of_an_expired_grant_is_failed_precondition(
    c: Cluster, finished: Finished
) -> None:
    """Once the wall clock passes the stated expiry a release is FAILED_PRECONDITION
    ("expired") and the worker hears nothing."""
    resp = open_grant(c, "late", ttl_ms=1)
    while time.time_ns() // 1_000_000 <= resp.expires_unix_ms:
        time.sleep(0.001)  # the wall clock passing the stated expiry, not synchronisation
    code, details = release(c, "late", resp.capability, 1)
    assert code is Code.FAILED_PRECONDITION and "expired" in details, details
    good = open_grant(c, "after-expired").capability
    assert pull(c, "after-expired", good, 1) == (Code.OK, "")
    assert finished.next().request_id == "after-expired"


def release_rpc(c: Cluster, request_id: str, capability: str, readers: int) -> tuple[Code, str]:
    """The decode daemon releases its use through Transfers.Release."""
    req = transfers_pb2.ReleaseRequest(
        request_id=request_id,
        local_worker=types_pb2.WorkerId(engine_id="decode"),
        remote_target=c.p.daemon.tcp_target,
        remote_worker=types_pb2.WorkerId(engine_id="prefill"),
        capability=capability,
        readers=readers,
    )
    try:
        c.d.transfers.Release(req, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
    return Code.OK, ""


def test_the_release_rpc_releases_as_the_old_flag_does(c: Cluster, finished: Finished) -> None:
    """Transfers.Release spends one use of a grant of 2 readers and the prefill worker hears
    it released; the other reader's release through the deprecated TransferSpec.release flag
    spends the last; a third release by either way is PERMISSION_DENIED, and the worker
    hears nothing more."""
    cap = open_grant(c, "rpc").capability
    assert release_rpc(c, "rpc", cap, 2) == (Code.OK, "")
    first = finished.next()
    assert (first.request_id, first.released, first.uses, first.max_uses) == ("rpc", True, 1, 2)
    assert release(c, "rpc", cap, 2) == (Code.OK, "")
    last = finished.next()
    assert (last.released, last.uses, last.exhausted) == (True, 2, True)
    for again in (release_rpc, release):
        code, details = again(c, "rpc", cap, 2)
        assert code is Code.PERMISSION_DENIED and details.endswith(DENIED), details
    good = open_grant(c, "after-rpc").capability
    assert pull(c, "after-rpc", good, 1) == (Code.OK, "")
    assert finished.next().request_id == "after-rpc"


def test_the_release_rpc_checks_its_arguments_first(c: Cluster, finished: Finished) -> None:
    """A Release naming no capability is PERMISSION_DENIED and one past the reader bound
    INVALID_ARGUMENT, each before the owner is asked: the grant keeps its use."""
    cap = open_grant(c, "args").capability
    code, details = release_rpc(c, "args", "", 1)
    assert code is Code.PERMISSION_DENIED and "capability" in details, details
    code, details = release_rpc(c, "args", cap, 65)
    assert code is Code.INVALID_ARGUMENT and details.startswith("readers: 65"), details
    assert pull(c, "args", cap, 1) == (Code.OK, "")
    assert finished.next().request_id == "args"
