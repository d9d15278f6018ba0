"""Open grants in the engine (GrantTransferRequest.open_uses): the first claim
that declares its readers fixes how many uses the grant admits, stored with
the grant so that a restart keeps it; a later claim declaring another count
is refused (FAILED_PRECONDITION) and changes nothing; a reader that needs no
block releases its use (BeginTransferRequest.release), which the owner's
worker hears like a finished pull, with the grant's count."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import (
    Node,
    Worker,
    begin_transfer,
    cluster,
    next_event,
    release_grant,
    run,
    run_spec,
    spec,
    two,
)

from kvmap.core.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from kvmap.core.transfer_requests import Phase
from kvmap.core.transfer_wire import release_from_request, transfer_from_spec
from kvmap.daemon.engine.workers import EventQueue
from kvmap.v1 import peer_pb2, registry_pb2, transfers_pb2

pytestmark = pytest.mark.timeout(60)
DONE = transfers_pb2.TRANSFER_STATE_DONE


def pull(
    wa: Worker, b: Node, wb: Worker, cap: str, readers: int, *, local: int = 0
) -> transfers_pb2.TransferSpec:
    """A pull of prefill block 1 into ``local`` declaring ``readers``."""
    s = spec(wa, b, wb, [(local, 1)], capability=cap)
    s.readers = readers
    return s


def release(b: Node, wa: Worker, wb: Worker, cap: str, readers: int) -> transfers_pb2.TransferSpec:
    return transfers_pb2.TransferSpec(
        request_id="req-1",
        local_worker=wa.id,
        remote_target=b.target,
        remote_worker=wb.id,
        capability=cap,
        readers=readers,
        release=True,
    )


async def finished(events: EventQueue) -> registry_pb2.TransferFinishedEvent:
    while True:
        event = await next_event(events)
        if event.WhichOneof("event") == "transfer_finished":
            return event.transfer_finished


def uses(b: Node) -> list[tuple[int, int]]:
    """(uses, max_uses) of every grant, as the state store keeps them."""
    return [(g.uses, g.max_uses) for g in b.app.store.grants()]


def test_the_first_claim_fixes_an_open_grant_and_another_count_is_refused() -> None:
    """An open grant takes the count the first pull declares (2), stored at once; each
    finished pull tells the worker uses/max_uses, the last one exhausted; a pull declaring
    another count (3) in between is FAILED_PRECONDITION with no lease, pin, use or event."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c, decode_seed=0)
            cap = b.grant(wb, "req-1", {0: [1]}, open_uses=True)
            assert uses(b) == [(0, 0)]
            events = b.app.table.subscribe(wb.key)
            await a.transfer(pull(wa, b, wb, cap, 2))
            first = await finished(events)
            assert (first.uses, first.max_uses, first.exhausted) == (1, 2, False)
            assert uses(b) == [(1, 2)]
            with pytest.raises(FailedPrecondition, match="admits 2 readers; the caller declared 3"):
                await a.transfer(pull(wa, b, wb, cap, 3, local=2))
            assert uses(b) == [(1, 2)] and len(b.app.leases) == 0
            assert b.app.table.get(wb.key).pins == 0 and events.empty()
            await a.transfer(pull(wa, b, wb, cap, 2, local=2))
            last = await finished(events)
            assert (last.uses, last.max_uses, last.exhausted) == (2, 2, True)
            assert uses(b) == [] and wa.block(2) == wb.block(1)

    run(main())


def test_an_open_grant_claimed_without_a_count_admits_one_pull() -> None:
    """A puller that declares nothing (an older decode) fixes an open grant at one use."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c, decode_seed=0)
            cap = b.grant(wb, "req-1", {0: [1]}, open_uses=True)
            events = b.app.table.subscribe(wb.key)
            await a.transfer(pull(wa, b, wb, cap, 0))
            done = await finished(events)
            assert (done.uses, done.max_uses, done.exhausted) == (1, 1, True)
            with pytest.raises(PermissionDenied):
                await a.transfer(pull(wa, b, wb, cap, 0, local=2))

    run(main())


def test_a_fixed_grant_refuses_another_declared_count() -> None:
    """A grant minted with max_uses 2 keeps it: a pull declaring 1 is refused and changes
    nothing; one declaring 2 (or nothing) is admitted."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c, decode_seed=0)
            cap = b.grant(wb, "req-1", {0: [1]}, max_uses=2)
            with pytest.raises(FailedPrecondition, match="admits 2 readers; the caller declared 1"):
                await a.transfer(pull(wa, b, wb, cap, 1))
            assert uses(b) == [(0, 2)] and b.app.table.get(wb.key).pins == 0
            await a.transfer(pull(wa, b, wb, cap, 2))
            await a.transfer(pull(wa, b, wb, cap, 0, local=2))
            assert uses(b) == []

    run(main())


