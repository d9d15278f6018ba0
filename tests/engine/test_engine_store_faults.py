"""A state store that fails under a running daemon (a real SQLite FULL from
``max_page_count``, a real READONLY from ``query_only``): the RPC that needed
the write fails and changes nothing, and the daemon goes on serving what it
has (``DaemonApp`` over the fake NIXL)."""

from __future__ import annotations

import pytest
from harness import Node, Worker, cluster, run, spec
from structlog.testing import capture_logs

from kvmap.core.geometry import WorkerGeometry
from kvmap.daemon.adapters.state_store import StateStore, StoreFull, StoreUnavailable
from kvmap.daemon.api import wire_in

pytestmark = pytest.mark.timeout(60)


def _fill(store: StateStore) -> None:
    pages = store._db.execute("PRAGMA page_count").fetchone()[0]
    store._db.execute(f"PRAGMA max_page_count={pages}")


async def _big(node: Node, worker: Worker) -> WorkerGeometry:
    """The worker's registration with 40 KB of layer names: more than the free room of any page
    the store has."""
    req = worker.request(await node.hand_over(worker))
    for view in req.views:
        view.layer_name += "-" + "x" * 20_000
    return wire_in.registration(req)


def _read_only(store: StateStore) -> None:
    store._db.execute("PRAGMA query_only=1")


def _state(node: Node) -> tuple[object, ...]:
    agent = node.agent
    return (
        {r.key: r.generation for r in node.app.table.records()},
        node.app.adapters.shm.live_mappings(),
        agent.registrations,
        agent.live_dlists,
        [s.worker for s in node.app.store.workers()],
    )


def test_a_registration_the_store_cannot_hold_changes_nothing() -> None:
    """With the store full, registering a second worker is StoreFull and leaves no mapping, NIXL
    registration, local descriptor list, table entry or stored row behind; the first worker is
    still served and the same registration succeeds once there is room."""

    async def main() -> None:
        async with cluster() as c:
            a = await c.node("a")
            w1, w2 = c.worker("w1"), c.worker("w2")
            first = await a.register(w1)
            before = _state(a)
            _fill(a.app.store)
            with pytest.raises(StoreFull, match=r"^state store .* is full: "):
                await a.app.registrar.register(await _big(a, w2), a.app.planner)
            assert _state(a) == before
            assert a.app.table.get(w1.key) is first
            a.app.store._db.execute("PRAGMA max_page_count=1000000")
            record = await a.app.registrar.register(await _big(a, w2), a.app.planner)
            assert record.key == w2.key

    run(main())


def test_a_deregistration_the_store_cannot_record_changes_nothing() -> None:
    """With the store read-only, DeregisterWorker is StoreUnavailable and the worker stays
    registered (in memory and in the store): the daemon never serves a state it cannot keep."""

    async def main() -> None:
        async with cluster() as c:
            a = await c.node("a")
            w = c.worker("w")
            await a.register(w)
            before = _state(a)
            _read_only(a.app.store)
            with pytest.raises(StoreUnavailable, match=r"is read-only"):
                await a.app.registrar.deregister(w.key)
            assert _state(a) == before

    run(main())


def test_a_worker_that_is_gone_is_released_even_if_the_store_cannot_say_so() -> None:
    """A worker whose Attach stream ended is released (unmapped, deregistered from NIXL) even with
    a read-only store, with an error log line; its stale row is what the store still holds."""

    async def main() -> None:
        async with cluster() as c:
            a = await c.node("a")
            w = c.worker("w")
            await a.register(w)
            _read_only(a.app.store)
            with capture_logs() as logs:
                await a.app.lifecycle.worker_gone(w.key)
            assert len(a.app.table) == 0 and a.app.adapters.shm.live_mappings() == 0
            assert a.agent.registrations == () and a.agent.live_dlists == ()
            assert "worker_forgotten_unsaved" in [e["event"] for e in logs]
            assert [s.worker for s in a.app.store.workers()] == [w.key]

    run(main())


def test_a_completion_the_store_cannot_persist_is_still_delivered() -> None:
    """With the owner's store read-only, a pull's completion notification still ends the lease and
    reaches the owner's worker live (logged as not stored): the progress loop survives and the next
    pull works too."""

    async def main() -> None:
        async with cluster() as c:
            a, b = await c.node("a"), await c.node("b")
            wa, wb = c.worker("decode"), c.worker("prefill", seed=3)
            await a.register(wa)
            await b.register(wb)
            # Granted first: a capability the store cannot keep is not granted.
            pulls = [spec(wa, b, wb, [(0, 1)]), spec(wa, b, wb, [(2, 3)], request_id="req-2")]
            _read_only(b.app.store)
            with capture_logs() as logs:
                for pull in pulls:
                    await a.transfer(pull)
            assert [e["event"] for e in logs].count("event_not_stored") == 2
            assert wa.block(0) == wb.block(1) and wa.block(2) == wb.block(3)
            assert len(b.app.leases) == 0

    run(main())
