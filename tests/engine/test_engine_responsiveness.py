"""A daemon that slow peers and hostile requests cannot stall or grow:
handshakes single-flight per target with a bounded number in flight, caches
untouched by rejected requests and bounded in size, and the registration
caps (``TransferEngine`` and ``Registrar`` over the fake NIXL)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from harness import BLOCKS, SIZE, Node, cluster, run, run_spec, spec, two

from kvmap.core.errors import InvalidArgument, ResourceExhausted, Unavailable
from kvmap.core.retry import RetryPolicy
from kvmap.core.transfer_plan import MAX_GROUPS_PER_TRANSFER
from kvmap.daemon.engine import prepared, transfers
from kvmap.v1 import transfers_pb2

pytestmark = pytest.mark.timeout(60)

DONE = transfers_pb2.TRANSFER_STATE_DONE
HANDSHAKING = transfers_pb2.TRANSFER_STATE_HANDSHAKING


async def drain(it: AsyncIterator[transfers_pb2.TransferStatus]) -> list[int]:
    return [s.state async for s in it]


def pull_to(a: Node, s: transfers_pb2.TransferSpec, target: str) -> asyncio.Task[list[int]]:
    """A pull of ``s`` sent to ``target`` instead (a silent peer), running."""
    s.remote_target = target
    s.timeout_ms = 60_000  # hangs on the handshake, not on its own deadline
    return asyncio.get_running_loop().create_task(drain(run_spec(a.app, s, write=False)))


async def cancel(tasks: list[asyncio.Task[list[int]]]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def test_a_silent_peer_delays_only_the_pulls_to_it() -> None:
    """While 8 pulls hang on 4 silent targets (2 each, one handshake per target), a warm pull to a
    healthy peer and a cold one to another healthy peer both complete with the right bytes; the
    hanging pulls are still waiting, and cancelling them frees their handshake slots. (Pins: no
    lock is held across a remote handshake, and cached lookups wait on nothing.)"""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c)
            cn = await c.node("c")
            wc = c.worker("prefill-c", seed=9)
            await cn.register(wc)
            await a.transfer(spec(wa, b, wb, [(0, 0)], request_id="warm"))
            silent = [f"silent-{i}:1" for i in range(4)]
            for target in silent:
                a.peers.hold(target)
            hanging = [
                pull_to(a, spec(wa, b, wb, [(1, 1)], request_id=f"h{i}"), silent[i % 4])
                for i in range(8)
            ]
            await a.peers.until_asked(1 + len(silent))
            warm = await asyncio.wait_for(
                a.transfer(spec(wa, b, wb, [(2, 4)], request_id="w2")), 10
            )
            cold = await asyncio.wait_for(
                a.transfer(spec(wa, cn, wc, [(3, 6)], request_id="c1")), 10
            )
            assert [s.state for s in warm] == [DONE]
            assert [s.state for s in cold] == [HANDSHAKING, DONE]
            assert (wa.block(2), wa.block(3)) == (wb.block(4), wc.block(6))
            assert not any(t.done() for t in hanging)
            assert sorted(a.peers.handshakes[1:5]) == silent  # one per silent target
            assert a.app.engine.cache_sizes()["handshakes_in_flight"] == len(silent)
            await cancel(hanging)
            assert a.app.engine.cache_sizes()["handshakes_in_flight"] == 0
            assert a.app.table.get(wa.key).pins == 0

    run(main())


def test_concurrent_pulls_to_one_target_share_one_handshake() -> None:
    """Five pulls started together towards a peer whose handshake is held all wait on one
    handshake; released, each completes (each reports the handshake it shared) with its own
    blocks, and the peer was asked once."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c)
            release = a.peers.hold(b.target)
            pulls = [
                asyncio.create_task(a.transfer(spec(wa, b, wb, [(i, 7 - i)], request_id=f"r{i}")))
                for i in range(5)
            ]
            await a.peers.until_asked(1)
            release.set()
            results = await asyncio.wait_for(asyncio.gather(*pulls), 10)
            assert [[s.state for s in r] for r in results] == [[HANDSHAKING, DONE]] * 5
            assert a.peers.handshakes == [b.target]
            assert [wa.block(i) for i in range(5)] == [wb.block(7 - i) for i in range(5)]

    run(main())


def test_a_failed_handshake_is_shared_but_not_kept() -> None:
    """Two pulls sharing a handshake with a target where nothing listens both fail UNAVAILABLE
    from one handshake (the puller's backoff leaves no time for a retry); once a daemon listens
    there, the next pull handshakes again and works."""
    no_time_to_retry = transfers.Pacing(policy=RetryPolicy(initial_s=3600.0, max_s=3600.0))

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c, pacing=no_time_to_retry)
            release = a.peers.hold("late:1")
            failing = [
                pull_to(a, spec(wa, b, wb, [(i, i)], request_id=f"f{i}"), "late:1")
                for i in range(2)
            ]
            await a.peers.until_asked(1)
            release.set()
            outcomes = await asyncio.gather(*failing, return_exceptions=True)
            assert all(isinstance(o, Unavailable) for o in outcomes), outcomes
            late = await c.node("late")
            wl = c.worker("prefill", seed=11)
            await late.register(wl)
            await a.transfer(spec(wa, late, wl, [(4, 2)], request_id="again"))
            assert wa.block(4) == wl.block(2)
            assert a.peers.handshakes == ["late:1", "late:1"]

    run(main())


