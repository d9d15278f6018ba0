"""The background granter (kvmap.client.connector.granter): grants handed
on by the scheduler are made in order, under the capabilities the scheduler
drew; a failed job takes back what it granted and is reported so its
blocks are freed; a job that waited too long is never granted; a daemon
that drew capabilities of its own is a failure. kvmapd is replaced by a
recording stand-in (what is tested is the thread's order and bookkeeping;
tests/client/test_background_grants.py runs it against a real daemon)."""

from __future__ import annotations

import re
import threading
from typing import Any

import pytest

from kvmap.client.connector.granter import BackgroundGranter, RankGrant, new_capability
from kvmap.core.errors import Unavailable
from kvmap.core.grants import CALLER_CAPABILITY
from kvmap.v1 import registry_pb2, types_pb2


class StandInClient:
    """Records grants and revokes; ``refuse`` names the (request, rank)
    grants that fail, ``own_capability`` makes it answer as an older kvmapd."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int, str]] = []
        self.refuse: set[tuple[str, int]] = set()
        self.own_capability = False
        self.one_use = False
        self.gate = threading.Event()
        self.gate.set()
        # Set once a grant call has started (it then waits for ``gate``).
        self.entered = threading.Event()

    def grant_transfer(
        self, worker: types_pb2.WorkerId, request_id: str, blocks: Any, **kw: Any
    ) -> registry_pb2.GrantTransferResponse:
        self.entered.set()
        self.gate.wait(10)
        self.calls.append(("grant", request_id, worker.tp_rank, kw["capability"]))
        if (request_id, worker.tp_rank) in self.refuse:
            raise Unavailable("kvmapd is not there")
        cap = "X" * 43 if self.own_capability else kw["capability"]
        open_uses = kw["open_uses"] and not self.one_use
        return registry_pb2.GrantTransferResponse(capability=cap, open_uses=open_uses)

    def revoke_transfer(self, worker: types_pb2.WorkerId, request_id: str) -> int:
        self.calls.append(("revoke", request_id, worker.tp_rank, ""))
        return 0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def rank(r: int) -> RankGrant:
    return RankGrant(
        worker=types_pb2.WorkerId(engine_id="p", tp_rank=r),
        capability=new_capability(),
        blocks={0: [1, 2]},
        ttl_ms=60_000,
        max_uses=0,
        open_uses=True,
        unread_release=registry_pb2.UNREAD_RELEASE_REFUSED,
    )


@pytest.fixture
def client() -> StandInClient:
    return StandInClient()


def test_capabilities_are_drawn_as_kvmapd_draws_them() -> None:
    """256 random bits in kvmapd's own form (its check accepts them), never twice."""
    drawn = {new_capability() for _ in range(1000)}
    assert len(drawn) == 1000
    assert all(CALLER_CAPABILITY.fullmatch(c) and len(c) == 43 for c in drawn)
    assert all(re.fullmatch(r"[A-Za-z0-9_-]+", c) for c in drawn)


def test_jobs_are_granted_in_order_under_the_drawn_capabilities(client: StandInClient) -> None:
    """Every rank of every job, in the order handed on, with the capability
    the scheduler already gave out; nothing reported failed."""
    granter = BackgroundGranter(client, max_age_s=5.0)  # type: ignore[arg-type]
    jobs = {f"r{i}": [rank(0), rank(1)] for i in range(5)}
    for rid, grants in jobs.items():
        granter.submit(rid, grants)
    assert granter.idle(10)
    expected = [
        ("grant", rid, g.worker.tp_rank, g.capability) for rid, gs in jobs.items() for g in gs
    ]
    assert client.calls == expected
    assert granter.failed() == []
    granter.close()


def test_a_failed_rank_takes_back_the_ranks_granted_and_is_reported(
    client: StandInClient,
) -> None:
    """Rank 1 of r1 fails: rank 0 of r1 is revoked, r1 is reported (its
    blocks are freed at once), and the next job is still granted."""
    client.refuse = {("r1", 1)}
    granter = BackgroundGranter(client, max_age_s=5.0)  # type: ignore[arg-type]
    granter.submit("r1", [rank(0), rank(1), rank(2)])
    granter.submit("r2", [rank(0)])
    assert granter.idle(10)
    assert [c[:3] for c in client.calls] == [
        ("grant", "r1", 0),
        ("grant", "r1", 1),
        ("revoke", "r1", 0),
        ("grant", "r2", 0),
    ]
    assert granter.failed() == ["r1"]
    assert granter.failed() == []
    granter.close()


@pytest.mark.parametrize("older", ["own capability", "one-use grant"])
def test_an_older_daemon_is_a_failure_and_is_remembered(client: StandInClient, older: str) -> None:
    """An older kvmapd ignores the drawn capability, or makes a one-use grant
    of an open one: what was handed on would never work (or would not work
    for every decode rank), so the grant is revoked, the request reported,
    and the granter says so (the scheduler grants in place from then on)."""
    client.own_capability = older == "own capability"
    client.one_use = older == "one-use grant"
    granter = BackgroundGranter(client, max_age_s=5.0)  # type: ignore[arg-type]
    assert not granter.older_kvmapd
    granter.submit("r1", [rank(0)])
    assert granter.idle(10)
    assert [c[:3] for c in client.calls] == [("grant", "r1", 0), ("revoke", "r1", 0)]
    assert granter.failed() == ["r1"]
    assert granter.older_kvmapd
    granter.close()


def test_a_refused_grant_is_no_sign_of_an_older_daemon(client: StandInClient) -> None:
    """kvmapd unreachable is a failed job, not a reason to stop granting
    off the scheduler thread."""
    client.refuse = {("r1", 0)}
    granter = BackgroundGranter(client, max_age_s=5.0)  # type: ignore[arg-type]
    granter.submit("r1", [rank(0)])
    assert granter.idle(10)
    assert granter.failed() == ["r1"] and not granter.older_kvmapd
    granter.close()


def test_a_job_that_waited_too_long_is_never_granted(client: StandInClient) -> None:
    """A capability must not come alive long after it was handed on: a job
    still queued past max_age_s is dropped and reported, not granted."""
    clock = Clock()
    client.gate.clear()  # the first grant hangs in kvmapd
    granter = BackgroundGranter(client, max_age_s=5.0, clock=clock)  # type: ignore[arg-type]
    granter.submit("slow", [rank(0)])
    granter.submit("late", [rank(0)])
    assert client.entered.wait(10)  # "slow" was taken before the clock moves
    clock.now += 6.0
    client.gate.set()
    assert granter.idle(10)
    assert [c[:2] for c in client.calls] == [("grant", "slow")]
    assert granter.failed() == ["late"]
    granter.close()
