"""Pull and push between two daemons in this process (``TransferEngine``
over the fake NIXL): the bytes that move, the handshake and list caches, the
stale-generation retry, and what a failed transfer leaves behind."""

from __future__ import annotations

import asyncio
import threading

import pytest
from harness import (
    BLOCKS,
    ROW,
    VirtualClock,
    Worker,
    cluster,
    next_event,
    run,
    run_spec,
    spec,
    two,
)

from kvmap.core.errors import DeadlineExceeded, NotFound, StaleGeneration, Unavailable
from kvmap.v1 import registry_pb2, transfers_pb2

pytestmark = pytest.mark.timeout(60)

DONE = transfers_pb2.TRANSFER_STATE_DONE
HANDSHAKING = transfers_pb2.TRANSFER_STATE_HANDSHAKING


def test_a_deadline_past_the_lease_field_still_pulls() -> None:
    """A caller's deadline of 2^32-1 ms (the largest the wire carries) pulls
    as any other: the owner's lease field is clamped, not overflowed (which
    answered INTERNAL before)."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c)
            request = spec(wa, b, wb, [(0, 5)])
            request.timeout_ms = 2**32 - 1
            statuses = await a.transfer(request)
            assert statuses[-1].state == DONE
            assert wa.block(0) == wb.block(5)

    run(main())


def test_the_owner_is_given_the_whole_transfer_time_to_answer() -> None:
    """A pull's announcement to the owner is bounded by the pull's own
    timeout (here 45 s, past the daemon's 3 s connect timeout), so an owner
    slow to answer under load does not fail a pull whose deadline has time
    left."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c)
            request = spec(wa, b, wb, [(0, 5)])
            request.timeout_ms = 45_000
            statuses = await a.transfer(request)
            assert statuses[-1].state == DONE
            assert a.peers.call_timeouts == [45.0]

    run(main())


def test_a_deadline_passing_while_a_report_is_sent_ends_the_pull_with_deadline_exceeded() -> None:
    """The pull's deadline passes while its caller still holds the first
    report (a servicer writing it to a slow client): the caller is not
    cancelled, and the pull then ends DEADLINE_EXCEEDED, its answer. A
    timeout that cancelled the caller's task instead cancelled the RPC's
    handler, and the client heard nothing until its own deadline."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c)
            request = spec(wa, b, wb, [(0, 5)])
            request.timeout_ms = 50
            reports = run_spec(a.app, request)
            first = await anext(reports)
            assert first.state == HANDSHAKING
            await asyncio.sleep(0.2)  # sending the report took past the deadline
            with pytest.raises(DeadlineExceeded, match=r"no completion in 0\.05s"):
                await anext(reports)

    run(main())


def test_pull_copies_exactly_the_requested_blocks() -> None:
    """A pull of blocks 5, 1, 6 into 0, 2, 3 copies those rows (both the
    coalesced run and the single block) and leaves every other block of both
    workers as it was; the owner's worker hears PULLED_FROM with the request id."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c)
            before_a = [wa.block(i) for i in range(BLOCKS)]
            before_b = [wb.block(i) for i in range(BLOCKS)]
            events = b.app.table.subscribe(wb.key)
            statuses = await a.transfer(spec(wa, b, wb, [(0, 5), (2, 1), (3, 6)]))
            assert [s.state for s in statuses] == [HANDSHAKING, DONE]
            assert statuses[-1].stats.bytes == 3 * ROW
            expected = list(before_a)
            expected[0], expected[2], expected[3] = before_b[5], before_b[1], before_b[6]
            assert [wa.block(i) for i in range(BLOCKS)] == expected
            assert [wb.block(i) for i in range(BLOCKS)] == before_b
            finished = (await next_event(events)).transfer_finished
            assert finished.request_id == "req-1" and finished.peer_agent == "kvmapd-a"
            assert finished.direction == registry_pb2.TRANSFER_DIRECTION_PULLED_FROM
            assert len(b.app.leases) == 0 and b.app.table.get(wb.key).pins == 0
            assert a.app.table.get(wa.key).pins == 0 and a.app.engine.in_flight == 0

    run(main())


def test_the_caller_hears_done_before_the_owner_is_notified() -> None:
    """A pull's bytes have landed once NIXL reports its transfers done: the
    caller hears DONE then, and releasing the handles and notifying the owner
    follow. With the decode daemon's notification held back, the pull still
    reports DONE with the bytes in place while the owner's lease stays open
    and the local worker stays pinned; a drain waits for the notification;
    once it goes out, the lease ends and the owner's worker hears PULLED_FROM."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c)
            gate = threading.Event()
            send = a.agent.send_notif

            def held(agent: str, msg: bytes) -> None:  # runs on a's NIXL thread
                gate.wait(10.0)
                send(agent, msg)

            a.agent.send_notif = held  # type: ignore[method-assign]
            events = b.app.table.subscribe(wb.key)
            statuses = [s async for s in run_spec(a.app, spec(wa, b, wb, [(0, 5), (3, 1)]))]
            assert statuses[-1].state == DONE
            assert wa.block(0) == wb.block(5) and wa.block(3) == wb.block(1)
            assert len(b.app.leases) == 1 and b.app.counters.served_done == 0
            assert a.app.engine.busy and a.app.engine.in_flight == 0
            assert a.app.table.get(wa.key).pins == 1  # its handles are not released yet
            drained = asyncio.ensure_future(a.app.drain(10.0))
            await asyncio.sleep(0.3)
            assert not drained.done()
            gate.set()
            await asyncio.wait_for(drained, 10.0)
            finished = (await asyncio.wait_for(next_event(events), 10.0)).transfer_finished
            assert finished.request_id == "req-1"
            assert not a.app.engine.busy and a.app.table.get(wa.key).pins == 0
            assert len(b.app.leases) == 0 and b.app.counters.served_done == 1

    run(main())


def test_a_notification_that_fails_after_done_leaves_the_pull_done() -> None:
    """The caller was told DONE before the owner's notification went out: a
    notification NIXL refuses changes nothing the caller heard. The handles
    are released and the local worker unpinned; the owner's lease stays
    until it runs out (it is not ended as a failed transfer)."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c)

            def refused(agent: str, msg: bytes) -> None:
                raise Unavailable("send_notif: NIXL_ERR_REMOTE_DISCONNECT")

            a.agent.send_notif = refused  # type: ignore[method-assign]
            statuses = [s async for s in run_spec(a.app, spec(wa, b, wb, [(1, 2)]))]
            assert statuses[-1].state == DONE and wa.block(1) == wb.block(2)
            await asyncio.wait_for(a.app.drain(10.0), 10.0)
            assert not a.app.engine.busy and a.app.table.get(wa.key).pins == 0
            assert a.agent.in_flight == ()
            assert len(b.app.leases) == 1 and a.peers.ended == []

    run(main())


def test_push_writes_into_the_remote_worker() -> None:
    """A push copies local blocks into the remote worker's memory, nothing
    else, and the owner's worker hears PUSHED_TO."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c)
            before_b = [wb.block(i) for i in range(BLOCKS)]
            events = b.app.table.subscribe(wb.key)
            await a.transfer(spec(wa, b, wb, [(4, 0), (7, 2)], write=True), write=True)
            expected = list(before_b)
            expected[0], expected[2] = wa.block(4), wa.block(7)
            assert [wb.block(i) for i in range(BLOCKS)] == expected
            finished = (await next_event(events)).transfer_finished
            assert finished.direction == registry_pb2.TRANSFER_DIRECTION_PUSHED_TO

    run(main())


def test_layer_selection_moves_only_the_selected_layers() -> None:
    """Naming layer.1 moves that layer's page of each block and not layer.0's."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c)
            old = wa.page(1, 0)
            await a.transfer(spec(wa, b, wb, [(1, 2)], layers=("layer.1",)))
            assert wa.page(1, 1) == wb.page(2, 1) and wa.page(1, 0) == old != wb.page(2, 0)

    run(main())


def test_second_transfer_reuses_the_handshake_and_prepared_lists() -> None:
    """A second pull of the same worker pair does not handshake again and
    prepares no new descriptor lists."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c)
            await a.transfer(spec(wa, b, wb, [(0, 1)]))
            lists = set(a.agent.live_dlists)
            statuses = await a.transfer(spec(wa, b, wb, [(3, 4)], request_id="req-2"))
            assert [s.state for s in statuses] == [DONE] and not statuses[-1].stats.handshaked
            assert set(a.agent.live_dlists) == lists
            assert wa.block(3) == wb.block(4)

    run(main())


def test_stale_remote_generation_is_retried_once_with_a_new_handshake() -> None:
    """After the remote worker re-registers (generation 2, new contents), a
    pull planned with the cached generation 1 is refused by the owner, handshakes
    again and moves the new bytes; lists prepared against generation 1 are freed."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c)
            await a.transfer(spec(wa, b, wb, [(0, 1)]))
            stale_lists = {d for d in a.agent.live_dlists if not d.local}
            wb.fill(9)
            await b.register(wb)
            statuses = await a.transfer(spec(wa, b, wb, [(2, 3)], request_id="req-2"))
            assert [s.state for s in statuses] == [HANDSHAKING, DONE]
            assert statuses[-1].stats.remote_generation == 2
            assert wa.block(2) == wb.block(3)
            assert all(d.released for d in stale_lists)

    run(main())


def test_expected_generation_that_is_not_current_is_stale() -> None:
    """A spec naming a remote generation the owner does not have fails with
    StaleGeneration, moves nothing and unpins the local worker."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c)
            old = wa.block(0)
            with pytest.raises(StaleGeneration):
                await a.transfer(spec(wa, b, wb, [(0, 1)], remote_generation=7))
            assert wa.block(0) == old and a.app.table.get(wa.key).pins == 0
            assert a.agent.network.posts == 0 and len(b.app.leases) == 0

    run(main())


def test_unknown_remote_worker_is_not_found() -> None:
    """Pulling from a worker the remote daemon does not have is NotFound."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, _ = await two(c)
            with pytest.raises(NotFound):
                await a.transfer(spec(wa, b, Worker("nobody"), [(0, 1)]))
            assert a.app.table.get(wa.key).pins == 0

    run(main())


def test_remote_that_died_in_flight_fails_and_ends_the_lease() -> None:
    """A remote daemon whose agent vanishes while the pull is in flight (and
    never comes back) makes it Unavailable once its retries have used the
    deadline; the owner is told of each attempt that it did not complete, and
    nothing stays pinned or posted on the puller."""

    async def main() -> None:
        async with cluster() as c:
            clock = VirtualClock()
            a, wa, b, wb = await two(c, pacing=clock.pacing())
            net = a.agent.network
            net.hold()
            pull = asyncio.create_task(a.transfer(spec(wa, b, wb, [(0, 1)])))
            await asyncio.to_thread(net.posted.wait, 5.0)
            net.kill("kvmapd-b")
            net.release_held()
            with pytest.raises(Unavailable):
                await pull
            assert clock.sleeps, "a remote that disconnects is tried again"
            assert a.peers.ended == a.peers.tokens
            assert len(b.app.leases) == 0 and b.app.table.get(wb.key).pins == 0
            assert a.app.table.get(wa.key).pins == 0 and a.agent.in_flight == ()

    run(main())


def test_transfer_past_its_deadline_is_released() -> None:
    """A transfer NIXL never completes ends at the spec's deadline with
    DeadlineExceeded: the NIXL transfer is released, the owner's lease ended
    and the local worker unpinned."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c)
            a.agent.network.hold()
            with pytest.raises(DeadlineExceeded):
                await a.transfer(spec(wa, b, wb, [(0, 1)], timeout_ms=50))
            assert a.agent.in_flight == () and a.app.table.get(wa.key).pins == 0
            assert a.peers.ended == a.peers.tokens and len(a.peers.ended) == 1
            assert len(b.app.leases) == 0
            assert a.app.counters.failed == 1

    run(main())


def test_restarted_remote_daemon_is_handshaken_again() -> None:
    """When the remote daemon restarts (same address, new agent), the puller's
    cached plan is refused, it drops the old agent and every list prepared
    against it, loads the new agent and pulls the new worker's bytes."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c)
            await a.transfer(spec(wa, b, wb, [(0, 1)]))
            old_lists = {d for d in a.agent.live_dlists if not d.local}
            await c.stop(b)
            b2 = await c.node("b", instance="b2")
            wb.fill(11)
            await b2.register(wb)
            statuses = await a.transfer(spec(wa, b2, wb, [(5, 6)], request_id="req-2"))
            assert statuses[-1].state == DONE and wa.block(5) == wb.block(6)
            assert a.agent.remotes == ("kvmapd-b2",)
            assert all(d.released for d in old_lists)
            assert {d.agent for d in a.agent.live_dlists if not d.local} == {"kvmapd-b2"}

    run(main())
