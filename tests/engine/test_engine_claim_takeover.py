"""A decode daemon restarted by kill -9 while a pull held a grant's claim at
the prefill takes that claim over: its retried pull names its previous agent
(BeginTransferRequest.replaces_agents, kept in its state store), presents the
same capability and lands the bytes. Naming an agent releases only a claim on
the capability presented, only when that agent holds it; nothing else moves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from harness import (
    HARNESS_PEER,
    Cluster,
    Node,
    Worker,
    begin_transfer,
    cluster,
    next_event,
    run,
    spec,
)

from kvmap.core.errors import InvalidArgument, PermissionDenied
from kvmap.core.grants import MAX_AGENT_NAME, MAX_REPLACED_AGENTS, digest
from kvmap.daemon.engine.leases import Lease, notification
from kvmap.v1 import peer_pb2, transfers_pb2, types_pb2

pytestmark = pytest.mark.timeout(60)

DONE = transfers_pb2.TRANSFER_STATE_DONE


def announce(
    b: Node, wb: Worker, capability: str, *, peer: str, replaces: list[str] | None = None
) -> peer_pb2.BeginTransferRequest:
    """A BeginTransfer for block 1 of ``wb`` as agent ``peer`` sends it."""
    return peer_pb2.BeginTransferRequest(
        request_id="req-1",
        worker=wb.id,
        generation=b.app.table.get(wb.key).generation,
        agent_name=b.app.agent_name,
        peer_agent=peer,
        lease_ms=60_000,
        blocks=1,
        capability=capability,
        groups=[types_pb2.BlockGrant(transfer_group=0, block_ids=[1])],
        replaces_agents=replaces or [],
    )


async def held_claim(c: Cluster, state: str, max_uses: int = 0) -> tuple[Any, ...]:
    """Decode ``a`` (state in ``state``) and prefill ``b``; a's agent holds a
    claim on a grant for block 1 (its BeginTransfer, as a pull in flight
    makes it), and then a dies by kill -9: the claim stays at b."""
    a, b = await c.node("a", state_dir=state), await c.node("b")
    wa, wb = c.worker("decode"), c.worker("prefill", seed=3)
    await a.register(wa)
    await b.register(wb)
    cap = b.grant(wb, "req-1", {0: [1]}, max_uses=max_uses)
    old = begin_transfer(b.app, announce(b, wb, cap, peer=a.app.agent_name))
    c.crash(a)
    c.network.kill(a.app.agent_name)
    return a, wa, b, wb, cap, old


def unchanged(b: Node, wb: Worker, cap: str, old: Lease) -> None:
    """The dead agent's claim, lease and pin are as they were."""
    assert len(b.app.leases) == 1 and b.app.table.get(wb.key).pins == 1
    assert b.app.grants.claimed_by(digest(cap)) == old.peer_agent
    assert b.app.leases.held_by(old.peer_agent, digest(cap), HARNESS_PEER) == [old]


def test_a_restarted_decode_takes_its_claim_over_and_pulls(tmp_path: Path) -> None:
    """The restarted decode (same state dir) names its previous agent; the
    retried pull with the same capability lands the right bytes; the old
    lease ended once (no lease or pin left), the one use is spent once, the
    worker hears one transfer_finished, and the dead agent's late EndTransfer
    and notification find nothing."""

    async def main() -> None:
        async with cluster() as c:
            state = str(tmp_path / "a")
            a, wa, b, wb, cap, old = await held_claim(c, state)
            a2 = await c.node("a", instance="a2", state_dir=state)
            await a2.register(wa)
            assert a2.app.previous_agents == (a.app.agent_name,)
            statuses = await a2.transfer(spec(wa, b, wb, [(0, 1)], capability=cap))
            assert statuses[-1].state == DONE and wa.block(0) == wb.block(1)
            assert list(a2.peers.begun[-1].replaces_agents) == [a.app.agent_name]
            assert len(b.app.leases) == 0 and b.app.table.get(wb.key).pins == 0
            assert len(b.app.grants) == 0 and b.app.counters.served_done == 1
            assert b.app.owner.end(old.token, peer=HARNESS_PEER) is None
            b.app.owner.on_notifs({a.app.agent_name: [notification(old.token)]})
            assert b.app.counters.served_done == 1 and b.app.table.get(wb.key).pins == 0

    run(main())


