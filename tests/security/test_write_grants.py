"""Write grants and push offers against real daemons, tried as an attacker
would. Push mode lets a peer write a worker's blocks, so a grant has one
direction: a write grant admits pushes into exactly its blocks and never a
read, a read grant never a write, and a grant of an unknown direction is
refused. A revoked write grant's announced writes are reported until they
end (a decode worker reuses its blocks only then). Offers of blocks reach a
prefill engine's workers only through the authenticated Peer port, and
every field of one is checked before it is relayed: a hostile offer is
INVALID_ARGUMENT naming its field, and nothing is relayed.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
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

from kvmap.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    peer_pb2,
    registry_pb2,
    transfers_pb2,
    types_pb2,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

DENIED = "capability does not allow this transfer"
READ = registry_pb2.GRANT_ACCESS_READ
WRITE = registry_pb2.GRANT_ACCESS_WRITE


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from start_cluster(tmp_path_factory.mktemp("writes"))


def leases(c: Cluster) -> int:
    stub = admin_pb2_grpc.AdminStub(c.p.unix)
    return int(stub.GetStats(admin_pb2.GetStatsRequest(), timeout=10).leases)


def stats(c: Cluster) -> admin_pb2.TransferCounters:
    """The prefill daemon's transfer counters."""
    stub = admin_pb2_grpc.AdminStub(c.p.unix)
    return stub.GetStats(admin_pb2.GetStatsRequest(), timeout=10).transfers


def refused_unchanged(c: Cluster, spec: transfers_pb2.TransferSpec, write: bool) -> None:
    """``spec`` is refused with the one capability message and changes nothing."""
    before = (c.p.snapshot(), c.d.snapshot(), leases(c))
    code, details = c.transfer(spec, write=write)
    assert (code, details.endswith(DENIED)) == (Code.PERMISSION_DENIED, True), (code, details)
    c.assert_all_intact(f"after a refused {'push' if write else 'pull'}")
    assert (c.p.snapshot(), c.d.snapshot(), leases(c)) == before


def test_a_write_grant_admits_pushes_into_its_blocks_only(c: Cluster) -> None:
    """Pins the direction and the blocks of a write grant: a push into the
    granted block lands; the same capability cannot read that block, nor
    can a write grant of another block be used to write this one."""
    cap = c.pw.grant("w-ok", {0: [5]}, access=WRITE)
    spec = c.spec([{"group": 0, "local": [2], "remote": [5]}], request_id="w-ok", capability=cap)
    assert c.transfer(spec, write=True) == (Code.OK, "")
    expect_transfer(c.pw, c.dw, 0, [5], [2])
    c.assert_all_intact("after an accepted push")

    cap = c.pw.grant("w-read", {0: [6]}, access=WRITE)
    spec = c.spec([{"group": 0, "local": [3], "remote": [6]}], request_id="w-read", capability=cap)
    refused_unchanged(c, spec, write=False)

    cap = c.pw.grant("w-other", {0: [7]}, access=WRITE)
    spec = c.spec([{"group": 0, "local": [3], "remote": [8]}], request_id="w-other", capability=cap)
    refused_unchanged(c, spec, write=True)


def test_a_read_grant_admits_no_write(c: Cluster) -> None:
    """Pins the other direction: a decode that may read a prefill request's
    blocks cannot write them (the prefill's prefix cache would serve forged
    KV), through its daemon or as a stranger announcing a write."""
    cap = c.pw.grant("r-only", {0: [9]}, access=READ)
    spec = c.spec([{"group": 0, "local": [4], "remote": [9]}], request_id="r-only", capability=cap)
    refused_unchanged(c, spec, write=True)
    before = leases(c)
    ann = announcement(
        c,
        cap,
        request_id="r-only",
        write=True,
        groups=[types_pb2.BlockGrant(transfer_group=0, block_ids=[9])],
    )
    with pytest.raises(grpc.RpcError) as err:
        c.p.peer.BeginTransfer(ann, timeout=CALL_TIMEOUT_S)
    assert (err.value.code(), err.value.details()) == (Code.PERMISSION_DENIED, DENIED)
    assert leases(c) == before
    # The grant itself still reads: the refused write took nothing from it.
    assert c.transfer(spec, write=False) == (Code.OK, "")
    expect_transfer(c.dw, c.pw, 0, [4], [9])
    c.assert_all_intact("after the grant's own pull")


