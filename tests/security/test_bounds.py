"""No pull or push addresses a byte outside a registered region: tests that
try, against two real daemons (prefill ``coalesce``, decode ``baseline``)
with workers whose memory the test owns and checks byte for byte, guard
pages around the allocations and padding inside the rows included.

Every hostile request gets its exact status and a message naming the
offending field, and afterwards *both* workers' memory is exactly what it
was, and both daemons' region maps and generations are unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from security_support import Cluster, expect_transfer, start_cluster

from kvmap.v1 import peer_pb2, types_pb2

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

Code = grpc.StatusCode
P_N, D_N = 32, 24  # prefill and decode blocks


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from start_cluster(tmp_path_factory.mktemp("bounds"))


def test_accepted_transfers_write_exactly_the_requested_bytes(c: Cluster) -> None:
    """The positive control: the byte model the other tests rely on is exact.
    A pull writes the requested blocks and layers of decode and nothing else;
    a push writes the requested blocks of prefill and nothing else; over gRPC
    and on the local calls socket."""
    local, remote = [0, 5, 6, 23], [31, 2, 3, 0]
    code, msg = c.transfer(
        c.spec(
            [
                {"group": 0, "local": local, "remote": remote, "layers": ["m1", "m2"]},
                {"group": 1, "local": local, "remote": remote},
            ]
        ),
        write=False,
    )
    assert code is Code.OK, msg
    expect_transfer(c.dw, c.pw, 0, local, remote, layers=["m1", "m2"])
    expect_transfer(c.dw, c.pw, 1, local, remote)
    c.assert_all_intact("after an accepted pull")

    # A push may read one source block twice (only destinations must be unique).
    src, dst = [7, 7, 23], [30, 1, 16]
    spec = c.spec([{"group": 0, "local": src, "remote": dst}], write=True)
    code, msg = c.transfer(spec, write=True)
    assert code is Code.OK, msg
    expect_transfer(c.pw, c.dw, 0, dst, src)
    c.assert_all_intact("after an accepted push")

    # The same on the local calls socket (other blocks, so that the bytes show it).
    local, remote = [1, 2], [17, 9]
    code, msg = c.transfer(c.spec([_g(local, remote)]), write=False, local=True)
    assert code is Code.OK, msg
    expect_transfer(c.dw, c.pw, 0, local, remote)
    src, dst = [3], [12]
    code, msg = c.transfer(c.spec([_g(src, dst)], write=True), write=True, local=True)
    assert code is Code.OK, msg
    expect_transfer(c.pw, c.dw, 0, dst, src)
    c.assert_all_intact("after an accepted pull and push on the local calls socket")


def _g(local: list[int], remote: list[int], group: int = 0, **kw: Any) -> dict[str, Any]:
    return {"group": group, "local": local, "remote": remote, **kw}


# (groups, spec overrides, status, message fragment)
HOSTILE_PULLS: dict[str, tuple[list[dict[str, Any]], dict[str, Any], Code, str]] = {
    "remote id at num_blocks": (
        [_g([1, 2], [3, P_N])], {}, Code.INVALID_ARGUMENT,
        f"groups[0].remote_block_ids[1]: block {P_N} out of range [0, {P_N})",
    ),
    "remote id -1": (
        [_g([1, 2], [-1, 3])], {}, Code.INVALID_ARGUMENT,
        "groups[0].remote_block_ids[0]: block -1 out of range",
    ),
    "remote id 2**32 (int32 wrap)": (
        [_g([1], [2**32 + 3])], {}, Code.INVALID_ARGUMENT, "groups[0].remote_block_ids[0]",
    ),
    "remote id int64 max": (
        [_g([1], [2**63 - 1])], {}, Code.INVALID_ARGUMENT, "groups[0].remote_block_ids[0]",
    ),
    "remote id int64 min": (
        [_g([1], [-(2**63)])], {}, Code.INVALID_ARGUMENT, "groups[0].remote_block_ids[0]",
    ),
    "local id at its num_blocks (valid remotely)": (
        [_g([D_N], [D_N])], {}, Code.INVALID_ARGUMENT,
        f"groups[0].local_block_ids[0]: block {D_N} out of range [0, {D_N})",
    ),
    "local id 2**31 (int32 overflow)": (
        [_g([2**31], [1])], {}, Code.INVALID_ARGUMENT, "groups[0].local_block_ids[0]",
    ),
    "local id -1 in the second group": (
        [_g([1], [1]), _g([2, -1], [2, 3], group=1)], {}, Code.INVALID_ARGUMENT,
        "groups[1].local_block_ids[1]: block -1",
    ),
    "layer of another group": (
        [_g([1], [1], layers=["i0"])], {}, Code.NOT_FOUND,
        "layer 'i0' not in transfer group 0",
    ),
    "unknown layer": (
        [_g([1], [1], layers=["m0", "m9"])], {}, Code.NOT_FOUND, "groups[0].layer_names[1]",
    ),
    "layer listed twice": (
        [_g([1], [1], layers=["m0", "m0"])], {}, Code.INVALID_ARGUMENT,
        "groups[0].layer_names[1]",
    ),
    "unknown transfer group": (
        [_g([1], [1], group=2)], {}, Code.NOT_FOUND, "transfer group 2",
    ),
    "transfer group uint32 max": (
        [_g([1], [1], group=2**32 - 1)], {}, Code.NOT_FOUND, f"transfer group {2**32 - 1}",
    ),
    "fewer remote ids than local ids": (
        [_g([1, 2, 3], [1, 2])], {}, Code.INVALID_ARGUMENT,
        "groups[0].remote_block_ids: 2 ids for 3 local ids",
    ),
    "destination block written twice": (
        [_g([4, 4], [1, 2])], {}, Code.INVALID_ARGUMENT, "written twice",
    ),
    "destination shared by two groups for the same layers": (
        [_g([4], [1]), _g([4], [2], layers=["m1"])], {}, Code.INVALID_ARGUMENT,
        "groups[1].local_block_ids[0]: block 4 is also written by groups[0]",
    ),
    "forged remote generation": (
        [_g([1], [1])], {"remote_generation": 2}, Code.FAILED_PRECONDITION,
        "generation 2 is stale (current 1)",
    ),
    "forged remote generation uint64 max": (
        [_g([1], [1])], {"remote_generation": 2**64 - 1}, Code.FAILED_PRECONDITION, "stale",
    ),
    "unknown remote worker": (
        [_g([1], [1])], {"remote_engine": "nobody"}, Code.NOT_FOUND,
        "worker nobody/dp0/tp0/pp0 is not registered",
    ),
    "local worker that lives on another daemon": (
        [_g([1], [1])], {"local_engine": "prefill"}, Code.NOT_FOUND,
        "worker prefill/dp0/tp0/pp0 is not registered",
    ),
    "no groups": ([], {}, Code.INVALID_ARGUMENT, "spec.groups"),
}  # fmt: skip

HOSTILE_PUSHES: dict[str, tuple[list[dict[str, Any]], dict[str, Any], Code, str]] = {
    "remote (destination) id at num_blocks": (
        [_g([1, 2], [3, P_N])], {}, Code.INVALID_ARGUMENT,
        f"groups[0].remote_block_ids[1]: block {P_N} out of range [0, {P_N})",
    ),
    "remote (destination) id -1": (
        [_g([1], [-1])], {}, Code.INVALID_ARGUMENT, "groups[0].remote_block_ids[0]",
    ),
    "remote (destination) id huge": (
        [_g([1], [2**62])], {}, Code.INVALID_ARGUMENT, "groups[0].remote_block_ids[0]",
    ),
    "local (source) id at num_blocks": (
        [_g([D_N], [1])], {}, Code.INVALID_ARGUMENT,
        f"groups[0].local_block_ids[0]: block {D_N} out of range",
    ),
    "remote destination written twice": (
        [_g([1, 2], [9, 9])], {}, Code.INVALID_ARGUMENT,
        "groups[0].remote_block_ids[1]: block 9 repeats",
    ),
    "layer of another group": (
        [_g([1], [1], group=1, layers=["m0"])], {}, Code.NOT_FOUND,
        "layer 'm0' not in transfer group 1",
    ),
    "forged remote generation": (
        [_g([1], [1])], {"remote_generation": 7}, Code.FAILED_PRECONDITION, "stale",
    ),
}  # fmt: skip


def _hostile(
    c: Cluster,
    case: tuple[list[dict[str, Any]], dict[str, Any], Code, str],
    write: bool,
) -> None:
    groups, overrides, code, fragment = case
    before = (c.p.snapshot(), c.d.snapshot())
    got, msg = c.transfer(c.spec(groups, write=write, **overrides), write=write)
    assert (got, fragment in msg) == (code, True), (got, msg)
    # The local calls socket answers the same call with the same status and words.
    again = c.spec(groups, write=write, **overrides)
    assert c.transfer(again, write=write, local=True) == (got, msg)
    c.assert_all_intact(f"after a refused {'push' if write else 'pull'} ({got.name})")
    assert (c.p.snapshot(), c.d.snapshot()) == before
    c.p.assert_healthy()
    c.d.assert_healthy()


@pytest.mark.parametrize("name", list(HOSTILE_PULLS))
def test_hostile_pull_is_refused_and_touches_nothing(c: Cluster, name: str) -> None:
    """Each hostile pull (block ids out of range or overflowing, foreign or unknown layers and
    groups, repeated destinations, forged generations, unknown workers, no groups) gets its exact
    status and field, over gRPC and on the local calls socket alike, and both workers' memory
    and both daemons' maps stay unchanged."""
    _hostile(c, HOSTILE_PULLS[name], write=False)


