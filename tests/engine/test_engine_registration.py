"""Registering, re-planning and releasing workers (``Registrar`` in a
``DaemonApp``) over the fake NIXL, with the worker's memory in a real memfd
handed over the real fd hand-off socket."""

from __future__ import annotations

import ctypes
import os

import pytest
from harness import BLOCKS, SIZE, Node, cluster, run, spec

from kvmap.core.errors import (
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from kvmap.daemon.adapters.nixl_port import DlistHandle
from kvmap.daemon.api import wire_in
from kvmap.v1 import types_pb2

pytestmark = pytest.mark.timeout(60)


def _mapped(node: Node) -> int:
    return node.app.adapters.shm.live_mappings()


def test_registration_maps_the_memfd_and_registers_it_once() -> None:
    """The worker's memfd is mapped shared (the daemon sees the worker's
    bytes at the published base address), registered with NIXL as one range,
    and one local list of one descriptor per region and block is prepared."""

    async def main() -> None:
        async with cluster() as c:
            a = await c.node("a")
            w = c.worker("w", seed=4)
            record = await a.register(w)
            base = record.model.allocation("kv").base_address
            assert ctypes.string_at(base, SIZE) == os.pread(w.fd, SIZE, 0)
            (reg,) = a.agent.registrations
            assert (reg.address, reg.size) == (base, SIZE)
            (dlist,) = a.agent.live_dlists
            assert dlist is record.local_dlist
            assert dlist.num_descs == len(record.model.regions) * BLOCKS
            assert record.generation == 1 and _mapped(a) == 1
            assert [s.worker for s in a.app.store.workers()] == [w.key]

    run(main())


def test_failed_registration_leaves_nothing_behind() -> None:
    """A request whose second allocation names an unknown fd token fails
    with NotFound after the first was mapped: nothing stays mapped,
    registered, prepared, stored or in the table."""

    async def main() -> None:
        async with cluster() as c:
            a = await c.node("a")
            w = c.worker("w")
            req = w.request(await a.hand_over(w))
            req.allocations.add(
                id="kv2",
                size_bytes=SIZE,
                device=types_pb2.Device(type=types_pb2.DEVICE_TYPE_CPU),
                shm_fd=types_pb2.ShmFdHandle(token="no-such-token", index=0),
            )
            with pytest.raises(NotFound, match=r"allocations\[1\]\.shm_fd"):
                await a.app.registrar.register(wire_in.registration(req), a.app.planner)
            assert _mapped(a) == 0 and a.agent.registrations == ()
            assert a.agent.live_dlists == () and len(a.app.table) == 0
            assert a.app.store.workers() == []

    run(main())


def test_nixl_failure_after_mapping_unmaps(monkeypatch: pytest.MonkeyPatch) -> None:
    """When NIXL refuses to prepare the local list, the registration it
    made is undone and the memory unmapped."""

    async def main() -> None:
        async with cluster() as c:
            a = await c.node("a")

            def refuse(*_: object) -> DlistHandle:
                raise ResourceExhausted("NIXL is out of descriptors")

            monkeypatch.setattr(a.agent, "prep_local", refuse)
            with pytest.raises(ResourceExhausted):
                await a.register(c.worker("w"))
            assert _mapped(a) == 0 and a.agent.registrations == ()
            assert len(a.app.table) == 0

    run(main())


def test_cuda_allocation_without_a_handle_is_refused() -> None:
    """A CUDA allocation sent without a cuda_ipc handle is InvalidArgument
    naming its handle field, and nothing is mapped."""

    async def main() -> None:
        async with cluster() as c:
            a = await c.node("a")
            w = c.worker("w")
            req = w.request("unused")
            req.allocations[0].device.type = types_pb2.DEVICE_TYPE_CUDA
            req.allocations[0].ClearField("shm_fd")
            with pytest.raises(InvalidArgument) as e:
                await a.app.registrar.register(wire_in.registration(req), a.app.planner)
            assert e.value.field == "allocations[0].handle" and _mapped(a) == 0

    run(main())


def test_registering_again_replaces_the_old_generation_and_releases_it() -> None:
    """A second registration is generation 2; the first generation's
    mapping, NIXL registration and local list are released."""

    async def main() -> None:
        async with cluster() as c:
            a = await c.node("a")
            w = c.worker("w")
            first = await a.register(w)
            second = await a.register(w)
            assert second.generation == 2 and a.app.table.get(w.key) is second
            assert first.local_dlist.released and not first.memory.mapped
            assert _mapped(a) == 1 and len(a.agent.registrations) == 1
            assert a.agent.live_dlists == (second.local_dlist,)

    run(main())


def test_replan_keeps_the_memory_and_its_registration() -> None:
    """Re-planning makes a new generation over the same mapping and NIXL
    registration (nothing is mapped or registered again) with a new list."""

    async def main() -> None:
        async with cluster() as c:
            a = await c.node("a")
            w = c.worker("w")
            old = await a.register(w)
            (reg,) = a.agent.registrations
            (new,) = await a.app.replan("baseline")
            assert new.generation == 2 and new.memory is old.memory
            assert new.model.planner.name == "baseline"
            assert a.agent.registrations == (reg,) and _mapped(a) == 1
            assert old.local_dlist.released and a.agent.live_dlists == (new.local_dlist,)

    run(main())


def test_worker_gone_releases_everything_and_its_grants() -> None:
    """When the worker's Attach stream ends (worker death) the daemon
    unmaps, deregisters and forgets it, grants included: a peer holding a
    capability granted before is refused (PermissionDenied), and a fresh
    handshake finds no worker (NotFound)."""

    async def main() -> None:
        async with cluster() as c:
            a, b = await c.node("a"), await c.node("b")
            wa, wb = c.worker("decode"), c.worker("prefill", seed=2)
            await a.register(wa)
            await b.register(wb)
            await a.transfer(spec(wa, b, wb, [(0, 0)]))
            late = spec(wa, b, wb, [(1, 1)], request_id="req-2")
            await b.app.lifecycle.worker_gone(wb.key)
            assert _mapped(b) == 0 and b.agent.registrations == ()
            assert b.agent.live_dlists == () and b.app.store.workers() == []
            assert len(b.app.grants) == 0 and b.app.store.grants() == []
            with pytest.raises(PermissionDenied):
                await a.transfer(late)
            with pytest.raises(NotFound):
                await b.peers.handshake(b.target, wb.key)

    run(main())


def test_close_releases_every_worker() -> None:
    """Closing the daemon deregisters and unmaps every worker and closes its agent."""

    async def main() -> None:
        async with cluster() as c:
            a = await c.node("a")
            for name in ("w1", "w2"):
                await a.register(c.worker(name))
            agent = a.agent
            assert _mapped(a) == 2
            await c.stop(a)
            assert _mapped(a) == 0 and agent.registrations == () and agent.closed

    run(main())
