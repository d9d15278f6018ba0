"""The daemon's state and its long-lived resources, shared by the gRPC
services: the worker table, the NIXL agent (driven from one thread and
progressed by our own loop), the fd hand-off socket, the registrar, the
transfer engine and the owner's leases.

The adapters that hold process-wide state (the NIXL agent, the peer channels,
the memory importers) are made once per daemon (``Adapters.for_config``) and
handed down; the engine's tests hand in fakes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from dataclasses import dataclass, replace
from typing import Any

import structlog

from kvmap.daemon.adapters.config_files import load_config
from kvmap.daemon.adapters.cuda_ipc import CudaIpcImporter
from kvmap.daemon.adapters.fd_handoff import FdHandoffServer
from kvmap.daemon.adapters.memory import ShmImporter
from kvmap.daemon.adapters.metrics import Metrics
from kvmap.daemon.adapters.nixl_agent import NixlAgent
from kvmap.daemon.adapters.nixl_port import AgentFactory, NixlPort
from kvmap.daemon.adapters.nixl_thread import NixlThread
from kvmap.daemon.adapters.peer_client import PeerClient, peer_credentials
from kvmap.daemon.adapters.state_store import StateStore
from kvmap.daemon.core import convert
from kvmap.daemon.core import planner as planners
from kvmap.daemon.core.config import DaemonConfig
from kvmap.daemon.core.errors import NotFound, Unavailable
from kvmap.daemon.core.geometry import WorkerKey
from kvmap.daemon.engine.leases import LeaseTable, token_of
from kvmap.daemon.engine.progress import Progress
from kvmap.daemon.engine.registration import Registrar
from kvmap.daemon.engine.transfers import Peers, TransferEngine
from kvmap.daemon.engine.workers import WorkerRecord, WorkerTable
from kvmap.v1 import admin_pb2, registry_pb2

log = structlog.get_logger("kvmapd")


@dataclass(frozen=True)
class Adapters:
    """The daemon's adapters that hold process-wide state."""

    create_agent: AgentFactory
    peers: Peers
    # One importer of each kind per daemon: each counts (and the CUDA one
    # shares) what it has open in the process.
    shm: ShmImporter
    cuda: CudaIpcImporter

    @classmethod
    def for_config(cls, config: DaemonConfig) -> Adapters:
        """The real ones: NIXL, gRPC to peers (mTLS when configured)."""
        return cls(
            create_agent=NixlAgent.create,
            peers=PeerClient(config.connect_timeout_s, peer_credentials(config)),
            shm=ShmImporter(),
            cuda=CudaIpcImporter(),
        )