def test_open_uses_and_readers_are_bounded() -> None:
    """An open grant with a max_uses of its own, and a declared count past 64 (at the puller
    and at the owner), are INVALID_ARGUMENT and change nothing."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c, decode_seed=0)
            with pytest.raises(InvalidArgument, match="must be 0 for an open grant"):
                b.grant(wb, "req-1", {0: [1]}, max_uses=2, open_uses=True)
            cap = b.grant(wb, "req-1", {0: [1]}, open_uses=True)
            with pytest.raises(InvalidArgument, match=r"spec.readers: 65; must be in \[0, 64\]"):
                await a.transfer(pull(wa, b, wb, cap, 65))
            announce = peer_pb2.BeginTransferRequest(
                request_id="req-1", worker=wb.id, peer_agent="p", capability=cap, readers=65
            )
            with pytest.raises(InvalidArgument, match="readers: 65"):
                begin_transfer(b.app, announce)
            announce.release = True
            with pytest.raises(InvalidArgument, match="readers: 65"):
                release_grant(b.app, announce)
            assert uses(b) == [(0, 0)] and a.peers.begun == []

    run(main())


def test_a_fixed_count_survives_an_owner_restart(tmp_path: Path) -> None:
    """The count the first claim fixed is in the state store: after a crash the restarted
    owner still refuses another count and admits the one last pull."""

    async def main() -> None:
        async with cluster() as c:
            state = str(tmp_path / "b")
            a, wa, b, wb = await two(c, decode_seed=0, owner={"state_dir": state})
            cap = b.grant(wb, "req-1", {0: [1]}, open_uses=True)
            await a.transfer(pull(wa, b, wb, cap, 2))
            c.crash(b)
            b2 = await c.node("b", instance="b2", state_dir=state)  # type: ignore[arg-type]
            assert uses(b2) == [(1, 2)]
            with pytest.raises(FailedPrecondition, match="admits 2 readers"):
                await a.transfer(pull(wa, b2, wb, cap, 4, local=2))
            statuses = await a.transfer(pull(wa, b2, wb, cap, 2, local=2))
            assert statuses[-1].state == DONE and uses(b2) == []

    run(main())


def test_a_release_spends_one_use_and_a_replay_is_refused() -> None:
    """Two readers declared: one pulls, the other releases (no block moved, no lease): the
    worker hears a released, exhausted use; the same release again is PERMISSION_DENIED and
    tells the worker nothing."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c, decode_seed=0)
            cap = b.grant(wb, "req-1", {0: [1]}, open_uses=True)
            events = b.app.table.subscribe(wb.key)
            before = wa.block(0)
            (status,) = [s async for s in run_spec(a.app, release(b, wa, wb, cap, 2), False)]
            assert status.state == DONE and status.message == "released"
            done = await finished(events)
            assert (done.released, done.uses, done.max_uses, done.exhausted) == (True, 1, 2, False)
            assert wa.block(0) == before and len(b.app.leases) == 0
            await a.transfer(pull(wa, b, wb, cap, 2))
            assert (await finished(events)).exhausted
            with pytest.raises(PermissionDenied):
                [s async for s in run_spec(a.app, release(b, wa, wb, cap, 2), False)]
            assert events.empty() and uses(b) == []

    run(main())


