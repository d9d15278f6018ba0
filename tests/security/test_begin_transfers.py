"""Peer.BeginTransfers and Peer.BeginTransferStream against a real owner
daemon, tried as an attacker would: each call of a batch (or of a stream's
message) is checked and answered as its own BeginTransfer
would be (a refused call, whatever it tries, gets its precise status and
changes nothing for the calls around it), a stranger without the peer secret
is refused before anything is read, and a batch over the call or byte limits
is refused whole, changing nothing."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from security_support import CALL_TIMEOUT_S, Cluster, Code, announcement, start_cluster

from kvmap.core.peer_policy import INBOUND_DENIED
from kvmap.core.transfer_wire import MAX_BEGIN_CALLS
from kvmap.tools.peers import peer_channel
from kvmap.v1 import admin_pb2, admin_pb2_grpc, peer_pb2, peer_pb2_grpc, types_pb2

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

DENIED = "capability does not allow this transfer"


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from start_cluster(tmp_path_factory.mktemp("batches"))


def _leases(c: Cluster) -> int:
    stats = admin_pb2_grpc.AdminStub(c.p.unix).GetStats(admin_pb2.GetStatsRequest(), timeout=10)
    return int(stats.leases)


def _call(c: Cluster, request_id: str, capability: str, **kw: Any) -> peer_pb2.BeginTransferRequest:
    """A BeginTransfer of block 1 of group 0 of the prefill worker, unless ``kw`` says otherwise."""
    return announcement(c, capability, request_id=request_id, peer_agent="batcher", **kw)


def _batch(c: Cluster, calls: list[peer_pb2.BeginTransferRequest]) -> Any:
    return c.p.peer.BeginTransfers(peer_pb2.BeginTransfersRequest(calls=calls), timeout=10)


def test_each_call_is_answered_as_its_own_begin_transfer(c: Cluster) -> None:
    """A batch of a good call between four refused ones (made-up capability, another
    request's capability, a block outside the grant, the agent of an owner before its
    restart) answers each in order: one lease token, the same PERMISSION_DENIED a lone
    BeginTransfer gets for each refusal, and FAILED_PRECONDITION with HANDSHAKE_AGAIN for the
    old agent. Exactly one lease is taken, and ending it leaves the owner as it was."""
    good = c.pw.grant("batch-good", {0: [1]})
    other = c.pw.grant("batch-other", {0: [2]})
    calls = [
        _call(c, "batch-good", "A" * 43),
        _call(c, "batch-good", other),
        _call(c, "batch-good", good),
        _call(
            c, "batch-good", good, groups=[types_pb2.BlockGrant(transfer_group=0, block_ids=[3])]
        ),
        _call(c, "batch-good", good, agent_name="kvmapd-before-its-restart"),
    ]
    before = (_leases(c), c.p.snapshot())
    got = _batch(c, calls).results
    assert [(r.code, r.message, r.reason) for r in got] == [
        (Code.PERMISSION_DENIED.value[0], DENIED, ""),
        (Code.PERMISSION_DENIED.value[0], DENIED, ""),
        (0, "", ""),
        # The good call claimed the grant for this agent; a second call's other block
        # is still outside it.
        (Code.PERMISSION_DENIED.value[0], DENIED, ""),
        (Code.FAILED_PRECONDITION.value[0], got[4].message, "HANDSHAKE_AGAIN"),
    ]
    assert got[2].transfer_token and "kvmapd-before-its-restart" in got[4].message
    # Each refused call is among the owner's recent errors, as a refused RPC is.
    status = admin_pb2_grpc.AdminStub(c.p.unix).GetStatus(admin_pb2.GetStatusRequest(), timeout=10)
    recent = [(e.method, e.code) for e in status.recent_errors[-4:]]
    assert recent == [("BeginTransfers", "PERMISSION_DENIED")] * 3 + [
        ("BeginTransfers", "FAILED_PRECONDITION")
    ]
    assert _leases(c) == before[0] + 1
    c.p.peer.EndTransfer(
        peer_pb2.EndTransferRequest(transfer_token=got[2].transfer_token), timeout=CALL_TIMEOUT_S
    )
    assert (_leases(c), c.p.snapshot()) == before
    c.assert_all_intact("after a batch of announcements")


def test_a_stranger_is_refused_before_its_batch_is_read(c: Cluster) -> None:
    """Without the peer secret, BeginTransfers is PERMISSION_DENIED with the one inbound
    message, even for a batch of calls with a real capability; no lease is taken."""
    cap = c.pw.grant("batch-stranger", {0: [1]})
    before = _leases(c)
    stranger = peer_channel(c.p.daemon.tcp_target, "guess-" * 8)
    with stranger, pytest.raises(grpc.RpcError) as refused:
        peer_pb2_grpc.PeerStub(stranger).BeginTransfers(
            peer_pb2.BeginTransfersRequest(calls=[_call(c, "batch-stranger", cap)]), timeout=10
        )
    assert (refused.value.code(), refused.value.details()) == (
        Code.PERMISSION_DENIED,
        INBOUND_DENIED,
    )
    assert _leases(c) == before


@pytest.mark.parametrize("kind", ["too many calls", "too many bytes"])
def test_a_batch_over_its_limits_is_refused_whole(c: Cluster, kind: str) -> None:
    """65 calls, or calls adding up to more than one BeginTransfer's 352 KiB, are
    RESOURCE_EXHAUSTED for the whole batch, the good call among them included: no lease,
    nothing changed."""
    cap = c.pw.grant(f"batch-{kind[9:13]}", {0: [1]})
    good = _call(c, f"batch-{kind[9:13]}", cap)
    if kind == "too many calls":
        calls = [good] * (MAX_BEGIN_CALLS + 1)
    else:
        filler = _call(c, "filler", "A" * 43, groups=[
            types_pb2.BlockGrant(transfer_group=0, block_ids=list(range(2**14, 2**14 + 60_000)))
        ])  # fmt: skip
        calls = [good, filler, filler, filler]
    before = (_leases(c), c.p.snapshot())
    with pytest.raises(grpc.RpcError) as refused:
        _batch(c, calls)
    assert refused.value.code() == Code.RESOURCE_EXHAUSTED
    assert (_leases(c), c.p.snapshot()) == before
    c.p.assert_healthy()


def _stream(c: Cluster, messages: list[list[peer_pb2.BeginTransferRequest]]) -> list[Any]:
    """Each message's results, from one BeginTransferStream that sends them in turn."""
    requests = iter([peer_pb2.BeginTransferStreamRequest(calls=calls) for calls in messages])
    return [answer.results for answer in c.p.peer.BeginTransferStream(requests, timeout=10)]


