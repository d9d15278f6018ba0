"""The daemon's engine in one object: the long-lived resources (the worker
table, the NIXL agent driven from one thread and progressed by our own
loop, the fd hand-off socket, the state store) and the parts that own the
daemon's state, each of which a service calls once:

- ``registrar`` (engine/registration): registers, re-plans, retires workers;
- ``lifecycle`` (engine/lifecycle): restored, returning and unattached workers;
- ``owner`` (engine/owner): grants, leases, releases, notifications;
- ``events`` (engine/events): the workers' persisted event outbox;
- ``engine`` (engine/transfers): this daemon's pulls and pushes.

The engine builds no adapter: the composition root (``kvmap.daemon.bootstrap``)
makes each once per daemon (the state store, the fd hand-off server, the
NIXL thread and how to create the agent, the peer channels, the memory
importers, the metrics) and hands them in as ``Adapters``; the engine's
tests build them there too, some replaced by fakes. It takes and returns
domain types only: the api converts the wire forms (``api.wire_in``,
``api.wire_out``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import structlog

from kvmap.core import grants as grants_core
from kvmap.core import planner as planners
from kvmap.core.config import RELOADABLE_KEYS, DaemonConfig, changed_keys
from kvmap.daemon.adapters.cuda_ipc import CudaIpcImporter
from kvmap.daemon.adapters.fd_handoff import FdHandoffServer
from kvmap.daemon.adapters.memory import ShmImporter
from kvmap.daemon.adapters.metrics import Metrics
from kvmap.daemon.adapters.nixl_port import AgentFactory, NixlPort
from kvmap.daemon.adapters.nixl_thread import NixlThread
from kvmap.daemon.adapters.state_store import StateStore, StateStoreError
from kvmap.daemon.engine.activity import Activity
from kvmap.daemon.engine.events import EventOutbox
from kvmap.daemon.engine.grants import GrantTable
from kvmap.daemon.engine.leases import LeaseTable
from kvmap.daemon.engine.lifecycle import Lifecycle
from kvmap.daemon.engine.owner import OwnerSide
from kvmap.daemon.engine.pacing import Pacing
from kvmap.daemon.engine.progress import Progress
from kvmap.daemon.engine.push_offers import PushOfferRelay
from kvmap.daemon.engine.registration import Registrar
from kvmap.daemon.engine.stats import DaemonStats, TransferCounters
from kvmap.daemon.engine.transfers import Peers, TransferEngine
from kvmap.daemon.engine.workers import WorkerRecord, WorkerTable
from kvmap.tracing import OFF, Tracer

log = structlog.get_logger("kvmapd")

# A NIXL call (or progress pass) running this long holds up every transfer
# of the daemon: it is logged with the NIXL thread's stack (nixl_call_slow).
NIXL_CALL_SLOW_S = 5.0


class Sweeper(Protocol):
    """``adapters.tcp_keepalive.HalfOpenGuard``: arms the TCP connections
    opened since its last sweep."""

    def sweep(self) -> int: ...


@dataclass(frozen=True)
class Adapters:
    """What the engine reaches the world through, one of each per daemon,
    built by ``kvmap.daemon.bootstrap`` and handed in (the engine starts
    and closes them)."""

    create_agent: AgentFactory
    # The one thread every NIXL call runs on.
    nixl: NixlThread
    peers: Peers
    # One importer of each kind per daemon: each counts (and the CUDA one
    # shares) what it has open in the process.
    shm: ShmImporter
    cuda: CudaIpcImporter
    fds: FdHandoffServer
    store: StateStore
    metrics: Metrics
    # SIGHUP: the config file read again (``adapters.config_files``).
    reload_config: Callable[[DaemonConfig], DaemonConfig]
    # Keepalive on each new TCP connection (None: peer_keepalive_s is 0).
    half_open: Sweeper | None = None
    # The clock and backoff of a transfer's retries (tests: a virtual clock).
    pacing: Pacing = field(default_factory=Pacing)
    # Where spans go: OFF (no span records) unless an endpoint is configured.
    tracer: Tracer = OFF


class DaemonApp:
    # The UCX threads NIXL runs for the agent, known once it exists (start).
    nixl_threads = 0

    def __init__(self, config: DaemonConfig, instance: str, adapters: Adapters) -> None:
        self.config = config
        self.adapters = adapters
        self.metrics = adapters.metrics
        self.tracer = adapters.tracer
        self.instance = instance
        self.agent_name = f"kvmapd-{instance}"
        self.table = WorkerTable(on_generation=self.metrics.generations.inc)
        self.metrics.registered_bytes_limit.set(config.max_registered_bytes)
        self.planner = planners.get_planner(config.planner)
        self.draining = False
        self.nixl = adapters.nixl
        self._agent: NixlPort | None = None
        self.fds = adapters.fds
        self._registrar: Registrar | None = None
        self._engine: TransferEngine | None = None
        self._progress: Progress | None = None
        self.leases = LeaseTable()
        self.metrics.leases.set_function(lambda: len(self.leases))
        self.store = adapters.store
        # This daemon's agents before a restart: a claim one of them still
        # holds on a grant at a peer is this daemon's to take over.
        self.previous_agents = self._previous_agents()
        # Per-request capabilities, persisted: a restart keeps them.
        self.grants = GrantTable(self.store)
        for key, generation in self.store.generations().items():
            self.table.seed_generation(key, generation)
        self.counters = TransferCounters()
        # The live view's in-flight transfers and recent failures (Admin.GetStatus).
        self.activity = Activity()
        self._background: set[asyncio.Task[object]] = set()
        self.events = EventOutbox(self.table, self.store, self.grants)
        self.push_offers = PushOfferRelay(self.table)
        self._build_sides(config, self.metrics)

    def _build_sides(self, config: DaemonConfig, metrics: Metrics) -> None:
        """The workers' lifecycle and the owner's side, over the tables above."""
        self.lifecycle = Lifecycle(
            config=config,
            table=self.table,
            store=self.store,
            grants=self.grants,
            events=self.events,
            registrar=lambda: self.registrar,
            spawn=self._spawn,
            update_gauges=self.update_gauges,
        )
        self.owner = OwnerSide(
            agent_name=self.agent_name,
            table=self.table,
            grants=self.grants,
            leases=self.leases,
            events=self.events,
            lifecycle=self.lifecycle,
            metrics=metrics,
            counters=self.counters,
            draining=lambda: self.draining,
            wake=self._wake_progress,
        )

    def _previous_agents(self) -> tuple[str, ...]:
        """Record this daemon's agent; the ones before it, newest first. A
        store that cannot say only means a restart's retried pulls may meet
        their old claim (PERMISSION_DENIED until its lease ends)."""
        try:
            return tuple(self.store.record_agent(self.agent_name, grants_core.MAX_REPLACED_AGENTS))
        except StateStoreError as err:
            log.error("agent_not_stored", agent=self.agent_name, error=str(err))
            return ()

    @property
    def registrar(self) -> Registrar:
        assert self._registrar is not None, "DaemonApp.start() not called"
        return self._registrar

    @property
    def engine(self) -> TransferEngine:
        assert self._engine is not None, "DaemonApp.start() not called"
        return self._engine

    @property
    def agent(self) -> NixlPort:
        assert self._agent is not None, "DaemonApp.start() not called"
        return self._agent

    async def agent_metadata(self) -> bytes:
        return await self.nixl(self.agent.metadata)

    async def start(self) -> None:
        create_agent = self.adapters.create_agent
        self._agent = agent = await self.nixl(lambda: create_agent(self.agent_name))
        # As NIXL reports it (the operator's check that the setting took).
        self.nixl_threads = await self.nixl(lambda: agent.threads)
        await self.fds.start()
        self._progress = Progress(
            agent, self.nixl, self.owner.on_notifs, busy=lambda: len(self.leases) > 0
        )
        self._progress.start()
        self._engine = TransferEngine(
            config=self.config,
            table=self.table,
            agent=agent,
            agent_name=self.agent_name,
            nixl=self.nixl,
            progress=self._progress,
            peers=self.adapters.peers,
            metrics=self.metrics,
            counters=self.counters,
            pacing=self.adapters.pacing,
            replaces_agents=self.previous_agents,
            tracer=self.tracer,
        )
        self._registrar = Registrar(
            table=self.table,
            agent=agent,
            fds=self.fds,
            shm=self.adapters.shm,
            cuda=self.adapters.cuda,
            nixl=self.nixl,
            retire_timeout_s=self.config.transfer_timeout_s,
            on_retire=self._engine.forget_local,
            store=self.store,
            max_workers=self.config.max_workers,
            max_registered_bytes=self.config.max_registered_bytes,
        )
        self._spawn(self._expire_leases())
        self._spawn(self._watch_nixl_thread())
        if self.adapters.half_open is not None:
            self._spawn(self._guard_half_open(self.adapters.half_open))
        await self.lifecycle.restore(self.planner)

    def _wake_progress(self) -> None:
        if self._progress is not None:
            self._progress.wake()

    def _spawn(self, coro: Coroutine[Any, Any, object]) -> None:
        task: asyncio.Task[object] = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    async def _expire_leases(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            self.owner.expire()

    async def _guard_half_open(self, guard: Sweeper) -> None:
        """Keepalive on each new TCP connection within a sweep's period
        (adapters/tcp_keepalive.py says why: UCX arms only those it dials)."""
        period = max(1.0, self.config.peer_keepalive_s / 4)
        while True:
            guard.sweep()
            await asyncio.sleep(period)

    async def _watch_nixl_thread(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.nixl.tell_if_stuck(NIXL_CALL_SLOW_S)

    def _transfers_in_flight(self) -> bool:
        return bool(self._engine and self._engine.busy) or len(self.leases) > 0

    async def drain(self, seconds: float) -> None:
        """Wait (bounded) for in-flight transfers to finish."""
        deadline = asyncio.get_running_loop().time() + seconds
        while self._transfers_in_flight():
            if asyncio.get_running_loop().time() > deadline:
                log.warning(
                    "drain_timeout", pinned=[str(r.key) for r in self.table.records() if r.pins]
                )
                break
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        if self._engine is not None:
            await self._engine.close()
        if self._progress is not None:
            await self._progress.stop()
        for record in self.table.records():
            # Kept in the store: the daemon that replaces this one restores it.
            await self.registrar.release_kept(record.key)
        await self.fds.close()
        if self._agent is not None:
            await self.nixl(self._agent.close)
        self.nixl.shutdown()
        self.adapters.cuda.shutdown()  # after every registration of imported VRAM is gone
        self.store.close()
        self.tracer.shutdown()  # the last spans (bounded: a collector may be gone)

    def stats(self) -> DaemonStats:
        counters = replace(
            self.counters,
            push_offers_relayed=self.push_offers.relayed,
            push_offers_refused=self.push_offers.refused,
        )
        return DaemonStats(
            transfers=counters,
            workers=len(self.table),
            remote_agents=self.engine.remote_agent_count,
            daemon_instance=self.instance,
            planner=self.planner.info,
            mapped_allocations=(
                self.adapters.shm.live_mappings() + self.adapters.cuda.live_mappings()
            ),
            mapped_bytes=sum(r.memory.size_bytes for r in self.table.records()),
            nixl_registrations=len(self.agent.registrations),
            fd_handoff_pending=self.fds.pending_fds,
            leases=len(self.leases),
        )

    def update_gauges(self) -> None:
        records = self.table.records()
        m = self.metrics
        m.workers.set(len(records))
        m.regions.set(sum(len(r.model.regions) for r in records))
        m.descriptors.set(sum(r.model.descriptor_count for r in records))
        m.baseline_descriptors.set(sum(r.model.baseline_descriptor_count for r in records))
        m.registered_bytes.set(sum(r.memory.size_bytes for r in records))

    async def replan(self, planner_name: str) -> list[WorkerRecord]:
        """Re-plan every worker with ``planner_name``; "" means the planner
        the daemon runs now (not the configured one: a planner chosen by an
        earlier replan stays until someone names another)."""
        planner = planners.get_planner(planner_name) if planner_name else self.planner
        records = await self.registrar.replan(
            planner, on_swap=lambda record: self.grants.rebind(record.key, record.generation)
        )
        self.planner = planner
        for record in records:
            self.events.publish_map_changed(record)
        self.update_gauges()
        log.info("replanned", planner=planner.info.name, workers=len(records))
        return records

    def request_replan(self) -> None:
        """SIGHUP: re-read the config file (the flags given at start still
        win), apply its planner and re-plan every worker. A file the daemon
        could not start with is refused in one line and changes nothing;
        other changed keys are named as needing a restart."""
        planner = self.planner.info.name
        if self.config.config_file:
            try:
                new = self.adapters.reload_config(self.config)
            except ValueError as err:
                log.error("config_reload_refused", error=str(err), kept="the running config")
                return
            restart = [k for k in changed_keys(self.config, new) if k not in RELOADABLE_KEYS]
            if restart:
                log.warning("config_change_needs_restart", keys=restart)
            self.config = replace(self.config, planner=new.planner)
            planner = new.planner
        self._spawn(self.replan(planner))

    def _background_done(self, task: asyncio.Task[object]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background_task_failed", error=str(task.exception()))