def test_a_release_request_spends_a_use_as_the_old_flag_does() -> None:
    """Transfers.Release's request (checked by ``release_from_request``) runs as the release
    of a use: one DONE "released" report, no block moved, no lease; the owner hears it over
    the peer wire's release, and the worker hears a released use. The second reader's
    release through the deprecated spec flag spends the last use."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c, decode_seed=0)
            cap = b.grant(wb, "req-1", {0: [1]}, open_uses=True)
            events = b.app.table.subscribe(wb.key)
            before = wa.block(0)
            flagged = release(b, wa, wb, cap, 2)
            req = transfers_pb2.ReleaseRequest(
                request_id="req-1",
                local_worker=wa.id,
                remote_target=b.target,
                remote_worker=wb.id,
                capability=cap,
                readers=2,
            )
            use = release_from_request(req, 1.0)
            assert use == transfer_from_spec(flagged, 1.0)
            (report,) = [r async for r in a.app.engine.run(use, write=False)]
            assert (report.phase, report.message) == (Phase.DONE, "released")
            assert a.peers.begun[-1].release and not a.peers.begun[-1].groups
            done = await finished(events)
            assert (done.released, done.uses, done.max_uses) == (True, 1, 2)
            assert wa.block(0) == before and len(b.app.leases) == 0
            [s async for s in run_spec(a.app, flagged, False)]
            assert (await finished(events)).exhausted and uses(b) == []

    run(main())


def test_a_release_declaring_no_reader_uses_up_an_open_grant_only() -> None:
    """readers 0 in a release: no one reads the grant; an open one of a rank its layout lets
    go unread (replicated, rank 1 of 2) is used up at once (the worker frees its blocks), a
    fixed one refuses it (FAILED_PRECONDITION, nothing spent)."""

    async def main() -> None:
        async with cluster() as c:
            a, b = await c.node("a"), await c.node("b")
            wa, wb = c.worker("decode"), c.worker("prefill", seed=3, tp=(1, 2))
            await a.register(wa)
            await b.register(wb)
            cap = b.grant(wb, "req-1", {0: [1]}, open_uses=True)
            events = b.app.table.subscribe(wb.key)
            [s async for s in run_spec(a.app, release(b, wa, wb, cap, 0), False)]
            done = await finished(events)
            assert done.released and done.exhausted and uses(b) == []
            fixed = b.grant(wb, "req-1", {0: [1]}, max_uses=2)
            with pytest.raises(FailedPrecondition, match="the caller declared none"):
                [s async for s in run_spec(a.app, release(b, wa, wb, fixed, 0), False)]
            assert uses(b) == [(0, 2)]

    run(main())


@pytest.mark.parametrize("case", ["no-capability", "forged", "other-request", "blocks"])
def test_a_release_without_the_capability_changes_nothing(case: str) -> None:
    """A release with no capability, a forged one, one for another request, or one naming
    blocks is refused (PERMISSION_DENIED / INVALID_ARGUMENT): the grant keeps its uses and
    the worker hears nothing."""

    async def main() -> None:
        async with cluster() as c:
            _, _, b, wb = await two(c, decode_seed=0)
            cap = b.grant(wb, "req-1", {0: [1]}, open_uses=True)
            events = b.app.table.subscribe(wb.key)
            req = peer_pb2.BeginTransferRequest(
                request_id="req-1", worker=wb.id, peer_agent="x", capability=cap, release=True
            )
            error: type[Exception] = PermissionDenied
            if case == "no-capability":
                req.capability = ""
            elif case == "forged":
                req.capability = cap[:-2] + ("AA" if not cap.endswith("AA") else "BB")
            elif case == "other-request":
                req.request_id = "req-2"
            else:
                req.groups.add(transfer_group=0, block_ids=[1])
                error = InvalidArgument
            with pytest.raises(error):
                release_grant(b.app, req)
            assert events.empty() and uses(b) == [(0, 0)]

    run(main())


def test_an_expired_grant_refuses_a_release() -> None:
    """A release of an expired grant is FAILED_PRECONDITION ("expired"), nothing spent."""

    async def main() -> None:
        async with cluster() as c:
            _, _, b, wb = await two(c, decode_seed=0)
            cap = b.grant(wb, "req-1", {0: [1]}, open_uses=True)
            grant = b.app.grants.find(cap)
            b.app.grants._clock = lambda: grant.expires_unix_ms  # its last moment passed
            req = peer_pb2.BeginTransferRequest(
                request_id="req-1", worker=wb.id, peer_agent="x", capability=cap, release=True
            )
            with pytest.raises(FailedPrecondition, match="expired"):
                release_grant(b.app, req)
            assert uses(b) == [(0, 0)]

    run(main())


@pytest.mark.parametrize("tp", [(0, 2), (0, 1)])
def test_a_release_declaring_no_reader_needs_a_rank_its_layout_lets_go_unread(
    tp: tuple[int, int],
) -> None:
    """A decode's readers-0 release of an open grant of a rank every decode engine reads
    (rank 0: decode rank d reads prefill rank d % tp_size) is refused with
    FAILED_PRECONDITION: the grant keeps its uses, the worker hears nothing, and a real
    reader still pulls."""

    async def main() -> None:
        async with cluster() as c:
            a, b = await c.node("a"), await c.node("b")
            wa, wb = c.worker("decode"), c.worker("prefill", seed=3, tp=tp)
            await a.register(wa)
            await b.register(wb)
            cap = b.grant(wb, "req-1", {0: [1]}, open_uses=True)
            events = b.app.table.subscribe(wb.key)
            with pytest.raises(FailedPrecondition, match="read by every decode engine"):
                [s async for s in run_spec(a.app, release(b, wa, wb, cap, 0), False)]
            assert events.empty() and uses(b) == [(0, 0)]
            await a.transfer(pull(wa, b, wb, cap, 1))
            assert (await finished(events)).exhausted and wa.block(0) == wb.block(1)

    run(main())