@pytest.mark.parametrize("name", list(HOSTILE_PUSHES))
def test_hostile_push_is_refused_and_touches_nothing(c: Cluster, name: str) -> None:
    """Each hostile push (destination or source ids out of range, a destination written twice, a
    layer of another group, a forged generation) gets its exact status and field, over gRPC and
    on the local calls socket alike, and both workers' memory and both daemons' maps stay
    unchanged."""
    _hostile(c, HOSTILE_PUSHES[name], write=True)


def test_pull_from_the_daemon_itself_is_refused(c: Cluster) -> None:
    """A worker naming its own daemon as the remote cannot make the daemon
    copy between its own registrations."""
    spec = c.spec([_g([1], [1])], target=c.d.daemon.tcp_target, remote_engine="decode")
    got, msg = c.transfer(spec, write=False)
    assert got is Code.INVALID_ARGUMENT, (got, msg)
    c.assert_all_intact("after a pull from the daemon itself")


# The Peer port: what a stranger on the network can ask -----------------------------


def _begin(c: Cluster, **kw: Any) -> tuple[Code, str, str]:
    """A BeginTransfer of block 1 of group 0 with the prefill worker's grant
    for it (so that the fields under test are what the owner checks), unless
    ``kw`` says otherwise."""
    fields: dict[str, Any] = {
        "request_id": "attacker",
        "worker": types_pb2.WorkerId(engine_id="prefill"),
        "generation": c.pw.region_map.generation if c.pw.region_map else 1,
        "agent_name": c.p.daemon.agent,
        "peer_agent": "kvmapd-attacker",
        "lease_ms": 1000,
        "blocks": 1,
        "bytes": 64,
        "groups": [types_pb2.BlockGrant(transfer_group=0, block_ids=[1])],
    }
    fields.update(kw)
    if "capability" not in fields:
        fields["capability"] = c.pw.grant(fields["request_id"], {0: [1]})
    try:
        resp = c.p.peer.BeginTransfer(peer_pb2.BeginTransferRequest(**fields), timeout=10)
    except grpc.RpcError as err:
        return err.code(), err.details() or "", ""
    return Code.OK, "", resp.transfer_token


