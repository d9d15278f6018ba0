"""The owner's side of a transfer: leases pin the worker's record until
the puller's NIXL notification arrives (or the lease runs out), and the
notification becomes a TransferFinished event for the worker, persisted until
an Attach stream sends it."""

from __future__ import annotations

import asyncio
import math
from typing import Literal

import pytest
from harness import Node, cluster, next_event, run, run_spec, spec, two

from kvmap.core.worker_events import TransferDirection, TransferFinished
from kvmap.v1 import transfers_pb2

pytestmark = pytest.mark.timeout(60)


class WatchedEvent(asyncio.Event):
    """An Event that tells when something starts waiting on it."""

    def __init__(self) -> None:
        super().__init__()
        self.awaited = asyncio.Event()

    async def wait(self) -> Literal[True]:
        self.awaited.set()
        return await super().wait()


async def pull(node: Node, s: transfers_pb2.TransferSpec) -> list[transfers_pb2.TransferStatus]:
    """A pull that does not wait for the owner to hear of it."""
    return [status async for status in run_spec(node.app, s, write=False)]


def test_notification_ends_the_lease_and_is_persisted_for_the_worker() -> None:
    """While a pull is in flight the owner holds a lease pinning the worker;
    the puller's notification ends it, unpins the record, and the
    TransferFinished event is stored until acknowledged."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c, decode_seed=0)
            net = a.agent.network
            net.hold()
            pull = asyncio.create_task(a.transfer(spec(wa, b, wb, [(0, 1)])))
            await asyncio.to_thread(net.posted.wait, 5.0)
            record = b.app.table.get(wb.key)
            assert len(b.app.leases) == 1 and record.pins == 1
            net.release_held()
            await pull
            assert len(b.app.leases) == 0 and record.pins == 0 and record.unpinned.is_set()
            ((_, event),) = b.app.store.pending_events(wb.key)
            assert isinstance(event, TransferFinished) and event.request_id == "req-1"
            assert event.direction is TransferDirection.PULLED_FROM
            assert b.app.counters.served_done == 1 and b.app.counters.served_blocks == 1

    run(main())


def test_expired_lease_unpins_and_its_late_notification_is_ignored() -> None:
    """A lease that runs out releases its pin at once; the notification that
    arrives after it matches nothing and tells the worker nothing (the next
    transfer's event is the only one)."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c, decode_seed=0)
            net = a.agent.network
            net.hold()
            events = b.app.table.subscribe(wb.key)
            late = asyncio.create_task(pull(a, spec(wa, b, wb, [(0, 1)], request_id="late")))
            await asyncio.to_thread(net.posted.wait, 5.0)
            (expired,) = b.app.leases.expire(now=math.inf)
            assert expired.request_id == "late" and b.app.table.get(wb.key).pins == 0
            net.release_held()
            assert (await late)[-1].state == transfers_pb2.TRANSFER_STATE_DONE
            await a.transfer(spec(wa, b, wb, [(2, 3)], request_id="next"))
            assert (await next_event(events)).transfer_finished.request_id == "next"
            assert events.empty() and b.app.counters.served_done == 1

    run(main())


def test_deregistration_waits_for_the_transfer_pinning_the_worker() -> None:
    """A worker deregistered while a peer pulls from it keeps its memory
    registered until the pull completes: the pull moves the right bytes, and
    the memory is released afterwards."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c, decode_seed=0)
            net = a.agent.network
            net.hold()
            pull = asyncio.create_task(a.transfer(spec(wa, b, wb, [(0, 4)])))
            await asyncio.to_thread(net.posted.wait, 5.0)
            record = b.app.table.get(wb.key)
            record.unpinned = unpinned = WatchedEvent()
            gone = asyncio.create_task(b.app.lifecycle.worker_gone(wb.key))
            await asyncio.wait_for(unpinned.awaited.wait(), 5.0)
            assert b.app.table.find(wb.key) is None and len(b.agent.registrations) == 1
            net.release_held()
            await pull
            await gone
            assert wa.block(0) == wb.block(4)
            assert b.app.adapters.shm.live_mappings() == 0 and not b.agent.registrations

    run(main())
