"""A pull that meets its owner's daemon restarting is tried again with
backoff until the restarted daemon serves it (the grant was persisted), and
only errors that a retry can cure are retried, within the transfer's
deadline (``TransferEngine`` over the fake NIXL, on a virtual clock)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from harness import Cluster, Node, VirtualClock, Worker, cluster, next_event, run, run_spec, spec

from kvmap.core.errors import NotFound, PermissionDenied, Unavailable
from kvmap.daemon.engine.pacing import PULL_RETRY
from kvmap.daemon.engine.workers import EventQueue
from kvmap.v1 import transfers_pb2

pytestmark = pytest.mark.timeout(60)

DONE = transfers_pb2.TRANSFER_STATE_DONE


async def pair(c: Cluster, clock: VirtualClock, **owner: Any) -> tuple[Node, Worker, Node, Worker]:
    """Puller a (retrying on ``clock``) with worker wa; owner b with wb (seed 3)."""
    a = await c.node("a", pacing=clock.pacing())
    b = await c.node("b", **owner)
    wa, wb = c.worker("decode", seed=5), c.worker("prefill", seed=3)
    await a.register(wa)
    await b.register(wb)
    return a, wa, b, wb


async def pull(a: Node, s: transfers_pb2.TransferSpec) -> list[transfers_pb2.TransferStatus]:
    return [st async for st in run_spec(a.app, s, write=False)]


def test_a_pull_during_the_owners_restart_succeeds_after_it(tmp_path: Path) -> None:
    """The owner's daemon crashes after granting; a pull started while it is
    down fails its handshakes (UNAVAILABLE) and waits; the daemon restarts on
    the same state dir during the third pause, restores the worker and the
    grant, and the pull then lands the right bytes. The owner's worker hears
    exactly one transfer_finished, the grant is spent, and no lease or pin is
    left. (Pins: the retry loop, the persisted grant, and re-admission by a
    restarted owner.)"""
    state: Any = str(tmp_path / "state")
    restarted: list[Node] = []
    heard: list[EventQueue] = []

    async def main() -> None:
        async def restart_on_third_pause(n: int) -> None:
            if n == 3:
                b2 = await c.node("b", instance="b2", state_dir=state)
                restarted.append(b2)
                # Listening from the restart on: the owner may take the
                # pull's notification before the pull's DONE reaches us.
                heard.append(b2.app.table.subscribe(wb.key))

        async with cluster() as c:
            clock = VirtualClock(restart_on_third_pause)
            a, wa, b, wb = await pair(c, clock, state_dir=state)
            s = spec(wa, b, wb, [(0, 1), (2, 6)], request_id="gap")
            c.crash(b)
            statuses = await pull(a, s)
            (b2,) = restarted
            assert statuses[-1].state == DONE and statuses[-1].stats.remote_generation == 2
            assert (wa.block(0), wa.block(2)) == (wb.block(1), wb.block(6))
            assert len(clock.sleeps) == 3 and a.peers.handshakes == ["b:1"] * 4
            (events,) = heard
            finished = (await next_event(events)).transfer_finished
            assert finished.request_id == "gap" and finished.peer_agent == a.app.agent_name
            assert events.empty() and b2.app.counters.served_done == 1
            assert len(b2.app.grants) == 0 and len(b2.app.leases) == 0
            assert b2.app.table.get(wb.key).pins == 0 and a.app.table.get(wa.key).pins == 0

    run(main())


def test_a_refused_capability_is_not_retried() -> None:
    """PERMISSION_DENIED from the owner ends the pull at once: exactly one
    BeginTransfer, no pause, nothing moved."""

    async def main() -> None:
        async with cluster() as c:
            clock = VirtualClock()
            a, wa, b, wb = await pair(c, clock)
            with pytest.raises(PermissionDenied):
                await pull(a, spec(wa, b, wb, [(0, 1)], capability="not-a-grant"))
            assert len(a.peers.begun) == 1 and clock.sleeps == []
            assert wa.block(0) != wb.block(1) and len(b.app.leases) == 0

    run(main())


def test_a_worker_the_owner_does_not_have_is_not_retried() -> None:
    """NOT_FOUND of the remote worker (the owner is up and says it does not
    exist) ends the pull after one handshake, with no pause."""

    async def main() -> None:
        async with cluster() as c:
            clock = VirtualClock()
            a, wa, b, _ = await pair(c, clock)
            with pytest.raises(NotFound):
                await pull(a, spec(wa, b, Worker("nobody"), [(0, 1)]))
            assert a.peers.handshakes == ["b:1"] and clock.sleeps == []

    run(main())


def test_an_owner_that_stays_down_fails_with_the_last_error_at_the_deadline() -> None:
    """With the owner gone for good, the pull pauses 0.05, 0.1, then 0.2 s
    (no jitter) within its 1 s deadline, gives up when the next pause (0.25 s)
    would leave its last attempt less than the policy's 0.5 s, and fails with
    the owner's UNAVAILABLE, not a deadline; one handshake per attempt, and
    the local worker is unpinned."""

    async def main() -> None:
        async with cluster() as c:
            clock = VirtualClock()
            a, wa, b, wb = await pair(c, clock)
            s = spec(wa, b, wb, [(0, 1)], timeout_ms=1000)
            c.crash(b)
            with pytest.raises(Unavailable, match="nothing listens"):
                await pull(a, s)
            assert clock.sleeps == pytest.approx([0.05, 0.1, 0.2])
            left = 1.0 - clock.now
            assert left >= PULL_RETRY.attempt_s > left - PULL_RETRY.delay(3, 0.0)
            assert len(a.peers.handshakes) == 4 and a.peers.begun == []
            assert a.app.table.get(wa.key).pins == 0 and a.app.counters.failed == 1

    run(main())
