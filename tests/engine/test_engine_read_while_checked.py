"""``check_before_read = false``: a pull reads while the owner checks its
BeginTransfer, the caller hears DONE only once the owner agreed, and a
refused, failed or late pull leaves no handle, pin or lease behind. A push,
and a daemon with the default ``check_before_read``, wait for the owner
first."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from harness import cluster, run, run_spec, spec, two

from kvmap.core.errors import DeadlineExceeded, PermissionDenied
from kvmap.v1 import transfers_pb2

pytestmark = pytest.mark.timeout(60)

DONE = transfers_pb2.TRANSFER_STATE_DONE


async def until(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    """Wait until ``condition()`` holds (polled), failing after ``seconds``."""
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, "condition never held"
        await asyncio.sleep(0.01)


async def collected(reports: object) -> list[transfers_pb2.TransferStatus]:
    return [s async for s in reports]  # type: ignore[attr-defined]


def test_a_pull_reads_while_the_owner_checks_and_is_done_only_once_it_agrees() -> None:
    """With the owner's answer held, the pull's bytes land in the decode
    worker (the read did not wait for it) but the caller hears nothing past
    the handshake; once the owner agrees, the pull is DONE with one lease
    begun and ended by its notification."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c, check_before_read=False)
            answer = a.peers.hold_begins(b.target)
            pull = asyncio.ensure_future(collected(run_spec(a.app, spec(wa, b, wb, [(0, 5)]))))
            await until(lambda: wa.block(0) == wb.block(5))
            await asyncio.sleep(0.1)
            assert not pull.done() and a.peers.begins_asked == 1 and len(b.app.leases) == 0
            answer.set()
            statuses = await asyncio.wait_for(pull, 10.0)
            assert statuses[-1].state == DONE and statuses[-1].stats.bytes > 0
            await until(lambda: not a.app.engine.busy and len(b.app.leases) == 0)
            assert b.app.counters.served_done == 1 and a.peers.ended == []

    run(main())


def test_by_default_nothing_moves_until_the_owner_agrees() -> None:
    """``check_before_read`` (the default): while the owner's answer is held
    nothing is posted and the decode worker's block keeps its bytes; once
    the owner agrees the pull moves them and is DONE."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c, check_before_read=True)
            before = wa.block(0)
            answer = a.peers.hold_begins(b.target)
            pull = asyncio.ensure_future(collected(run_spec(a.app, spec(wa, b, wb, [(0, 5)]))))
            await until(lambda: a.peers.begins_asked == 1)
            await asyncio.sleep(0.2)
            assert wa.block(0) == before and c.network.posts == 0 and not pull.done()
            answer.set()
            statuses = await asyncio.wait_for(pull, 10.0)
            assert statuses[-1].state == DONE and wa.block(0) == wb.block(5)

    run(main())


def test_a_push_never_writes_the_owner_before_it_agrees() -> None:
    """A push writes the owner's memory, so it waits for the owner's answer
    even with ``check_before_read`` off: nothing is posted while it is held."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c, check_before_read=False)
            before = wb.block(2)
            answer = a.peers.hold_begins(b.target)
            push = asyncio.ensure_future(
                collected(run_spec(a.app, spec(wa, b, wb, [(1, 2)], write=True), write=True))
            )
            await until(lambda: a.peers.begins_asked == 1)
            await asyncio.sleep(0.2)
            assert wb.block(2) == before and c.network.posts == 0 and not push.done()
            answer.set()
            statuses = await asyncio.wait_for(push, 10.0)
            assert statuses[-1].state == DONE and wb.block(2) == wa.block(1)

    run(main())


