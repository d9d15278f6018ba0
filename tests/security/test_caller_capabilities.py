"""Capabilities a worker drew itself (GrantTransferRequest.capability),
against real daemons. vLLM's scheduler draws them and grants them off its
thread, so the capability reaches the decode side before the grant may
reach the owner. What must hold: a drawn capability grants exactly what a
daemon-drawn one does; a malformed one is INVALID_ARGUMENT and one that is
already a grant's is ALREADY_EXISTS, changing nothing; a decode that asks
a moment before the grant arrives still loads (it asks again within the
grant race window), and one whose capability is never granted is refused
as before, moving no byte."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from security_support import CALL_TIMEOUT_S, Cluster, Code, expect_transfer, start_cluster

from kvmap.core.retry import GRANT_RACE_S
from kvmap.v1 import registry_pb2, types_pb2

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

DENIED = "capability does not allow this transfer"


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from start_cluster(tmp_path_factory.mktemp("drawn"))


def grant(c: Cluster, request_id: str, block: int, capability: str) -> str:
    resp = c.p.registry.GrantTransfer(
        registry_pb2.GrantTransferRequest(
            worker=c.pw.worker_id,
            request_id=request_id,
            groups=[types_pb2.BlockGrant(transfer_group=0, block_ids=[block])],
            max_uses=1,
            capability=capability,
        ),
        timeout=CALL_TIMEOUT_S,
    )
    return str(resp.capability)


def pull(c: Cluster, request_id: str, local: int, remote: int, capability: str) -> tuple[Code, str]:
    spec = c.spec(
        [{"group": 0, "local": [local], "remote": [remote]}],
        request_id=request_id,
        capability=capability,
    )
    return c.transfer(spec, write=False)


def test_a_drawn_capability_grants_what_a_daemon_drawn_one_does(c: Cluster) -> None:
    """The daemon grants under the caller's capability and answers with it;
    the pull it allows moves exactly its block, once."""
    drawn = secrets.token_urlsafe(32)
    assert grant(c, "drawn-1", 3, drawn) == drawn
    assert pull(c, "drawn-1", 5, 3, drawn) == (Code.OK, "")
    expect_transfer(c.dw, c.pw, 0, [5], [3])
    code, details = pull(c, "drawn-1", 5, 3, drawn)
    assert (code, details.endswith(DENIED)) == (Code.PERMISSION_DENIED, True), details
    c.assert_all_intact("after a drawn capability's pull and its refused replay")


@pytest.mark.parametrize(
    "capability",
    ["short", "A" * 42, "A" * 129, "has spaces" + "A" * 40, "slash/" + "A" * 40, "é" * 43],
)
def test_a_malformed_drawn_capability_is_invalid_argument(c: Cluster, capability: str) -> None:
    """Too short to hold 256 bits, too long, or not URL-safe: refused naming
    the field, nothing granted."""
    before = c.p.snapshot()
    with pytest.raises(grpc.RpcError) as err:
        grant(c, "drawn-bad", 4, capability)
    assert err.value.code() is Code.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("capability:"), err.value.details()
    assert c.p.snapshot() == before


def test_a_capability_already_granted_is_already_exists(c: Cluster) -> None:
    """Drawing a live grant's capability again (a bug, or a caller that
    wants to widen one) is refused; the first grant is unchanged."""
    drawn = secrets.token_urlsafe(32)
    grant(c, "drawn-twice", 6, drawn)
    with pytest.raises(grpc.RpcError) as err:
        grant(c, "drawn-twice-other", 7, drawn)
    assert err.value.code() is Code.ALREADY_EXISTS, err.value.details()
    code, details = pull(c, "drawn-twice-other", 8, 7, drawn)
    assert (code, details.endswith(DENIED)) == (Code.PERMISSION_DENIED, True), details
    assert pull(c, "drawn-twice", 8, 6, drawn) == (Code.OK, "")
    expect_transfer(c.dw, c.pw, 0, [8], [6])
    c.assert_all_intact("after a refused second grant")


def test_a_pull_that_comes_before_its_grant_still_loads(c: Cluster) -> None:
    """The race the worker's background grant opens: the decode presents
    the capability before the owner has it; the grant lands a moment later
    (inside GRANT_RACE_S) and the pull, asking again, loads."""
    drawn = secrets.token_urlsafe(32)
    late = threading.Timer(GRANT_RACE_S / 5, grant, args=(c, "drawn-race", 9, drawn))
    late.start()
    try:
        assert pull(c, "drawn-race", 10, 9, drawn) == (Code.OK, "")
    finally:
        late.join()
    expect_transfer(c.dw, c.pw, 0, [10], [9])
    c.assert_all_intact("after the raced pull")


def test_a_capability_never_granted_is_refused_after_the_race_window(c: Cluster) -> None:
    """Asking again is bounded: a capability no grant ever had is refused
    with the usual message once the window is over, and moves nothing."""
    before = c.p.snapshot()
    start = time.monotonic()
    code, details = pull(c, "drawn-never", 11, 12, secrets.token_urlsafe(32))
    assert (code, details.endswith(DENIED)) == (Code.PERMISSION_DENIED, True), details
    assert time.monotonic() - start >= GRANT_RACE_S
    assert c.p.snapshot() == before
    c.assert_all_intact("after a refused pull")