class DaemonApp:
    def __init__(
        self,
        config: DaemonConfig,
        metrics: Metrics,
        instance: str,
        adapters: Adapters | None = None,
    ) -> None:
        self.config = config
        self.adapters = adapters or Adapters.for_config(config)
        self.metrics = metrics
        self.instance = instance
        self.agent_name = f"kvmapd-{instance}"
        self.table = WorkerTable()
        self.planner = planners.get_planner(config.planner)
        self.draining = False
        self.nixl = NixlThread()
        self._agent: NixlPort | None = None
        self.fds = FdHandoffServer(config.fd_socket_path)
        self._registrar: Registrar | None = None
        self._engine: TransferEngine | None = None
        self._progress: Progress | None = None
        self.leases = LeaseTable()
        self.store = StateStore(config.state_dir)
        # Workers known before a restart whose memory only their client can
        # hand over again, until when they are expected back.
        self._awaiting: dict[WorkerKey, float] = {}
        for key, generation in self.store.generations().items():
            self.table.seed_generation(key, generation)
        self.counters = admin_pb2.TransferCounters()
        self._background: set[asyncio.Task[object]] = set()

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
        await self.fds.start()
        self._progress = Progress(
            agent, self.nixl, self._on_notifs, busy=lambda: len(self.leases) > 0
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
        )
        self._spawn(self._expire_leases())
        await self._restore()

    async def _restore(self) -> None:
        """Bring back every stored worker whose memory the daemon can open
        without it, re-planned with the planner it runs now."""
        for stored in self.store.workers():
            record = await self.registrar.restore(stored, self.planner)
            if record is None:
                # Its client re-registers when it re-attaches; the stored
                # geometry is dropped so nothing stale is ever served, and
                # peers are told to retry meanwhile (UNAVAILABLE).
                self.store.delete_worker(stored.worker)
                self._awaiting[stored.worker] = (
                    time.monotonic() + self.config.restore_attach_grace_s
                )
                continue
            log.info(
                "worker_restored",
                worker=str(record.key),
                generation=record.generation,
                previous_generation=stored.generation,
                planner=self.planner.info.name,
                previous_planner=stored.planner,
            )
            self._spawn(self._expect_attach(record.key, record.generation))
        self.update_gauges()

    async def _expect_attach(self, key: WorkerKey, generation: int) -> None:
        """A restored worker whose client never comes back is gone."""
        await asyncio.sleep(self.config.restore_attach_grace_s)
        record = self.table.find(key)
        if record is not None and self.table.subscriber_count(key) == 0:
            log.warning("restored_worker_never_attached", worker=str(key), generation=generation)
            await self.worker_gone(key)

    def _spawn(self, coro: Coroutine[Any, Any, object]) -> None:
        task: asyncio.Task[object] = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _on_notifs(self, notifs: dict[str, list[bytes]]) -> None:
        """NIXL notifications from pullers/pushers: the transfer is complete."""
        for peer, messages in notifs.items():
            for message in messages:
                token = token_of(message)
                lease = self.leases.finish(token) if token else None
                if lease is None:
                    log.info("notif_unmatched", peer=peer, message=message[:64])
                    continue
                self.counters.served_done += 1
                self.counters.served_blocks += lease.blocks
                direction = (
                    registry_pb2.TRANSFER_DIRECTION_PUSHED_TO
                    if lease.write
                    else registry_pb2.TRANSFER_DIRECTION_PULLED_FROM
                )
                event = registry_pb2.AttachResponse(
                    transfer_finished=registry_pb2.TransferFinishedEvent(
                        request_id=lease.request_id, direction=direction, peer_agent=peer
                    )
                )
                # Persisted until an Attach stream has sent it: a restart
                # between the notification and the worker loses nothing.
                event_id = self.store.add_event(lease.record.key, event)
                self.table.publish(lease.record.key, event, event_id)

    async def _expire_leases(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            for lease in self.leases.expire():
                log.warning("lease_expired", request_id=lease.request_id, peer=lease.peer_agent)

    def _transfers_in_flight(self) -> bool:
        return bool(self._engine and self._engine.in_flight) or len(self.leases) > 0

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
            await self.registrar.deregister(record.key)
        await self.fds.close()
        if self._agent is not None:
            await self.nixl(self._agent.close)
        self.nixl.shutdown()
        self.adapters.cuda.shutdown()  # after every registration of imported VRAM is gone
        self.store.close()

    def worker_for_peer(self, key: WorkerKey) -> WorkerRecord:
        """A worker a peer asks for: NOT_FOUND if unknown, UNAVAILABLE while
        it is expected back after a daemon restart."""
        record = self.table.find(key)
        if record is not None:
            return record
        if self._awaiting.get(key, 0.0) > time.monotonic():
            raise Unavailable(f"worker {key} is re-registering after a kvmapd restart; retry")
        return self.table.get(key)

    def registered(self, record: WorkerRecord) -> None:
        self._awaiting.pop(record.key, None)
        self.update_gauges()
        self.publish_map_changed(record)

    async def worker_gone(self, key: WorkerKey) -> None:
        """The worker's Attach stream ended: release everything it had."""
        log.info("worker_gone", worker=str(key))
        try:
            await self.registrar.deregister(key)
        except NotFound:
            return  # deregistered meanwhile
        self.update_gauges()

    def stats(self) -> admin_pb2.GetStatsResponse:
        return admin_pb2.GetStatsResponse(
            transfers=self.counters,
            workers=len(self.table),
            remote_agents=self.engine.remote_agent_count,
            daemon_instance=self.instance,
            planner=convert.planner_info_to_proto(self.planner.info),
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

    def publish_map_changed(self, record: WorkerRecord) -> None:
        planner = record.model.planner
        self.table.publish(
            record.key,
            registry_pb2.AttachResponse(
                region_map_changed=registry_pb2.RegionMapChangedEvent(
                    generation=record.generation,
                    planner=convert.planner_info_to_proto(planner),
                )
            ),
        )

    async def replan(self, planner_name: str) -> list[WorkerRecord]:
        planner = planners.get_planner(planner_name or self.config.planner)
        records = await self.registrar.replan(planner)
        self.planner = planner
        for record in records:
            self.publish_map_changed(record)
        self.update_gauges()
        log.info("replanned", planner=planner.info.name, workers=len(records))
        return records

    def request_replan(self) -> None:
        """SIGHUP: re-read the config file's planner and re-plan every worker."""
        planner = ""
        if self.config.config_file:
            try:
                planner = load_config(self.config.config_file, {}).planner
            except (OSError, ValueError) as err:
                log.error("config_reload_failed", error=str(err))
                return
            self.config = replace(self.config, planner=planner)
        self._spawn(self.replan(planner))

    def _background_done(self, task: asyncio.Task[object]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background_task_failed", error=str(task.exception()))
