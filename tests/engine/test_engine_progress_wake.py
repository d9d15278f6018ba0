"""The owner's progress loop starts polling when a lease begins, not when its
idle interval runs out: UCX moves a peer's bytes (and delivers its completion
notification) only while the owner's agent is called into, so an owner idling
between transfers would otherwise add up to its idle interval to every pull."""

from __future__ import annotations

import pytest
from harness import cluster, run, spec

from kvmap.daemon.engine import progress
from kvmap.v1 import transfers_pb2

pytestmark = pytest.mark.timeout(60)


def test_a_lease_wakes_an_idle_owner(monkeypatch: pytest.MonkeyPatch) -> None:
    """With an idle interval far longer than the test, a pull from an idle
    owner still completes and the owner still takes its completion
    notification (its lease ends, the worker hears TransferFinished): only
    BeginTransfer waking the owner's loop can make that happen."""
    monkeypatch.setattr(progress, "IDLE_INTERVAL_S", 3600.0)

    async def main() -> None:
        async with cluster() as c:
            a, b = await c.node("a"), await c.node("b")
            wa, wb = c.worker("decode", seed=5), c.worker("prefill", seed=3)
            await a.register(wa)
            await b.register(wb)
            statuses = await a.transfer(spec(wa, b, wb, [(0, 1), (2, 3)]))
            assert statuses[-1].state == transfers_pb2.TRANSFER_STATE_DONE
            assert wa.block(0) == wb.block(1) and wa.block(2) == wb.block(3)
            assert len(b.app.leases) == 0 and b.app.counters.served_done == 1

    run(main())
