"""Per-request capabilities in the engine: the owner admits a transfer only
with a capability that allows it, binds the lease to the claiming agent,
frees a request's blocks only on that agent's notification, consumes the
capability on completion and releases it when the transfer fails or its lease
runs out; the puller refuses a spec without one before dialling anyone."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest
from harness import (
    HARNESS_PEER,
    Node,
    Worker,
    begin_transfer,
    cluster,
    next_event,
    run,
    spec,
    two,
)

from kvmap.core.errors import PermissionDenied
from kvmap.daemon.engine.leases import notification
from kvmap.v1 import peer_pb2, transfers_pb2

pytestmark = pytest.mark.timeout(60)


def announce(
    b: Node, wb: Worker, capability: str, *, peer: str, blocks: list[int], request_id: str = "r"
) -> peer_pb2.BeginTransferRequest:
    """A BeginTransfer as a peer agent sends it to ``b``."""
    return peer_pb2.BeginTransferRequest(
        request_id=request_id,
        worker=wb.id,
        generation=b.app.table.get(wb.key).generation,
        agent_name=b.app.agent_name,
        peer_agent=peer,
        lease_ms=60_000,
        blocks=len(blocks),
        capability=capability,
        groups=[{"transfer_group": 0, "block_ids": blocks}],
    )


def test_a_spec_without_capability_is_refused_before_any_peer_is_dialled() -> None:
    """The puller refuses a spec with no capability (PermissionDenied):
    no handshake, no BeginTransfer, no remote agent loaded."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c, decode_seed=0)
            with pytest.raises(PermissionDenied):
                await a.transfer(spec(wa, b, wb, [(0, 1)], capability=""))
            assert a.peers.begun == [] and a.app.engine.remote_agent_count == 0
            assert wa.block(0) != wb.block(1)

    run(main())


def test_a_completed_pull_consumes_the_capability() -> None:
    """The capability's one use is spent by the completed pull: the same
    spec again is refused, with no lease, pin or event at the owner."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c, decode_seed=0)
            s = spec(wa, b, wb, [(0, 1)])
            await a.transfer(s)
            assert wa.block(0) == wb.block(1) and len(b.app.grants) == 0
            served = b.app.counters.served_done
            with pytest.raises(PermissionDenied):
                await a.transfer(s)
            assert len(b.app.leases) == 0 and b.app.table.get(wb.key).pins == 0
            assert b.app.counters.served_done == served

    run(main())


def test_only_the_lease_holders_notification_frees_the_request() -> None:
    """A "done" notification carrying a live lease's token from another
    agent is ignored: the lease, its pin and the worker's blocks stay, the
    worker hears nothing; the holder's own notification then ends it."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c, decode_seed=0)
            net = a.agent.network
            net.hold()
            events = b.app.table.subscribe(wb.key)
            pull = asyncio.create_task(a.transfer(spec(wa, b, wb, [(0, 1)])))
            await asyncio.to_thread(net.posted.wait, 5.0)
            (token,) = a.peers.tokens
            b.app.owner.on_notifs({"kvmapd-mallory": [notification(token)]})
            assert len(b.app.leases) == 1 and b.app.table.get(wb.key).pins == 1
            assert events.empty() and b.app.store.pending_events(wb.key) == []
            assert b.app.counters.served_done == 0
            net.release_held()
            await pull
            finished = (await next_event(events)).transfer_finished
            assert (finished.request_id, finished.peer_agent) == ("req-1", a.app.agent_name)
            assert len(b.app.leases) == 0 and b.app.counters.served_done == 1

    run(main())


def test_a_claim_excludes_other_agents_until_released() -> None:
    """The first admitted agent claims the capability: another agent is
    refused and nothing changes; when the holder gives up (EndTransfer) or
    its lease runs out, the capability may be tried again."""

    async def main() -> None:
        async with cluster() as c:
            _, _, b, wb = await two(c, decode_seed=0)
            cap = b.grant(wb, "r", {0: [1, 2]})
            first = begin_transfer(b.app, announce(b, wb, cap, peer="agent-x", blocks=[1]))
            with pytest.raises(PermissionDenied):
                begin_transfer(b.app, announce(b, wb, cap, peer="agent-y", blocks=[1]))
            assert len(b.app.leases) == 1 and b.app.table.get(wb.key).pins == 1
            b.app.owner.end(first.token, peer=HARNESS_PEER)
            second = begin_transfer(b.app, announce(b, wb, cap, peer="agent-y", blocks=[2]))
            assert second.peer_agent == "agent-y"
            (expired,) = b.app.owner.expire(now=math.inf)
            assert expired.token == second.token and b.app.table.get(wb.key).pins == 0
            third = begin_transfer(b.app, announce(b, wb, cap, peer="agent-x", blocks=[1, 2]))
            assert third.grant == first.grant == second.grant

    run(main())


