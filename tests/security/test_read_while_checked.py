"""A decode daemon started with ``--no-check-before-read`` reads while the
owner checks each pull, against real daemons, tried as an attacker would:
pulls with a capability for other blocks, of another request, made up or
expired. Each fails with the status the default order gives; nothing
changes at the owner (no lease, no use spent, the prefill worker not told,
its memory intact); the only bytes that may change are the refused pull's
own destination blocks on the decode, never reported loaded. Pushes still
wait for the owner: a refused push writes nothing."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from security_support import Cluster, Code, expect_transfer, start_cluster

from kvmap.v1 import admin_pb2, admin_pb2_grpc, registry_pb2

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

DENIED = "capability does not allow this transfer"
DEST = 7  # the decode block every refused pull names as its destination


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from start_cluster(
        tmp_path_factory.mktemp("overlap"), decode_flags=("--no-check-before-read",)
    )


def leases(c: Cluster) -> int:
    stub = admin_pb2_grpc.AdminStub(c.p.unix)
    return int(stub.GetStats(admin_pb2.GetStatsRequest(), timeout=10).leases)


def accept_destination(c: Cluster, block: int) -> None:
    """Take whatever a refused pull's read left in decode ``block`` (group
    0) as expected: the one change reading while the owner checks allows."""
    for layer in c.dw.layer_names(0):
        span = c.dw.span(0, block, layer)
        c.dw.expected[span] = c.dw.buf[span]


# Each: the capability presented for a pull of prefill block 5 into decode
# block DEST, and the status the owner answers.
REFUSED: dict[str, tuple[Callable[[Cluster], str], Code, str]] = {
    "a capability for another block": (
        lambda c: c.pw.grant("req", {0: [6]}),
        Code.PERMISSION_DENIED,
        DENIED,
    ),
    "a capability of another request": (
        lambda c: c.pw.grant("other", {0: [5]}),
        Code.PERMISSION_DENIED,
        DENIED,
    ),
    "a made-up capability": (lambda c: "A" * 43, Code.PERMISSION_DENIED, DENIED),
    "an expired capability": (
        lambda c: c.pw.expired_grant("req", {0: [5]}),
        Code.FAILED_PRECONDITION,
        "expired",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_refused_pull_fails_and_changes_nothing_but_its_own_destination(
    c: Cluster, case: str
) -> None:
    """The pull fails with the owner's status; the owner's state, leases and
    worker memory are as they were; on the decode only the destination
    block named by the refused pull may differ; the next good pull works
    and is the one the prefill worker hears of."""
    make, code, fragment = REFUSED[case]
    before, held = c.p.snapshot(), leases(c)
    spec = c.spec(
        [{"group": 0, "local": [DEST], "remote": [5]}], request_id="req", capability=make(c)
    )
    got, details = c.transfer(spec, write=False)
    assert got is code and fragment in details, (got, details)
    assert leases(c) == held and c.p.snapshot() == before
    c.pw.assert_intact(f"after {case}")
    accept_destination(c, DEST)
    c.dw.assert_intact(f"outside the refused pull's destination, after {case}")
    good = c.spec([{"group": 0, "local": [1], "remote": [2]}], request_id=f"good-{case[:10]}")
    assert c.transfer(good, write=False) == (Code.OK, "")
    expect_transfer(c.dw, c.pw, 0, [1], [2])
    c.assert_all_intact(f"after the good pull following {case}")


def test_a_capability_is_used_once_when_pulls_read_while_the_owner_checks(c: Cluster) -> None:
    """The first pull with a capability lands its bytes; the second, with
    the same capability, is refused (its use was spent by the first one's
    notification) and leaves no lease."""
    cap = c.pw.grant("once", {0: [3]})
    spec = c.spec([{"group": 0, "local": [3], "remote": [3]}], request_id="once", capability=cap)
    assert c.transfer(spec, write=False) == (Code.OK, "")
    expect_transfer(c.dw, c.pw, 0, [3], [3])
    c.assert_all_intact("after the first pull")
    deadline = time.monotonic() + 10
    while leases(c):  # the first pull's notification ends its lease
        assert time.monotonic() < deadline, "the first pull's lease never ended"
        time.sleep(0.02)
    again = c.spec([{"group": 0, "local": [4], "remote": [3]}], request_id="once", capability=cap)
    got, details = c.transfer(again, write=False)
    assert (got, details.endswith(DENIED)) == (Code.PERMISSION_DENIED, True), details
    assert leases(c) == 0
    c.pw.assert_intact("after the second pull")
    accept_destination(c, 4)
    c.dw.assert_intact("outside the refused pull's destination")


def test_a_refused_push_writes_nothing_at_the_owner(c: Cluster) -> None:
    """A push writes the owner's memory, so even with reads that do not wait
    it goes only after the owner agreed: a push with a capability for
    another block is refused and every byte of both workers is as it was."""
    cap = c.pw.grant("push", {0: [9]}, access=registry_pb2.GRANT_ACCESS_WRITE)
    spec = c.spec([{"group": 0, "local": [2], "remote": [8]}], request_id="push", capability=cap)
    got, details = c.transfer(spec, write=True)
    assert (got, details.endswith(DENIED)) == (Code.PERMISSION_DENIED, True), details
    c.assert_all_intact("after a refused push")