@pytest.mark.parametrize(
    ("fields", "code", "fragment"),
    [
        ({"generation": 2}, Code.FAILED_PRECONDITION, "generation 2 is stale (current 1)"),
        ({"generation": 0}, Code.FAILED_PRECONDITION, "stale"),
        ({"generation": 2**64 - 1}, Code.FAILED_PRECONDITION, "stale"),
        ({"agent_name": "kvmapd-0123456789ab"}, Code.FAILED_PRECONDITION, "handshake again"),
        ({"worker": types_pb2.WorkerId(engine_id="nobody")}, Code.NOT_FOUND, "nobody"),
        ({"worker": types_pb2.WorkerId(engine_id="prefill", tp_rank=1)}, Code.NOT_FOUND, "tp1"),
        ({"worker": types_pb2.WorkerId()}, Code.INVALID_ARGUMENT, "worker.engine_id"),
    ],
)
def test_begin_transfer_with_forged_fields_is_refused(
    c: Cluster, fields: dict[str, Any], code: Code, fragment: str
) -> None:
    """A BeginTransfer with a stale or forged generation, an agent name from an old handshake, an
    unknown or mis-ranked worker, or no worker id gets its exact status and leaves the prefill
    daemon's state and all memory unchanged."""
    before = c.p.snapshot()
    got, msg, _ = _begin(c, **fields)
    assert (got, fragment in msg) == (code, True), (got, msg)
    assert c.p.snapshot() == before
    c.assert_all_intact("after a refused BeginTransfer")


def test_end_transfer_with_unknown_or_forged_tokens_changes_nothing(c: Cluster) -> None:
    """EndTransfer with empty, unknown, malformed or huge tokens is at most NOT_FOUND or
    INVALID_ARGUMENT and changes neither daemon state nor memory."""
    before = c.p.snapshot()
    for token in ["", "0" * 32, "not-a-token", "x" * 10_000]:
        try:
            c.p.peer.EndTransfer(
                peer_pb2.EndTransferRequest(transfer_token=token, completed=True), timeout=10
            )
        except grpc.RpcError as err:
            assert err.code() in (Code.NOT_FOUND, Code.INVALID_ARGUMENT), err
    assert c.p.snapshot() == before
    c.assert_all_intact("after EndTransfer with unknown tokens")


def test_an_announced_transfer_gives_the_announcer_no_access(c: Cluster) -> None:
    """A stranger's announcement of a made-up request without the owner's capability (or with a
    forged one) is PERMISSION_DENIED and changes nothing (it used to be granted a lease). With the
    capability, BeginTransfer only pins: the announcement moves no byte by itself, and ending it
    twice is harmless."""
    before = c.p.snapshot()
    for forged in ("", "A" * 43):
        got, msg, _ = _begin(c, capability=forged)
        assert (got, msg) == (Code.PERMISSION_DENIED, "capability does not allow this transfer")
    assert c.p.snapshot() == before
    got, msg, token = _begin(c)
    assert got is Code.OK, msg
    for _ in range(2):
        c.p.peer.EndTransfer(peer_pb2.EndTransferRequest(transfer_token=token), timeout=10)
    c.assert_all_intact("after a stranger's BeginTransfer/EndTransfer")