def test_handshakes_in_flight_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a limit of 3, three silent targets hold every slot: a fourth target is refused
    RESOURCE_EXHAUSTED naming the limit, another pull to a silent target in flight joins it, a
    cached peer is still served, and once the hanging pulls give up a new target is admitted."""
    monkeypatch.setattr(transfers, "MAX_HANDSHAKES_IN_FLIGHT", 3)

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c)
            await a.transfer(spec(wa, b, wb, [(0, 0)], request_id="warm"))
            for i in range(5):
                a.peers.hold(f"silent-{i}:1")
            hanging = [
                pull_to(a, spec(wa, b, wb, [(1, 1)], request_id=f"h{i}"), f"silent-{i}:1")
                for i in range(3)
            ]
            await a.peers.until_asked(4)
            hanging.append(pull_to(a, spec(wa, b, wb, [(1, 1)], request_id="join"), "silent-0:1"))
            refused_spec = spec(wa, b, wb, [(1, 1)], request_id="over2")
            refused_spec.remote_target = "silent-3:1"
            with pytest.raises(ResourceExhausted) as refused:
                await drain(run_spec(a.app, refused_spec, write=False))
            assert str(refused.value) == (
                "3 handshakes with remote daemons in flight (the limit); retry later"
            )
            await a.transfer(spec(wa, b, wb, [(2, 2)], request_id="cached"))
            assert not any(t.done() for t in hanging)
            await cancel(hanging)
            late = pull_to(a, spec(wa, b, wb, [(1, 1)], request_id="after"), "silent-4:1")
            await a.peers.until_asked(5)
            assert a.peers.handshakes[-1] == "silent-4:1"
            await cancel([late])

    run(main())


def test_rejected_requests_leave_the_caches_as_they_were() -> None:
    """After a warm pull, requests refused for their size (too many groups) or against the region
    maps (a block out of range, with new layer selections) are INVALID_ARGUMENT and leave every
    cache and the agent's prepared lists exactly as they were."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c)
            await a.transfer(spec(wa, b, wb, [(0, 0)], request_id="warm"))
            engine = a.app.engine
            before, lists = engine.cache_sizes(), len(a.agent.live_dlists)

            wide = spec(wa, b, wb, [(1, 1)], request_id="wide")
            for _ in range(MAX_GROUPS_PER_TRANSFER):
                wide.groups.add(transfer_group=0, local_block_ids=[1], remote_block_ids=[1])
            out_of_range = spec(wa, b, wb, [(BLOCKS, 1)], request_id="far", layers=("layer.1",))
            many = spec(wa, b, wb, [(1, 1)], request_id="many")
            for layer in range(200):  # 200 selections, each out of range
                many.groups.add(
                    transfer_group=0,
                    local_block_ids=[BLOCKS],
                    remote_block_ids=[1],
                    layer_names=[f"layer.{layer % 2}"],
                )
            for bad in (wide, out_of_range, many):
                with pytest.raises(InvalidArgument):
                    await drain(run_spec(a.app, bad, write=False))
                assert engine.cache_sizes() == before, bad.request_id
                assert len(a.agent.live_dlists) == lists, bad.request_id

    run(main())


def test_prepared_lists_are_an_lru_of_the_stated_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """With room for 2 prepared entries, pulls with 3 layer selections keep 2 entries (and 2
    list pairs in the agent beside the worker's own list); the evicted one is prepared again."""
    monkeypatch.setattr(prepared, "MAX_PREPARED", 2)

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c)
            for i, layers in enumerate([(), ("layer.0",), ("layer.1",), ()]):
                await a.transfer(spec(wa, b, wb, [(i, i)], request_id=f"l{i}", layers=layers))
                assert a.app.engine.cache_sizes()["prepared"] == min(i + 1, 2)
                assert len(a.agent.live_dlists) == 1 + 2 * min(i + 1, 2)
            assert [wa.block(i) for i in (0, 3)] == [wb.block(i) for i in (0, 3)]

    run(main())


def test_registration_caps_refuse_before_mapping_anything() -> None:
    """With max_workers 1, a second worker is RESOURCE_EXHAUSTED naming the cap, while the first
    may register again; with max_registered_bytes one worker's size less one, no worker fits. A
    refused registration maps and registers nothing."""

    async def main() -> None:
        async with cluster() as c:
            one = await c.node("one", max_workers=1)
            first, second = c.worker("first"), c.worker("second")
            await one.register(first)
            regs = len(one.agent.registrations)
            with pytest.raises(ResourceExhausted) as refused:
                await one.register(second)
            assert str(refused.value) == (
                "max_workers (1) would be exceeded: 1 workers are registered"
            )
            assert len(one.agent.registrations) == regs
            assert one.app.adapters.shm.live_mappings() == 1
            await one.register(first)  # registering again replaces itself
            assert len(one.app.table) == 1

            small = await c.node("small", max_registered_bytes=SIZE - 1)
            with pytest.raises(ResourceExhausted) as refused:
                await small.register(c.worker("big"))
            assert str(refused.value) == (
                f"max_registered_bytes ({SIZE - 1}) would be exceeded: "
                f"0 bytes are registered and this worker asks for {SIZE}"
            )
            assert not small.agent.registrations
            assert small.app.adapters.shm.live_mappings() == 0

    run(main())
