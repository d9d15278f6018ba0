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
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import structlog

from kvmap.core import convert
from kvmap.core import grants as grants_core
from kvmap.core import planner as planners
from kvmap.core.config import DaemonConfig
from kvmap.core.errors import (
    SHUTTING_DOWN,
    FailedPrecondition,
    HandshakeAgain,
    InvalidArgument,
    KvmapError,
    NotFound,
    Unavailable,
)
from kvmap.core.geometry import WorkerKey
from kvmap.core.grants import Grant
from kvmap.daemon.adapters.config_files import load_config
from kvmap.daemon.adapters.cuda_ipc import CudaIpcImporter
from kvmap.daemon.adapters.fd_handoff import FdHandoffServer
from kvmap.daemon.adapters.memory import ShmImporter
from kvmap.daemon.adapters.metrics import Metrics
from kvmap.daemon.adapters.nixl_agent import NixlAgent
from kvmap.daemon.adapters.nixl_port import AgentFactory, NixlPort
from kvmap.daemon.adapters.nixl_thread import NixlThread
from kvmap.daemon.adapters.peer_client import PeerClient
from kvmap.daemon.adapters.state_store import StateStore, StateStoreError, StoredWorker
from kvmap.daemon.engine.grants import GrantTable
from kvmap.daemon.engine.leases import DEFAULT_LEASE_S, Lease, LeaseTable, token_of
from kvmap.daemon.engine.progress import Progress
from kvmap.daemon.engine.registration import Registrar
from kvmap.daemon.engine.transfers import Pacing, Peers, TransferEngine
from kvmap.daemon.engine.workers import WorkerRecord, WorkerTable
from kvmap.v1 import admin_pb2, peer_pb2, registry_pb2

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
    # The clock and backoff of a transfer's retries (tests: a virtual clock).
    pacing: Pacing = field(default_factory=Pacing)

    @classmethod
    def for_config(cls, config: DaemonConfig) -> Adapters:
        """The real ones: NIXL, gRPC to peers (mTLS when configured)."""
        return cls(
            create_agent=NixlAgent.create,
            peers=PeerClient.for_config(config),
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
        self.metrics.leases.set_function(lambda: len(self.leases))
        self.store = StateStore(config.state_dir)
        # This daemon's agents before a restart: a claim one of them still
        # holds on a grant at a peer is this daemon's to take over.
        self.previous_agents = self._previous_agents()
        # Per-request capabilities, persisted: a restart keeps them.
        self.grants = GrantTable(self.store)
        # Workers known before a restart whose memory only their client can
        # hand over again, until when they are expected back.
        self._awaiting: dict[WorkerKey, float] = {}
        # What such a worker had (its stored row and undelivered events):
        # if it comes back over the very same memory, its grants and events
        # still hold.
        self._returning: dict[WorkerKey, _Returning] = {}
        # Restored workers whose clients have not attached again yet (until
        # their grace ends): they may be granted meanwhile, since their
        # events wait in the store for the Attach.
        self._restored_unattached: set[WorkerKey] = set()
        # Registered workers not attached yet, each with a timer running.
        self._unattached: set[WorkerKey] = set()
        for key, generation in self.store.generations().items():
            self.table.seed_generation(key, generation)
        self.counters = admin_pb2.TransferCounters()
        self._background: set[asyncio.Task[object]] = set()

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
            pacing=self.adapters.pacing,
            replaces_agents=self.previous_agents,
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
                self._returning[stored.worker] = _Returning(
                    stored, [e for _, e in self.store.pending_events(stored.worker)]
                )
                self.store.delete_worker(stored.worker)
                self._awaiting[stored.worker] = (
                    time.monotonic() + self.config.restore_attach_grace_s
                )
                continue
            # Same memory, new plan: the worker's grants still mean its blocks.
            self.grants.rebind(record.key, record.generation)
            log.info(
                "worker_restored",
                worker=str(record.key),
                generation=record.generation,
                previous_generation=stored.generation,
                planner=self.planner.info.name,
                previous_planner=stored.planner,
            )
            self._restored_unattached.add(record.key)
            self._spawn(self._expect_restored_attach(record.key, record.generation))
        self.update_gauges()

    async def _expect_attach(
        self, key: WorkerKey, generation: int, grace_s: float | None = None, what: str = "restored"
    ) -> None:
        """A restored (or newly registered) worker whose client never
        attaches is gone."""
        await asyncio.sleep(self.config.restore_attach_grace_s if grace_s is None else grace_s)
        record = self.table.find(key)
        if record is not None and self.table.subscriber_count(key) == 0:
            log.warning(f"{what}_worker_never_attached", worker=str(key), generation=generation)
            await self.worker_gone(key)

    async def _expect_restored_attach(self, key: WorkerKey, generation: int) -> None:
        try:
            await self._expect_attach(key, generation)
        finally:
            self._restored_unattached.discard(key)

    async def _expect_first_attach(self, key: WorkerKey, generation: int) -> None:
        try:
            await self._expect_attach(key, generation, self.config.attach_grace_s, "registered")
        finally:
            self._unattached.discard(key)

    def _spawn(self, coro: Coroutine[Any, Any, object]) -> None:
        task: asyncio.Task[object] = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _on_notifs(self, notifs: dict[str, list[bytes]]) -> None:
        """NIXL notifications from pullers/pushers: the transfer is complete."""
        for peer, messages in notifs.items():
            for message in messages:
                token = token_of(message)
                lease = self.leases.finish_from(token, peer) if token else None
                if lease is None:
                    self._unmatched_notif(peer, message, token)
                    continue
                # Its use is stored with the event (``_tell_finished``).
                used = self.grants.complete(lease.grant, persist=False)
                self.counters.served_done += 1
                self.counters.served_blocks += lease.blocks
                direction = (
                    registry_pb2.TRANSFER_DIRECTION_PUSHED_TO
                    if lease.write
                    else registry_pb2.TRANSFER_DIRECTION_PULLED_FROM
                )
                done = registry_pb2.TransferFinishedEvent(
                    request_id=lease.request_id, direction=direction, peer_agent=peer
                )
                self._tell_finished(lease.record.key, done, used, store_use=True)

    def _tell_finished(
        self,
        key: WorkerKey,
        done: registry_pb2.TransferFinishedEvent,
        used: Grant | None,
        store_use: bool = False,
    ) -> None:
        """Send the worker a finished transfer (or released use), with its
        grant's count, so its blocks are freed once no use is left. Persisted
        until an Attach stream has sent it: a restart between the
        notification and the worker loses nothing. With ``store_use`` the
        grant's use (``used``, which ``GrantTable.complete`` left unstored)
        is stored with the event."""
        if used is not None:
            done.uses, done.max_uses, done.exhausted = used.uses, used.max_uses, used.exhausted
        event = registry_pb2.AttachResponse(transfer_finished=done)
        if store_use:
            event_id = self._persist_use_and_event(key, event, used)
        else:
            event_id = self._persist_event(key, event)
        self.table.publish(key, event, event_id)

    def _persist_use_and_event(
        self, key: WorkerKey, event: registry_pb2.AttachResponse, used: Grant | None
    ) -> int:
        """A completed transfer's grant use and its event, in one transaction
        (one sync of the store per completion, not two). A store that cannot
        take it gets each written on its own, as before: whatever it can
        keep is kept, and each refusal is logged as it always was."""
        try:
            return self.store.record_use(used, key, event)
        except StateStoreError:
            if used is not None:
                self.grants.persist_use(used)
            return self._persist_event(key, event)

    def _persist_event(self, key: WorkerKey, event: registry_pb2.AttachResponse) -> int:
        """The event's id in the store; 0 (sent live only) when the store
        cannot take it: the progress loop must go on whatever the disk does."""
        try:
            return self.store.add_event(key, event)
        except StateStoreError as err:
            log.error("event_not_stored", worker=str(key), error=str(err))
            return 0

    def _unmatched_notif(self, peer: str, message: bytes, token: str | None) -> None:
        holder = self.leases.holder(token) if token else None
        if holder is not None:
            # A live lease's token from an agent that does not hold it: a
            # forged (or misrouted) "done"; the lease and its blocks stay.
            log.warning("notif_from_other_agent", peer=peer, holder=holder)
        else:
            log.info("notif_unmatched", peer=peer, message=message[:64])

    # Capabilities and leases (the owner's side of a transfer) ---------------

    def grant_transfer(
        self,
        key: WorkerKey,
        *,
        request_id: str,
        groups: Sequence[tuple[int, Sequence[int]]],
        ttl_ms: int,
        max_uses: int,
        open_uses: bool = False,
    ) -> tuple[str, Grant]:
        """Registry.GrantTransfer: a capability for one request's blocks of an
        attached worker (its transfer_finished event must reach someone)."""
        if self.draining:
            raise Unavailable(SHUTTING_DOWN)
        record = self.table.get(key)
        if self.table.subscriber_count(key) == 0 and key not in self._restored_unattached:
            # (A restored worker's client is re-attaching after the restart:
            # the finished event waits in the store for its Attach.)
            raise FailedPrecondition(f"worker {key} has no Attach stream open")
        return self.grants.grant(
            record,
            request_id=request_id,
            groups=groups,
            ttl_ms=ttl_ms,
            max_uses=max_uses,
            open_uses=open_uses,
        )

    def revoke_transfer(self, key: WorkerKey, request_id: str) -> None:
        """Registry.RevokeTransfer: idempotent for a known worker."""
        self.table.get(key)
        self.grants.revoke(key, request_id)

    def begin_transfer(self, req: peer_pb2.BeginTransferRequest) -> Lease:
        """Peer.BeginTransfer: every check (arguments, capability, agent,
        worker, generation, limits) before the lease and the grant's claim."""
        if req.blocks < 0 or req.bytes < 0:
            # Arguments first: they are wrong whatever the daemon's state.
            raise InvalidArgument("blocks" if req.blocks < 0 else "bytes", "must not be negative")
        if not req.peer_agent:
            # The claim and the completion notification are bound to it.
            raise InvalidArgument("peer_agent", "must not be empty")
        replaces = grants_core.check_replaced_agents(req.replaces_agents, req.peer_agent)
        grants_core.check_readers(req.readers)
        if req.release:
            raise InvalidArgument("release", "a release is answered by release_grant")
        if self.draining:
            raise Unavailable(SHUTTING_DOWN)
        # No capability, no answer about workers or agents.
        self.grants.find(req.capability)
        if req.agent_name and req.agent_name != self.agent_name:
            raise HandshakeAgain(
                f"transfer planned against agent {req.agent_name}; this daemon runs "
                f"{self.agent_name} (it restarted): handshake again"
            )
        record = self.worker_for_peer(convert.requested_worker(req.worker, "worker"))
        grant = self.grants.admit(
            req.capability,
            record=record,
            request_id=req.request_id,
            groups=[(g.transfer_group, g.block_ids) for g in req.groups],
            peer_agent=req.peer_agent,
            replaces=replaces,
            readers=req.readers,
        )
        lease = self.leases.begin(
            record,
            generation=req.generation,
            request_id=req.request_id,
            peer_agent=req.peer_agent,
            write=req.write,
            blocks=req.blocks,
            nbytes=req.bytes,
            lease_s=(req.lease_ms / 1000) if req.lease_ms else DEFAULT_LEASE_S,
            grant=grant.digest,
        )
        self._take_over(grant.digest, replaces)
        self.grants.claim(grant, req.peer_agent)
        if self._progress is not None:
            self._progress.wake()  # the peer posts as soon as we answer
        return lease

    def release_grant(self, req: peer_pb2.BeginTransferRequest) -> Grant:
        """Peer.BeginTransfer with ``release``: a reader that needs none of
        the blocks gives up its use. Every check (arguments, capability,
        worker, request, claim, expiry, declared count) before one use is
        spent and the worker told; no lease, no pin."""
        if req.groups:
            raise InvalidArgument("groups", "a release names no blocks")
        if not req.peer_agent:
            raise InvalidArgument("peer_agent", "must not be empty")
        grants_core.check_readers(req.readers)
        if self.draining:
            raise Unavailable(SHUTTING_DOWN)
        self.grants.find(req.capability)  # no capability, no answer about workers
        record = self.worker_for_peer(convert.requested_worker(req.worker, "worker"))
        used = self.grants.release_use(
            req.capability,
            record=record,
            request_id=req.request_id,
            readers=req.readers,
            peer_agent=req.peer_agent,
        )
        log.info(
            "transfer_use_released",
            request_id=req.request_id,
            peer=req.peer_agent,
            uses=used.uses,
            max_uses=used.max_uses,
        )
        done = registry_pb2.TransferFinishedEvent(
            request_id=req.request_id,
            direction=registry_pb2.TRANSFER_DIRECTION_PULLED_FROM,
            peer_agent=req.peer_agent,
            released=True,
        )
        self._tell_finished(record.key, done, used)
        return used

    def _take_over(self, digest: bytes, replaces: frozenset[str]) -> None:
        """End the leases of a replaced agent under this grant (after the new
        lease pinned the worker, so the pin never lapses): each releases its
        claim and unpins once, here, and the dead agent's late EndTransfer or
        notification finds no lease."""
        holder = self.grants.claimed_by(digest)
        if holder not in replaces:
            return
        for old in self.leases.held_by(holder, digest):
            self.leases.finish(old.token)
            self.grants.release(digest)
            log.warning("claim_taken_over", request_id=old.request_id, old_agent=holder)

    def end_lease(self, token: str) -> Lease | None:
        """A peer gave up on a transfer (EndTransfer): the pin goes, and the
        capability may be tried again."""
        lease = self.leases.finish(token)
        if lease is not None:
            self.grants.release(lease.grant)
        return lease

    def expire_leases(self, now: float | None = None) -> list[Lease]:
        """End leases that ran out (their capabilities may be tried again)
        and forget long-expired grants."""
        gone = self.leases.expire(now)
        self.metrics.leases_expired.inc(len(gone))
        for lease in gone:
            self.grants.release(lease.grant)
            log.warning("lease_expired", request_id=lease.request_id, peer=lease.peer_agent)
        self.grants.sweep()
        return gone

    async def _expire_leases(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            self.expire_leases()

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
            # Kept in the store: the daemon that replaces this one restores it.
            await self.registrar.release_kept(record.key)
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
        returning = self._returning.pop(record.key, None)
        if returning is not None and self._same_memory(returning.stored, record.key):
            # The client of a worker the daemon could not reopen after a
            # restart registered the very memory it had: its blocks still
            # hold what was granted, and its undelivered events still apply.
            self.grants.rebind(record.key, record.generation)
            self._requeue(record.key, returning.events)
            log.info(
                "worker_returned",
                worker=str(record.key),
                generation=record.generation,
                events=len(returning.events),
            )
        else:
            # New (or replaced) memory: block ids granted before may now hold
            # other requests' KV.
            self.grants.drop_worker(record.key)
        self._restored_unattached.discard(record.key)
        self._awaiting.pop(record.key, None)
        if self.table.subscriber_count(record.key) == 0 and record.key not in self._unattached:
            # Released after attach_grace_s unless its worker attaches; one
            # timer per worker however often it registers meanwhile.
            self._unattached.add(record.key)
            self._spawn(self._expect_first_attach(record.key, record.generation))
        self.update_gauges()
        self.publish_map_changed(record)

    def _same_memory(self, before: StoredWorker, key: WorkerKey) -> bool:
        """Whether ``key``'s registration just stored is over the same memory
        objects (same identity: process, device and inode, path or CUDA
        handle), at the same offsets, with the same geometry as ``before``."""
        try:
            now = self.store.worker(key)
        except StateStoreError as err:
            # Unsure, so the safe answer: the grants go.
            log.error("worker_identity_unread", worker=str(key), error=str(err))
            return False
        if now is None or now.reopen != before.reopen:
            return False
        try:
            same = convert.parse_and_validate(now.request) == convert.parse_and_validate(
                before.request
            )
        except KvmapError:
            return False
        return same and _handle_offsets(now) == _handle_offsets(before)

    def _requeue(self, key: WorkerKey, events: Sequence[registry_pb2.AttachResponse]) -> None:
        """Store again the events a returning worker had not been sent (its
        Attach sends them); one the store cannot take is logged and lost, as
        a live event would be."""
        for event in events:
            self._persist_event(key, event)

    async def worker_gone(self, key: WorkerKey) -> None:
        """The worker's Attach stream ended: release everything it had."""
        log.info("worker_gone", worker=str(key))
        try:
            # Released even when the store cannot record it: its client is gone.
            await self.registrar.deregister(key, forget_unsaved=True)
        except NotFound:
            return  # deregistered meanwhile
        self.grants.drop_worker(key)
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
            self.grants.rebind(record.key, record.generation)
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


@dataclass(frozen=True)
class _Returning:
    """A stored worker the restarted daemon could not reopen, and the events
    it had not been sent."""

    stored: StoredWorker
    events: list[registry_pb2.AttachResponse]


def _handle_offsets(w: StoredWorker) -> list[tuple[str, int]]:
    """Where each allocation starts in its memory object."""
    out = []
    for alloc in w.request.allocations:
        which = alloc.WhichOneof("handle")
        handle = getattr(alloc, which) if which in ("shm_fd", "shm_path") else None
        out.append((alloc.id, handle.offset_bytes if handle is not None else 0))
    return out
