"""A worker whose memory the restarted daemon cannot open by itself (a memfd
handed over with SCM_RIGHTS from another PID namespace: no /proc path leads
to it) is not restored; its client registers it again. Registered over the
very same memory, it keeps the grants and the undelivered events it had
before the restart: a capability minted before a ``kill -9`` still admits
its pull. Registered over other memory, it keeps nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from harness import Cluster, Node, Worker, cluster, run, spec

from kvmap.core.errors import FailedPrecondition, PermissionDenied, Unavailable
from kvmap.core.worker_events import TransferDirection, TransferFinished
from kvmap.daemon.engine import registration
from kvmap.v1 import transfers_pb2

pytestmark = pytest.mark.timeout(60)

DONE = transfers_pb2.TRANSFER_STATE_DONE


async def crash_and_restart_unreopenable(
    c: Cluster, b: Node, wb: Worker, state: str, monkeypatch: pytest.MonkeyPatch
) -> Node:
    """``kill -9`` of b; its successor on the same state dir cannot reopen
    any memory by itself (what /proc of another PID namespace gives: nothing),
    so it waits for wb's client and tells peers to retry meanwhile."""
    c.crash(b)
    monkeypatch.setattr(registration, "reopen_fd", lambda info: None)
    b2 = await c.node("b", instance="b2", state_dir=state)  # type: ignore[arg-type]
    assert b2.app.table.find(wb.key) is None
    with pytest.raises(Unavailable):
        b2.app.lifecycle.worker_for_peer(wb.key)
    return b2


def finished_ids(node: Node, worker: Worker) -> list[str]:
    """The request ids of the transfer_finished events waiting for the
    worker's Attach in the daemon's store."""
    return [
        e.request_id
        for _, e in node.app.store.pending_events(worker.key)
        if isinstance(e, TransferFinished) and e.direction is TransferDirection.PULLED_FROM
    ]


def test_the_same_memory_registered_again_keeps_its_grants_and_events(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pull finished before the crash (its event not yet read by the worker) and a capability
    granted before it: after the restart and the client's re-registration of the same memfd, the
    event still waits for the worker's Attach, and the capability admits its pull at the new
    generation, moving the right bytes."""

    async def main() -> None:
        async with cluster() as c:
            a = await c.node("a")
            wa = c.worker("decode")
            await a.register(wa)
            state: Any = str(tmp_path / "state")
            b = await c.node("b", state_dir=state)
            wb = c.worker("prefill", seed=4)
            await b.register(wb)
            await a.transfer(spec(wa, b, wb, [(0, 1)], request_id="before"))
            cap = b.grant(wb, "granted", {0: [2, 5]})
            b2 = await crash_and_restart_unreopenable(c, b, wb, state, monkeypatch)
            record = await b2.register(wb)  # what the connector's session does
            assert record.generation > 1
            assert len(b2.app.grants) == 1
            assert finished_ids(b2, wb) == ["before"]
            pulled = await a.transfer(
                spec(wa, b2, wb, [(3, 2), (4, 5)], request_id="granted", capability=cap)
            )
            assert pulled[-1].state == DONE
            assert (wa.block(3), wa.block(4)) == (wb.block(2), wb.block(5))
            assert finished_ids(b2, wb) == ["before", "granted"]
            assert len(b2.app.grants) == 0  # spent

    run(main())


def test_other_memory_under_the_same_worker_keeps_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker comes back under the same identity and geometry but over another memfd (a new
    process): the grants minted before the restart are withdrawn (their block ids may hold other
    KV now) and the events of the old memory are not replayed to it."""

    async def main() -> None:
        async with cluster() as c:
            a = await c.node("a")
            wa = c.worker("decode")
            await a.register(wa)
            state: Any = str(tmp_path / "state")
            b = await c.node("b", state_dir=state)
            wb = c.worker("prefill", seed=4)
            await b.register(wb)
            await a.transfer(spec(wa, b, wb, [(0, 1)], request_id="before"))
            cap = b.grant(wb, "granted", {0: [2]})
            b2 = await crash_and_restart_unreopenable(c, b, wb, state, monkeypatch)
            other = c.worker("prefill", seed=9)
            await b2.register(other)
            assert len(b2.app.grants) == 0
            assert finished_ids(b2, other) == []
            with pytest.raises(PermissionDenied):
                await a.transfer(
                    spec(wa, b2, other, [(3, 2)], request_id="granted", capability=cap)
                )
            assert wa.block(3) != other.block(2)

    run(main())


def test_a_restored_worker_is_granted_before_its_client_attaches_again(tmp_path: Path) -> None:
    """Right after a restart the daemon has the worker back (restored over its memory) but its
    client is still in its reconnect backoff: a GrantTransfer then (a prefill that just finished)
    is granted, not refused, its pull lands, and its finished event waits in the store for the
    worker's Attach. A worker registered afresh that never attached still gets no grant."""

    async def main() -> None:
        async with cluster() as c:
            a = await c.node("a")
            wa = c.worker("decode")
            await a.register(wa)
            state: Any = str(tmp_path / "state")
            b = await c.node("b", state_dir=state)
            wb = c.worker("prefill", seed=4)
            await b.register(wb)
            c.crash(b)
            b2 = await c.node("b", instance="b2", state_dir=state)
            assert b2.app.table.find(wb.key) is not None
            assert b2.app.table.subscriber_count(wb.key) == 0
            cap, _ = b2.app.owner.grant(
                wb.key, request_id="just-after", groups=[(0, [6])], ttl_ms=60_000, max_uses=1
            )
            pulled = await a.transfer(
                spec(wa, b2, wb, [(7, 6)], request_id="just-after", capability=cap)
            )
            assert pulled[-1].state == DONE
            assert wa.block(7) == wb.block(6)
            assert finished_ids(b2, wb) == ["just-after"]
            fresh = c.worker("fresh")
            await b2.register(fresh)
            with pytest.raises(FailedPrecondition):
                b2.app.owner.grant(
                    fresh.key, request_id="r", groups=[(0, [1])], ttl_ms=60_000, max_uses=1
                )

    run(main())
