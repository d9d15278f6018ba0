"""Daemons in one process for the engine's tests: real ``DaemonApp``s (real
worker table, registrar, transfer engine, leases, progress loop, state store
in memory, fd hand-off socket) over the fake NIXL network, with the gRPC hop
between daemons replaced by ``FakePeers`` and worker memory in real memfds.
Their adapters are built by the daemon's composition root
(``bootstrap.build_adapters``), with those fakes in place of NIXL and peers;
what goes in and out of the engine crosses the api's wire modules
(``api.wire_in``, ``api.wire_out``), as RPCs do."""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fake_nixl import FakeAgent, FakeNetwork

from kvmap.client.fd_handoff import sealed_memfd, send_fds
from kvmap.core import convert
from kvmap.core.config import DaemonConfig
from kvmap.core.errors import HandshakeAgain, StaleGeneration, Unavailable
from kvmap.core.geometry import WorkerGeometry, WorkerKey
from kvmap.core.grants import Access, Grant
from kvmap.core.push_offers import Offer
from kvmap.core.transfer_requests import Announcement, ReleaseNotice
from kvmap.core.transfer_wire import (
    announcement_from_proto,
    announcement_to_proto,
    release_notice_from_proto,
    release_notice_to_proto,
    report_to_proto,
    transfer_from_spec,
)
from kvmap.daemon.adapters.cuda_driver import CudaUnavailable
from kvmap.daemon.adapters.cuda_ipc import CudaDriver, CudaIpcImporter
from kvmap.daemon.adapters.memory import ShmImporter
from kvmap.daemon.adapters.peer_client import PeerHandshake
from kvmap.daemon.api import wire_in, wire_out
from kvmap.daemon.bootstrap import build_adapters
from kvmap.daemon.engine.app import DaemonApp
from kvmap.daemon.engine.leases import Lease
from kvmap.daemon.engine.transfers import Pacing
from kvmap.daemon.engine.workers import EventQueue, WorkerRecord
from kvmap.v1 import peer_pb2, registry_pb2, transfers_pb2, types_pb2

PAGE = 256  # bytes of one layer's page of one block
LAYERS = 2
BLOCKS = 8
ROW = LAYERS * PAGE  # block-outermost: a block's layers are adjacent
SIZE = BLOCKS * ROW


def no_cuda() -> CudaDriver:
    raise CudaUnavailable("no CUDA driver in the engine's unit tests")


# Who every in-process daemon's Peer calls come from, as
# ``api.authorization.peer_identity`` would name them: daemons of one host
# (one address, no certificates).
HARNESS_PEER = "127.0.0.1"


class FakePeers:
    """The Peer service calls between daemons of one process: what
    ``PeerClient`` sends and ``PeerService`` answers, without gRPC
    (``PeerClient`` reports the owner's FAILED_PRECONDITION with the reason
    HANDSHAKE_AGAIN as a stale generation, and so does this; any other error
    passes through as it is)."""

    def __init__(self, directory: dict[str, DaemonApp]) -> None:
        self._directory = directory
        self.ended: list[str] = []  # tokens of the leases ended
        self.begun: list[peer_pb2.BeginTransferRequest] = []
        self.tokens: list[str] = []  # of the leases begun
        # The bound each begin or release was given, in order.
        self.call_timeouts: list[float] = []
        # Every handshake asked for, by target, in order.
        self.handshakes: list[str] = []
        self._asked = asyncio.Condition()
        # Targets whose handshakes wait until their event is set (a silent
        # peer: never set).
        self._held: dict[str, asyncio.Event] = {}
        # Targets whose BeginTransfer answers wait until their event is set
        # (an owner slow to check a pull); ``begins_asked`` counts the calls.
        self._begins_held: dict[str, asyncio.Event] = {}
        self.begins_asked = 0

    def hold(self, target: str) -> asyncio.Event:
        """Handshakes with ``target`` wait until the returned event is set."""
        return self._held.setdefault(target, asyncio.Event())

    def hold_begins(self, target: str) -> asyncio.Event:
        """BeginTransfer calls to ``target`` are answered only once the
        returned event is set (the owner checks them as they were sent)."""
        return self._begins_held.setdefault(target, asyncio.Event())

    async def until_asked(self, count: int) -> None:
        """Wait until ``count`` handshakes have been asked for in all."""
        async with self._asked:
            await self._asked.wait_for(lambda: len(self.handshakes) >= count)

    def _app(self, target: str) -> DaemonApp:
        app = self._directory.get(target)
        if app is None:
            raise Unavailable(f"remote daemon {target}: nothing listens")
        return app

    async def handshake(self, target: str, worker: WorkerKey) -> PeerHandshake:
        self.handshakes.append(target)
        async with self._asked:
            self._asked.notify_all()
        held = self._held.get(target)
        if held is not None:
            await held.wait()
        app = self._app(target)
        record = app.lifecycle.worker_for_peer(worker)
        return PeerHandshake(
            peer_pb2.GetAgentMetadataResponse(
                agent_name=app.agent_name,
                agent_metadata=await app.agent_metadata(),
                region_map=convert.region_map_to_proto(record.model),
                generation=record.generation,
                daemon_instance=app.instance,
            )
        )

    async def begin(self, target: str, announcement: Announcement, timeout_s: float) -> str:
        self.call_timeouts.append(timeout_s)
        self.begins_asked += 1
        # Over the wire form and back, as PeerClient sends it.
        req = announcement_to_proto(announcement)
        held = self._begins_held.get(target)
        if held is not None:
            await held.wait()
        app = self._app(target)
        self.begun.append(req)
        try:
            lease = begin_transfer(app, req)
        except HandshakeAgain:
            raise StaleGeneration(str(req.worker), req.generation, 0) from None
        self.tokens.append(lease.token)
        return lease.token

    async def release(self, target: str, notice: ReleaseNotice, timeout_s: float) -> None:
        self.call_timeouts.append(timeout_s)
        app = self._app(target)
        req = release_notice_to_proto(notice)
        self.begun.append(req)
        release_grant(app, req)

    async def offer_push(self, target: str, offer: Offer, timeout_s: float) -> int:
        return self._app(target).push_offers.relay(offer, peer=HARNESS_PEER)

    async def end(self, target: str, token: str) -> None:
        self.ended.append(token)
        self._app(target).owner.end(token, peer=HARNESS_PEER)

    async def close(self) -> None:
        pass