def test_a_pull_refused_after_its_read_fails_and_leaves_nothing_behind() -> None:
    """A capability for another block: the read lands before the owner's
    answer, the owner refuses it, and the pull fails PERMISSION_DENIED
    (never DONE) with its handles released, its worker unpinned and no
    lease at the owner."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c, check_before_read=False)
            other = b.grant(wb, "req-1", {0: [6]})
            answer = a.peers.hold_begins(b.target)
            statuses: list[transfers_pb2.TransferStatus] = []

            async def pull() -> None:
                async for s in run_spec(a.app, spec(wa, b, wb, [(0, 5)], capability=other)):
                    statuses.append(s)

            task = asyncio.ensure_future(pull())
            await until(lambda: wa.block(0) == wb.block(5))
            answer.set()
            with pytest.raises(PermissionDenied):
                await asyncio.wait_for(task, 10.0)
            assert all(s.state != DONE for s in statuses)
            assert a.agent.in_flight == () and a.app.table.get(wa.key).pins == 0
            assert not a.app.engine.busy and len(b.app.leases) == 0 and a.peers.tokens == []

    run(main())


def test_a_refused_pull_does_not_wait_for_a_read_still_in_flight() -> None:
    """NIXL keeps the read in flight and the owner refuses: the pull fails
    with the owner's status at once (the read is given up and its handle
    released), not at its deadline."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c, check_before_read=False)
            other = b.grant(wb, "req-1", {0: [6]})
            c.network.hold()
            request = spec(wa, b, wb, [(0, 5)], capability=other)
            request.timeout_ms = 30_000
            started = time.monotonic()
            with pytest.raises(PermissionDenied):
                await collected(run_spec(a.app, request))
            assert time.monotonic() - started < 10.0
            assert c.network.posts == 1 and a.agent.in_flight == ()
            assert a.app.table.get(wa.key).pins == 0 and not a.app.engine.busy
            c.network.release_held()

    run(main())


def test_a_deadline_while_the_owner_checks_fails_the_pull_and_releases_its_read() -> None:
    """The owner never answers: the pull ends DEADLINE_EXCEEDED, its read
    (done or not) released and its worker unpinned."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c, check_before_read=False)
            a.peers.hold_begins(b.target)
            request = spec(wa, b, wb, [(0, 5)])
            request.timeout_ms = 300
            with pytest.raises(DeadlineExceeded, match="waiting for the owner's BeginTransfer"):
                await collected(run_spec(a.app, request))
            assert c.network.posts == 1 and a.agent.in_flight == ()
            assert a.app.table.get(wa.key).pins == 0 and not a.app.engine.busy

    run(main())


def test_a_deadline_inside_the_post_still_releases_what_the_post_made() -> None:
    """The pull's deadline passes while the NIXL thread is still inside its
    post (held there 0.6 s): the pull ends DEADLINE_EXCEEDED once the post
    returns, with the handle the post made released and its worker
    unpinned. The handle used to be dropped unreleased."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c, check_before_read=False)
            gate = threading.Event()
            agent = a.agent
            for name in ("post_descs", "post_prepped"):
                post = getattr(agent, name)

                def slow(*args: object, _post: Callable[..., object] = post, **kw: object) -> Any:
                    gate.wait(10.0)  # on a's NIXL thread
                    return _post(*args, **kw)

                setattr(agent, name, slow)
            c.network.hold()
            request = spec(wa, b, wb, [(0, 5)])
            request.timeout_ms = 300
            asyncio.get_running_loop().call_later(0.6, gate.set)
            with pytest.raises(DeadlineExceeded):
                await collected(run_spec(a.app, request))
            assert gate.is_set() and c.network.posts == 1
            assert agent.in_flight == () and a.app.table.get(wa.key).pins == 0
            c.network.release_held()

    run(main())


@pytest.mark.parametrize(
    ("held", "where"),
    [
        ("handshake", "waiting for the owner's handshake"),
        ("answer", "waiting for the owner's BeginTransfer answer"),
        (
            "nixl",
            r"waiting for NIXL to complete it \(READ of 1 descriptors posted 0\.\ds ago, "
            r"PROC after [1-9]\d* polls, still watched; "
            r"the progress pump's last pass 0\.\ds ago\)",
        ),
    ],
)
def test_a_pull_that_runs_out_of_time_says_where_it_waited(held: str, where: str) -> None:
    """In the default order, a pull whose handshake, owner's answer or NIXL
    transfer never comes ends DEADLINE_EXCEEDED naming that step, so a log
    line or a failed load says where the time went; a transfer NIXL never
    completed also says what the progress pump knew of it (polled and still
    in progress, or never polled)."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c, check_before_read=True)
            if held == "handshake":
                a.peers.hold(b.target)
            elif held == "answer":
                a.peers.hold_begins(b.target)
            else:
                c.network.hold()
            request = spec(wa, b, wb, [(0, 5)])
            request.timeout_ms = 300
            with pytest.raises(DeadlineExceeded, match=rf"no completion in 0\.3s, {where}$"):
                await collected(run_spec(a.app, request))
            c.network.release_held()

    run(main())