def test_a_grant_of_an_unknown_direction_is_invalid_argument(c: Cluster) -> None:
    """A direction this daemon does not know is INVALID_ARGUMENT naming the
    field, and mints nothing."""
    before = c.p.snapshot()
    with pytest.raises(grpc.RpcError) as err:
        c.p.registry.GrantTransfer(
            registry_pb2.GrantTransferRequest(
                worker=c.pw.worker_id,
                request_id="w-odd",
                groups=[types_pb2.BlockGrant(transfer_group=0, block_ids=[1])],
                access=registry_pb2.GrantAccess.ValueType(7),
            ),
            timeout=CALL_TIMEOUT_S,
        )
    assert err.value.code() is Code.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("access:"), err.value.details()
    assert c.p.snapshot() == before


def revoke(c: Cluster, request_id: str) -> int:
    resp = c.p.registry.RevokeTransfer(
        registry_pb2.RevokeTransferRequest(worker=c.pw.worker_id, request_id=request_id),
        timeout=CALL_TIMEOUT_S,
    )
    return int(resp.writes_in_flight)


def test_a_revoked_write_grant_reports_its_announced_writes_until_they_end(c: Cluster) -> None:
    """Pins what lets a decode worker reuse blocks safely: a write a peer
    announced under the grant counts as in flight after the revoke (its
    bytes may still land), and no longer once it ended; a read does not
    count, and revoking is idempotent."""
    cap = c.pw.grant("w-flight", {0: [10, 11]}, access=WRITE)
    ann = announcement(
        c,
        cap,
        request_id="w-flight",
        write=True,
        groups=[types_pb2.BlockGrant(transfer_group=0, block_ids=[10, 11])],
        blocks=2,
    )
    token = c.p.peer.BeginTransfer(ann, timeout=CALL_TIMEOUT_S).transfer_token
    assert revoke(c, "w-flight") == 1
    assert revoke(c, "w-flight") == 1
    c.p.peer.EndTransfer(peer_pb2.EndTransferRequest(transfer_token=token), timeout=10)
    assert revoke(c, "w-flight") == 0
    # A read lease is no write into the worker's blocks.
    cap = c.pw.grant("r-flight", {0: [12]}, access=READ)
    ann = announcement(c, cap, request_id="r-flight")
    ann.groups[0].block_ids[:] = [12]
    token = c.p.peer.BeginTransfer(ann, timeout=CALL_TIMEOUT_S).transfer_token
    assert revoke(c, "r-flight") == 0
    c.p.peer.EndTransfer(peer_pb2.EndTransferRequest(transfer_token=token), timeout=10)
    c.assert_all_intact("after the announced transfers")


class Offers:
    """The push offers the prefill worker's engine hears, on an Attach
    stream of the test's own."""

    def __init__(self, c: Cluster) -> None:
        self._call = c.p.registry.Attach(registry_pb2.AttachRequest(worker=c.pw.worker_id))
        self._queue: queue.Queue[registry_pb2.PushOfferedEvent] = queue.Queue()
        assert next(self._call).HasField("attached")
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for event in self._call:
                if event.HasField("push_offered"):
                    self._queue.put(event.push_offered)
        except grpc.RpcError:
            return

    def next(self, timeout: float) -> registry_pb2.PushOfferedEvent | None:
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        self._call.cancel()


@pytest.fixture
def offers(c: Cluster) -> Iterator[Offers]:
    o = Offers(c)
    yield o
    o.close()


def good_offer(c: Cluster) -> types_pb2.PushOffer:
    """A well-formed offer of decode blocks 1 and 2 to the prefill engine."""
    return types_pb2.PushOffer(
        push_id="P" * 24,
        prefill_engine_id="prefill",
        decode_worker=c.dw.worker_id,
        decode_target=c.d.daemon.tcp_target,
        decode_tp_size=1,
        decode_block_size=16,
        first_token=0,
        num_tokens=32,
        groups=[types_pb2.BlockGrant(transfer_group=0, block_ids=[1, 2])],
        capability="C" * 43,
        expires_unix_ms=1,
        request_id="decode-req",
    )