def test_the_capability_binds_request_blocks_and_worker() -> None:
    """BeginTransfer is refused, changing nothing, for another request id,
    a block outside the grant, another worker of the same daemon, a missing
    block list, or an empty capability."""

    async def main() -> None:
        async with cluster() as c:
            _, _, b, wb = await two(c, decode_seed=0)
            other = c.worker("other", seed=5)
            await b.register(other)
            cap = b.grant(wb, "r", {0: [1, 2]})
            bad = [
                announce(b, wb, cap, peer="p", blocks=[1], request_id="r2"),
                announce(b, wb, cap, peer="p", blocks=[1, 3]),
                announce(b, other, cap, peer="p", blocks=[1]),
                announce(b, wb, cap, peer="p", blocks=[]),
                announce(b, wb, "", peer="p", blocks=[1]),
            ]
            for req in bad:
                with pytest.raises(PermissionDenied) as raised:
                    begin_transfer(b.app, req)
                assert raised.value.message == "capability does not allow this transfer"
            assert len(b.app.leases) == 0 and len(b.app.grants) == 1
            begin_transfer(b.app, announce(b, wb, cap, peer="p", blocks=[2, 1]))

    run(main())


def test_replan_keeps_grants_and_reregistration_drops_them() -> None:
    """A re-plan keeps the memory, so a capability granted before still
    allows its pull at the new generation; a re-registration (new memory)
    withdraws every grant of the worker."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c, decode_seed=0)
            before = spec(wa, b, wb, [(0, 1)], request_id="before-replan")
            await b.app.replan("coalesce")
            assert b.app.table.get(wb.key).generation == 2
            statuses = await a.transfer(before)
            assert statuses[-1].state == transfers_pb2.TRANSFER_STATE_DONE
            assert wa.block(0) == wb.block(1)
            stale = spec(wa, b, wb, [(2, 3)], request_id="before-reregister")
            await b.register(wb)
            assert len(b.app.grants) == 0
            with pytest.raises(PermissionDenied):
                await a.transfer(stale)
            assert wa.block(2) != wb.block(3)

    run(main())


def test_a_grant_made_before_a_replan_admits_its_pull_while_the_old_plan_retires() -> None:
    """A re-plan swaps in the new plan, then waits for transfers still reading
    the old one before releasing it: a capability granted before the re-plan
    already allows its pull at the new generation during that wait (its grant
    moved with the swap), as after it."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c, decode_seed=0)
            before = spec(wa, b, wb, [(0, 1)], request_id="before-replan")
            old = b.app.table.get(wb.key)
            old.pin()  # a transfer still reading the old plan: the re-plan waits for it
            replan = asyncio.create_task(b.app.replan("coalesce"))
            while b.app.table.get(wb.key).generation == old.generation:
                await asyncio.sleep(0.01)
            statuses = await a.transfer(before)
            assert statuses[-1].state == transfers_pb2.TRANSFER_STATE_DONE
            assert wa.block(0) == wb.block(1)
            assert not replan.done()  # it was pulled while the old plan still retired
            old.unpin()
            (new,) = await replan
            assert new.generation == old.generation + 1

    run(main())


def test_grants_survive_a_daemon_restart_with_a_state_dir(tmp_path: Path) -> None:
    """With a state dir, a capability minted before the owner crashes still
    admits its pull after the restart: the worker is restored over the same
    memory at a new generation and its grant follows it."""

    async def main() -> None:
        async with cluster() as c:
            a = await c.node("a")
            wa = c.worker("decode")
            await a.register(wa)
            state: Any = str(tmp_path / "state")
            b = await c.node("b", state_dir=state)
            wb = c.worker("prefill", seed=4)
            await b.register(wb)
            cap = b.grant(wb, "req-1", {0: [1]})
            # A crash: the old daemon stops serving without closing (a
            # graceful stop deregisters its workers); a new one starts over
            # the same state dir and takes its address.
            b2 = await c.node("b", instance="b2", state_dir=state)
            record = b2.app.table.find(wb.key)
            assert record is not None and record.generation == 2
            assert len(b2.app.grants) == 1
            statuses = await a.transfer(spec(wa, b2, wb, [(0, 1)], capability=cap))
            assert statuses[-1].state == transfers_pb2.TRANSFER_STATE_DONE
            assert wa.block(0) == wb.block(1)

    run(main())