def test_each_call_on_the_stream_is_answered_as_its_own_begin_transfer(c: Cluster) -> None:
    """On BeginTransferStream a message of a refused and a good call, then a message of a
    call for a block outside the grant: each message gets one answer, in order, each call the
    answer its own BeginTransfer would get; a refused call does not end the stream (the next
    message is answered) and exactly one lease is taken."""
    good = c.pw.grant("stream-good", {0: [1]})
    before = (_leases(c), c.p.snapshot())
    outside = [types_pb2.BlockGrant(transfer_group=0, block_ids=[3])]
    first, second = _stream(c, [
        [_call(c, "stream-good", "A" * 43), _call(c, "stream-good", good)],
        [_call(c, "stream-good", good, groups=outside)],
    ])  # fmt: skip
    assert [(r.code, r.message) for r in first] == [
        (Code.PERMISSION_DENIED.value[0], DENIED),
        (0, ""),
    ]
    assert [(r.code, r.message) for r in second] == [(Code.PERMISSION_DENIED.value[0], DENIED)]
    status = admin_pb2_grpc.AdminStub(c.p.unix).GetStatus(admin_pb2.GetStatusRequest(), timeout=10)
    recent = [(e.method, e.code) for e in status.recent_errors[-2:]]
    assert recent == [("BeginTransferStream", "PERMISSION_DENIED")] * 2
    assert _leases(c) == before[0] + 1
    c.p.peer.EndTransfer(
        peer_pb2.EndTransferRequest(transfer_token=first[1].transfer_token), timeout=CALL_TIMEOUT_S
    )
    assert (_leases(c), c.p.snapshot()) == before


def test_a_stranger_is_refused_before_its_stream_is_read(c: Cluster) -> None:
    """Without the peer secret, BeginTransferStream ends PERMISSION_DENIED with the one
    inbound message before any message is answered, a call with a real capability included;
    no lease is taken."""
    cap = c.pw.grant("stream-stranger", {0: [1]})
    before = _leases(c)
    stranger = peer_channel(c.p.daemon.tcp_target, "guess-" * 8)
    requests = iter([peer_pb2.BeginTransferStreamRequest(calls=[_call(c, "stream-stranger", cap)])])
    with stranger, pytest.raises(grpc.RpcError) as refused:
        list(peer_pb2_grpc.PeerStub(stranger).BeginTransferStream(requests, timeout=10))
    assert (refused.value.code(), refused.value.details()) == (
        Code.PERMISSION_DENIED,
        INBOUND_DENIED,
    )
    assert _leases(c) == before


@pytest.mark.parametrize("kind", ["too many calls", "too many bytes", "not a message"])
def test_a_stream_message_over_its_limits_ends_the_stream_changing_nothing(
    c: Cluster, kind: str
) -> None:
    """A message of 65 calls, one over BeginTransfers' 352 KiB, or bytes that are no message,
    after a good message on the same stream: the good message is answered, then the stream
    ends RESOURCE_EXHAUSTED (INVALID_ARGUMENT for the bytes) and the bad message changes
    nothing, its good calls included."""
    cap = c.pw.grant(f"stream-{kind[:8]}", {0: [1]})
    good = _call(c, f"stream-{kind[:8]}", cap)
    bad: bytes
    if kind == "too many calls":
        bad = peer_pb2.BeginTransferStreamRequest(
            calls=[good] * (MAX_BEGIN_CALLS + 1)
        ).SerializeToString()
    elif kind == "too many bytes":
        filler = _call(c, "filler", "A" * 43, groups=[
            types_pb2.BlockGrant(transfer_group=0, block_ids=list(range(2**14, 2**14 + 60_000)))
        ])  # fmt: skip
        bad = peer_pb2.BeginTransferStreamRequest(
            calls=[good, filler, filler, filler]
        ).SerializeToString()
    else:
        bad = b"\xff\xff\xff\xff"
    first = peer_pb2.BeginTransferStreamRequest(calls=[_call(c, "stream-first", "A" * 43)])
    before = (_leases(c), c.p.snapshot())
    stream = c.p.tcp.stream_stream("/kvmap.v1.Peer/BeginTransferStream")
    answers: list[bytes] = []
    with pytest.raises(grpc.RpcError) as ended:
        for answer in stream(iter([first.SerializeToString(), bad]), timeout=10):
            answers.append(answer)
    expected = Code.INVALID_ARGUMENT if kind == "not a message" else Code.RESOURCE_EXHAUSTED
    assert ended.value.code() == expected, ended.value.details()
    got = [peer_pb2.BeginTransferStreamResponse.FromString(a).results for a in answers]
    assert [[(r.code, r.message) for r in results] for results in got] == [
        [(Code.PERMISSION_DENIED.value[0], DENIED)]
    ]
    assert (_leases(c), c.p.snapshot()) == before
    c.p.assert_healthy()