def test_a_taken_over_claim_spends_no_use(tmp_path: Path) -> None:
    """With two uses, the dead agent's transfer counts against none: after
    the take-over one lease pins the worker, the completed pull spends one
    use and one is left for a re-pull."""

    async def main() -> None:
        async with cluster() as c:
            a, _, b, wb, cap, old = await held_claim(c, str(tmp_path / "a"), max_uses=2)
            lease = begin_transfer(
                b.app, announce(b, wb, cap, peer="kvmapd-a2", replaces=[a.app.agent_name])
            )
            assert len(b.app.leases) == 1 and b.app.table.get(wb.key).pins == 1
            assert b.app.grants.claimed_by(digest(cap)) == "kvmapd-a2"
            events = b.app.table.subscribe(wb.key)
            b.app.owner.on_notifs({"kvmapd-a2": [notification(lease.token)]})
            assert (await next_event(events)).transfer_finished.peer_agent == "kvmapd-a2"
            assert b.app.grants.find(cap).uses == 1 and b.app.table.get(wb.key).pins == 0
            assert b.app.owner.end(old.token, peer=HARNESS_PEER) is None
            assert b.app.grants.find(cap).uses == 1

    run(main())


def test_naming_the_agent_without_its_capability_changes_nothing(tmp_path: Path) -> None:
    """A third party that names the dead agent is refused with a wrong
    capability, and with a valid capability of another request it claims
    only that one: the dead agent's claim, lease and pin stay."""

    async def main() -> None:
        async with cluster() as c:
            a, _, b, wb, cap, old = await held_claim(c, str(tmp_path / "a"))
            named = [a.app.agent_name]
            with pytest.raises(PermissionDenied):
                begin_transfer(b.app, announce(b, wb, "forged", peer="mallory", replaces=named))
            unchanged(b, wb, cap, old)
            other = b.grant(wb, "req-2", {0: [1]})
            req = announce(b, wb, other, peer="mallory", replaces=named)
            req.request_id = "req-2"
            begin_transfer(b.app, req)
            assert b.app.grants.claimed_by(digest(other)) == "mallory"
            assert b.app.grants.claimed_by(digest(cap)) == old.peer_agent
            assert b.app.leases.held_by(old.peer_agent, digest(cap), HARNESS_PEER) == [old]

    run(main())


def test_replacing_an_agent_that_holds_no_claim_changes_nothing(tmp_path: Path) -> None:
    """Naming an agent other than the holder is the ordinary refusal: the
    holder's claim, lease and pin stay."""

    async def main() -> None:
        async with cluster() as c:
            _, _, b, wb, cap, old = await held_claim(c, str(tmp_path / "a"))
            with pytest.raises(PermissionDenied):
                begin_transfer(b.app, announce(b, wb, cap, peer="kvmapd-a2", replaces=["kvmapd-z"]))
            unchanged(b, wb, cap, old)

    run(main())


@pytest.mark.parametrize(
    "names",
    [
        ["kvmapd-x"] * (MAX_REPLACED_AGENTS + 1),
        [""],
        ["x" * (MAX_AGENT_NAME + 1)],
        ["kvmapd-a2"],
    ],
    ids=["too-many", "empty", "too-long", "self"],
)
def test_bad_replaces_agents_are_refused_and_change_nothing(
    tmp_path: Path, names: list[str]
) -> None:
    """Too many names, an empty or over-long one, or the caller itself:
    INVALID_ARGUMENT, even with the right capability, and the claim stays."""

    async def main() -> None:
        async with cluster() as c:
            _, _, b, wb, cap, old = await held_claim(c, str(tmp_path / "a"))
            with pytest.raises(InvalidArgument):
                begin_transfer(b.app, announce(b, wb, cap, peer="kvmapd-a2", replaces=names))
            unchanged(b, wb, cap, old)

    run(main())