def begin_transfer(
    app: DaemonApp, req: peer_pb2.BeginTransferRequest, peer: str = HARNESS_PEER
) -> Lease:
    """What PeerService.BeginTransfer runs for a transfer from ``peer``."""
    return app.owner.begin(announcement_from_proto(req), peer=peer)


def release_grant(
    app: DaemonApp, req: peer_pb2.BeginTransferRequest, peer: str = HARNESS_PEER
) -> Grant:
    """What PeerService.BeginTransfer runs for a release from ``peer``."""
    return app.owner.release(release_notice_from_proto(req), peer=peer)


async def run_spec(
    app: DaemonApp, spec: transfers_pb2.TransferSpec, write: bool = False
) -> AsyncIterator[transfers_pb2.TransferStatus]:
    """What TransfersService.Pull (Push with ``write``) runs: the spec
    checked, the engine's reports as statuses."""
    req = transfer_from_spec(spec, app.config.transfer_timeout_s)
    async for report in app.engine.run(req, write=write):
        yield report_to_proto(report)


class VirtualClock:
    """The clock of a transfer's retries, moved only by its sleeps: backoff
    costs no real time and deadlines are exact. ``on_sleep`` (awaited with
    the number of the sleep, from 1) lets a test act during a pause, as a
    restart happens while a puller waits to try again."""

    def __init__(self, on_sleep: Callable[[int], Awaitable[None]] | None = None) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []
        self.on_sleep = on_sleep

    def time(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        if self.on_sleep is not None:
            await self.on_sleep(len(self.sleeps))
        await asyncio.sleep(0)

    def pacing(self) -> Pacing:
        """Backoff on this clock, without jitter (every draw 0)."""
        return Pacing(now=self.time, sleep=self.sleep, draw=lambda: 0.0)


@dataclass
class Worker:
    """A CPU worker's KV cache: one memfd, ``BLOCKS`` rows of ``LAYERS`` pages."""

    engine_id: str
    # Its tensor-parallel rank and size (what a grant's reader count is
    # checked against, ``core.grants.ReaderLayout``).
    tp_rank: int = 0
    tp_size: int = 1
    fd: int = field(init=False)

    def __post_init__(self) -> None:
        self.fd = sealed_memfd(f"kv-{self.engine_id}", SIZE)

    @property
    def id(self) -> types_pb2.WorkerId:
        return types_pb2.WorkerId(engine_id=self.engine_id, tp_rank=self.tp_rank)

    @property
    def key(self) -> WorkerKey:
        return convert.requested_worker(self.id, "worker")

    def fill(self, seed: int) -> None:
        """Every byte distinct per (worker seed, block, offset)."""
        os.pwrite(self.fd, bytes((seed * 37 + i * 7 + i // 251) % 256 for i in range(SIZE)), 0)

    def block(self, b: int) -> bytes:
        return os.pread(self.fd, ROW, b * ROW)

    def page(self, b: int, layer: int) -> bytes:
        return os.pread(self.fd, PAGE, b * ROW + layer * PAGE)

    def request(self, token: str) -> registry_pb2.RegisterWorkerRequest:
        req = registry_pb2.RegisterWorkerRequest(
            worker=self.id, kv_cache_layout="BLHNC", block_size_tokens=16, tp_size=self.tp_size
        )
        req.allocations.add(
            id="kv",
            size_bytes=SIZE,
            device=types_pb2.Device(type=types_pb2.DEVICE_TYPE_CPU),
            shm_fd=types_pb2.ShmFdHandle(token=token, index=0),
        )
        for layer in range(LAYERS):
            req.views.add(
                layer_name=f"layer.{layer}",
                allocation_id="kv",
                transfer_group=0,
                cache_kind=types_pb2.CACHE_KIND_MLA,
                dtype="uint8",
                offset_bytes=layer * PAGE,
                block_len_bytes=PAGE,
                block_stride_bytes=ROW,
                num_blocks=BLOCKS,
            )
        return req

    def registration(self, token: str) -> WorkerGeometry:
        """``request(token)`` as RegisterWorker reads it off the wire."""
        return wire_in.registration(self.request(token))

    def close(self) -> None:
        os.close(self.fd)


class Node:
    """One daemon of the cluster, reachable by peers as ``target``."""

    def __init__(self, app: DaemonApp, target: str, peers: FakePeers) -> None:
        self.app = app
        self.target = target
        self.peers = peers

    @property
    def agent(self) -> FakeAgent:
        agent = self.app.agent
        assert isinstance(agent, FakeAgent)
        return agent

    async def hand_over(self, worker: Worker) -> str:
        """Send the worker's memfd over the real fd hand-off socket: its token."""
        path = self.app.config.fd_socket_path
        return await asyncio.to_thread(send_fds, path, [worker.fd], 5.0)

    async def register(self, worker: Worker) -> WorkerRecord:
        """Hand the worker's memfd over and register it, as RegisterWorker does."""
        token = await self.hand_over(worker)
        return await self.app.lifecycle.register(worker.registration(token), self.app.planner)

    def grant(
        self,
        worker: Worker,
        request_id: str,
        blocks: dict[int, list[int]],
        *,
        ttl_ms: int = 0,
        max_uses: int = 0,
        open_uses: bool = False,
        write: bool = False,
    ) -> str:
        """A capability for ``blocks`` (per group) of the worker's request, to
        read them or (``write``) to write them, as Registry.GrantTransfer
        mints it for an attached worker (the worker is attached for the call)."""
        events = self.app.table.subscribe(worker.key)
        try:
            capability, _ = self.app.owner.grant(
                worker.key,
                request_id=request_id,
                groups=list(blocks.items()),
                ttl_ms=ttl_ms,
                max_uses=max_uses,
                open_uses=open_uses,
                access=Access.WRITE if write else Access.READ,
            )
        finally:
            self.app.table.unsubscribe(worker.key, events)
        return capability

    async def transfer(
        self, spec: transfers_pb2.TransferSpec, *, write: bool = False
    ) -> list[transfers_pb2.TransferStatus]:
        """Run a pull (push with ``write``); once it is done, wait until the
        owner has had the completion notification (its lease ended), as the
        owner's worker would hear it."""
        owner = self.peers._directory[spec.remote_target]
        key = convert.requested_worker(spec.remote_worker, "worker")
        events = owner.table.subscribe(key)
        try:
            statuses = [s async for s in run_spec(self.app, spec, write=write)]
            while (await next_event(events)).transfer_finished.request_id != spec.request_id:
                pass
        finally:
            owner.table.unsubscribe(key, events)
        return statuses


def spec(
    local: Worker,
    remote_node: Node,
    remote: Worker,
    pairs: list[tuple[int, int]],
    *,
    request_id: str = "req-1",
    layers: tuple[str, ...] = (),
    remote_generation: int = 0,
    timeout_ms: int = 0,
    capability: str | None = None,
    write: bool = False,
) -> transfers_pb2.TransferSpec:
    """A pull (push with ``write``) of ``pairs`` (local block, remote block)
    of transfer group 0, with a capability the owner granted for exactly the
    remote blocks of ``pairs``, to read or to write them (unless
    ``capability`` is given; a worker the owner does not have gets none that
    it would know)."""
    if capability is None:
        if remote_node.app.table.find(remote.key) is None:
            capability = "unknown-worker"
        else:
            remote_blocks = sorted({p[1] for p in pairs})
            capability = remote_node.grant(remote, request_id, {0: remote_blocks}, write=write)
    s = transfers_pb2.TransferSpec(
        request_id=request_id,
        local_worker=local.id,
        remote_target=remote_node.target,
        remote_worker=remote.id,
        remote_generation=remote_generation,
        timeout_ms=timeout_ms,
        capability=capability,
    )
    s.groups.add(
        transfer_group=0,
        local_block_ids=[p[0] for p in pairs],
        remote_block_ids=[p[1] for p in pairs],
        layer_names=list(layers),
    )
    return s


@dataclass
class Cluster:
    network: FakeNetwork = field(default_factory=FakeNetwork)
    directory: dict[str, DaemonApp] = field(default_factory=dict)
    nodes: list[Node] = field(default_factory=list)
    workers: list[Worker] = field(default_factory=list)
    dirs: list[str] = field(default_factory=list)

    async def node(
        self, name: str, instance: str = "", pacing: Pacing | None = None, **config: float
    ) -> Node:
        """Start a daemon reachable as ``<name>:1``; its agent is
        ``kvmapd-<instance>`` (``instance`` defaults to the name: a restarted
        daemon has a new one); its transfers retry on ``pacing`` (the real
        clock by default)."""
        # Short: a Unix socket path has a 108-byte limit.
        tmp = tempfile.mkdtemp(prefix="kvm-")
        self.dirs.append(tmp)
        peers = FakePeers(self.directory)
        # A failed test must not wait the default 30 s for a pinned record.
        config.setdefault("transfer_timeout_s", 5.0)
        cfg = DaemonConfig(socket=f"{tmp}/kvmapd.sock", **config)  # type: ignore[arg-type]
        adapters = build_adapters(
            cfg,
            instance or name,
            create_agent=self.network.agent,
            peers=peers,
            shm=ShmImporter(),
            cuda=CudaIpcImporter(no_cuda),
            pacing=pacing or Pacing(),
        )
        app = DaemonApp(cfg, instance or name, adapters)
        await app.start()
        target = f"{name}:1"
        self.directory[target] = app
        node = Node(app, target, peers)
        self.nodes.append(node)
        return node

    def worker(self, engine_id: str, seed: int = 0, *, tp: tuple[int, int] = (0, 1)) -> Worker:
        """A worker of rank ``tp[0]`` of tensor-parallel size ``tp[1]``."""
        w = Worker(engine_id, tp_rank=tp[0], tp_size=tp[1])
        if seed:
            w.fill(seed)
        self.workers.append(w)
        return w

    def crash(self, node: Node) -> None:
        """The daemon stops answering peers without closing anything (a
        ``kill -9``: nothing it holds is released or deregistered)."""
        self.directory.pop(node.target, None)

    async def stop(self, node: Node) -> None:
        self.directory.pop(node.target, None)
        if node in self.nodes:
            self.nodes.remove(node)
            await node.app.close()

    async def close(self) -> None:
        # Leases a test left open would pin their records, and each daemon's
        # close would wait transfer_timeout_s for them: the test is over.
        for node in self.nodes:
            node.app.owner.expire(now=math.inf)
        for node in list(self.nodes):
            await self.stop(node)
        for w in self.workers:
            w.close()
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)


async def two(
    c: Cluster,
    *,
    pacing: Pacing | None = None,
    decode_seed: int = 5,
    owner: dict[str, Any] | None = None,
    **decode_config: float,
) -> tuple[Node, Worker, Node, Worker]:
    """Daemon a (``decode_config``, retrying on ``pacing``) with decode
    worker wa (filled from ``decode_seed``; 0: zeros), daemon b (``owner``'s
    config) with prefill worker wb (seed 3), both registered."""
    a = await c.node("a", pacing=pacing, **decode_config)
    b = await c.node("b", **(owner or {}))
    wa, wb = c.worker("decode", seed=decode_seed), c.worker("prefill", seed=3)
    await a.register(wa)
    await b.register(wb)
    return a, wa, b, wb


@asynccontextmanager
async def cluster() -> AsyncIterator[Cluster]:
    c = Cluster()
    try:
        yield c
    finally:
        await c.close()


async def next_event(queue: EventQueue) -> registry_pb2.AttachResponse:
    """The next event an Attach stream of the worker would send (as it
    sends it: ``api.wire_out``)."""
    _, event = await asyncio.wait_for(queue.get(), 5.0)
    assert event is not None, "the stream was ended"
    return wire_out.attach_event(event)


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(coro)