HOSTILE_OFFERS: dict[str, tuple[dict[str, Any], str]] = {
    "short push id": ({"push_id": "x" * 8}, "offer.push_id"),
    "push id with a slash": ({"push_id": "a/" * 12}, "offer.push_id"),
    "no decode target": ({"decode_target": ""}, "offer.decode_target"),
    "decode target without a port": ({"decode_target": "10.0.0.1"}, "offer.decode_target"),
    "no prefill engine": ({"prefill_engine_id": ""}, "offer.prefill_engine_id"),
    "prefill engine id of 300 characters": (
        {"prefill_engine_id": "e" * 300},
        "offer.prefill_engine_id",
    ),
    "block size 0": ({"decode_block_size": 0}, "offer.decode_block_size"),
    "first token inside a block": ({"first_token": 5}, "offer.first_token"),
    "no tokens": ({"num_tokens": 0}, "offer.num_tokens"),
    "tokens past int64 arithmetic": ({"num_tokens": 1 << 62}, "offer.num_tokens"),
    "TP size 0": ({"decode_tp_size": 0}, "offer.decode_tp_size"),
    "no groups": ({"groups": []}, "offer.groups"),
    "a negative block id": (
        {"groups": [types_pb2.BlockGrant(transfer_group=0, block_ids=[1, -3])]},
        "offer.groups[0].block_ids",
    ),
    "a group twice": (
        {"groups": [types_pb2.BlockGrant(transfer_group=0, block_ids=[1])] * 2},
        "offer.groups[1]",
    ),
    "a malformed capability": ({"capability": "not a capability!"}, "offer.capability"),
    "no request id": ({"request_id": ""}, "offer.request_id"),
}


@pytest.mark.parametrize("case", list(HOSTILE_OFFERS))
def test_a_hostile_offer_is_refused_naming_its_field_and_relayed_nowhere(
    c: Cluster, offers: Offers, case: str
) -> None:
    """Each hostile offer, sent by a peer or by a local worker, is
    INVALID_ARGUMENT naming its first bad field; no worker hears of it."""
    fields, field = HOSTILE_OFFERS[case]
    offer = good_offer(c)
    for name, value in fields.items():
        if name == "groups":
            del offer.groups[:]
            offer.groups.extend(value)
        else:
            setattr(offer, name, value)
    with pytest.raises(grpc.RpcError) as err:
        c.p.peer.OfferPush(peer_pb2.PeerOfferPushRequest(offer=offer), timeout=CALL_TIMEOUT_S)
    assert err.value.code() is Code.INVALID_ARGUMENT, (case, err.value.details())
    assert (err.value.details() or "").startswith(field + ":"), (case, err.value.details())
    # The decode side's daemon checks its worker's offer the same way before it leaves.
    with pytest.raises(grpc.RpcError) as local:
        c.d.transfers.OfferPush(
            transfers_pb2.OfferPushRequest(target=c.p.daemon.tcp_target, offer=offer),
            timeout=CALL_TIMEOUT_S,
        )
    assert local.value.code() is Code.INVALID_ARGUMENT, (case, local.value.details())
    assert offers.next(timeout=0.2) is None


def test_an_offer_reaches_the_named_engines_workers_only(c: Cluster, offers: Offers) -> None:
    """A good offer is relayed to the attached workers of the engine it names
    (with the authenticated peer it came from); an offer to an engine with
    no attached worker is NOT_FOUND at once, so the decode side recomputes
    rather than waiting out its timeout."""
    offer = good_offer(c)
    before = stats(c)
    resp = c.d.transfers.OfferPush(
        transfers_pb2.OfferPushRequest(target=c.p.daemon.tcp_target, offer=offer),
        timeout=CALL_TIMEOUT_S,
    )
    assert resp.workers == 1  # the engine's one worker (its every Attach stream hears it)
    got = offers.next(timeout=CALL_TIMEOUT_S)
    assert got is not None and got.offer == offer
    assert got.peer, "the offer names the peer it came from"
    offer.prefill_engine_id = "nobody"
    with pytest.raises(grpc.RpcError) as err:
        c.p.peer.OfferPush(peer_pb2.PeerOfferPushRequest(offer=offer), timeout=CALL_TIMEOUT_S)
    assert err.value.code() is Code.NOT_FOUND, err.value.details()
    assert offers.next(timeout=0.2) is None
    after = stats(c)
    assert after.push_offers_relayed - before.push_offers_relayed == 1
    assert after.push_offers_refused - before.push_offers_refused == 1


def test_only_the_registered_workers_daemon_offers_its_blocks(c: Cluster) -> None:
    """The decode daemon relays only offers of its own registered workers'
    blocks: an offer naming a worker it does not have is NOT_FOUND and never
    leaves (its target is never dialled)."""
    offer = good_offer(c)
    offer.decode_worker.engine_id = "someone-else"
    with pytest.raises(grpc.RpcError) as err:
        c.d.transfers.OfferPush(
            transfers_pb2.OfferPushRequest(target="127.0.0.1:1", offer=offer),
            timeout=CALL_TIMEOUT_S,
        )
    assert err.value.code() is Code.NOT_FOUND, err.value.details()
