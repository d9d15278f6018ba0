"""Pull and push: handshake with the remote daemon (cached per target,
worker and generation), plan descriptors from the common refinement of both
region maps, announce the transfer to the owner, post it, wait for NIXL to
complete it and notify the owner.

The only state here is caches: handshakes (and the remote agents they
loaded) per target and worker, and prepared descriptor lists per (local
generation, remote generation, layer selection). Each is an LRU of a stated
size, and a request's limits are checked, and its transfer planned, before
anything is cached for it. A changed remote agent or generation drops what
was prepared against it before anything new is posted.

Handshakes are single-flight per (target, worker) and never hold a lock
while they wait for the network: a slow or silent peer delays only the
pulls to that peer, and at most ``MAX_HANDSHAKES_IN_FLIGHT`` wait at once.

A transfer whose attempt fails because the owner's daemon or worker is
restarting (``core.retry.retryable``: UNAVAILABLE, HANDSHAKE_AGAIN) is tried
again from a fresh handshake, after a backoff (``Pacing``), for as long as
its deadline allows; then it fails with the last error. A stale generation
is first re-handshaken at once, without waiting: the owner is up.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import structlog

from kvmap.core.compat import check_compatible
from kvmap.core.config import DaemonConfig
from kvmap.core.convert import requested_worker, worker_id_to_proto
from kvmap.core.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KvmapError,
    PermissionDenied,
    RequestedGenerationGone,
    StaleGeneration,
    TransferError,
    Unavailable,
    status_of,
)
from kvmap.core.geometry import DeviceKind, RegionMapModel, WorkerKey
from kvmap.core.grants import check_readers
from kvmap.core.retry import RetryPolicy, retryable
from kvmap.core.token_plan import TokenGroup, plan_token_transfer, token_groups
from kvmap.core.transfer_pieces import LayerSelection, PieceTable, Side, build_piece_table
from kvmap.core.transfer_plan import (
    GroupPairs,
    TransferPlan,
    block_ids,
    check_group_count,
    check_sizes,
    piece_dlist_rows,
    plan_transfer,
    run_dlist_rows,
)
from kvmap.daemon.adapters.metrics import Metrics
from kvmap.daemon.adapters.nixl_port import (
    DlistHandle,
    MemoryType,
    NixlPort,
    Xfer,
    XferOp,
    XferState,
)
from kvmap.daemon.adapters.nixl_thread import NixlRunner
from kvmap.daemon.adapters.peer_client import MAX_CHANNELS, PeerHandshake
from kvmap.daemon.engine.bounded import Lru, SingleFlight
from kvmap.daemon.engine.leases import notification
from kvmap.daemon.engine.progress import Progress
from kvmap.daemon.engine.remote_agents import RemoteAgents
from kvmap.daemon.engine.workers import WorkerRecord, WorkerTable
from kvmap.v1 import admin_pb2, peer_pb2, transfers_pb2

log = structlog.get_logger("kvmapd.transfers")

# Handshakes waiting for a remote daemon at once. Each holds a peer channel;
# staying under the client's channel limit means a new handshake never
# closes the channel of one in flight, and leaves channels for healthy peers
# while dead targets time out (connect_timeout_s).
MAX_HANDSHAKES_IN_FLIGHT = MAX_CHANNELS // 2
# (target, worker) handshakes kept; a target none of them names is detached,
# so this bounds the loaded remote agents too.
MAX_CACHED_HANDSHAKES = 1024
# Prepared (piece table, local and remote lists) entries kept: a few per
# (local worker, remote worker) pair and layer selection in use.
MAX_PREPARED = 256
# BeginTransferRequest.lease_ms is a uint32.
MAX_LEASE_MS = 2**32 - 1
# (local generation, remote generation) pairs found compatible (core.compat).
MAX_COMPATIBLE = 1024


class Peers(Protocol):
    """The calls made to remote daemons' Peer service (``peer_client.PeerClient``)."""

    async def handshake(self, target: str, worker: WorkerKey) -> PeerHandshake: ...
    async def begin(self, target: str, req: peer_pb2.BeginTransferRequest) -> str: ...
    async def end(self, target: str, token: str, completed: bool) -> None: ...
    async def close(self) -> None: ...


@dataclass(frozen=True)
class Pacing:
    """The backoff between a transfer's attempts: its policy, and the clock,
    sleep and random draws it runs on (an engine test hands in a virtual
    clock whose sleep only moves it, so deadlines are exact and instant)."""

    policy: RetryPolicy = field(default_factory=RetryPolicy)
    now: Callable[[], float] = time.monotonic
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    draw: Callable[[], float] = random.random


def side_memory(model: RegionMapModel, who: str) -> tuple[int, MemoryType]:
    """The one (device ordinal, memory type) a worker's allocations share, as
    its owning daemon registered them."""
    kinds = {(a.device.index, a.device.kind) for a in model.allocations}
    if len(kinds) != 1:
        raise FailedPrecondition(
            f"{who} {model.worker}: allocations on several devices {sorted(kinds)}; "
            "one transfer needs one device per side"
        )
    ((index, kind),) = kinds
    return index, MemoryType.VRAM if kind is DeviceKind.CUDA else MemoryType.DRAM


@dataclass
class Prepared:
    """Piece table and NIXL lists for one (local gen, remote gen, selection);
    none of the three for a token-mode transfer (explicit descriptors only)."""

    table: PieceTable | None
    local_dlist: DlistHandle | None
    remote_dlist: DlistHandle | None
    # (NIXL dev_id, memory type) of each side.
    local_mem: tuple[int, MemoryType]
    remote_mem: tuple[int, MemoryType]
    # Transfers between planning and posting with these lists; a stale entry
    # is released by the last of them.
    users: int = 0
    stale: bool = False


@dataclass(frozen=True)
class Request:
    """A validated wire TransferSpec."""

    request_id: str
    local: WorkerKey
    target: str
    remote: WorkerKey
    selections: tuple[LayerSelection, ...]
    pairs: tuple[GroupPairs, ...]
    expected_generation: int
    timeout_s: float
    # The owner's grant for this request (kv_transfer_params "kvmap_capability").
    capability: str
    # Token-mode groups (wire num_tokens > 0; core.token_plan), else empty.
    tokens: tuple[TokenGroup, ...] = ()
    # Transfers in all reading the owner's grant (0: not declared), and
    # whether this one only gives up its use (spec.release).
    readers: int = 0
    release: bool = False
    # The wire groups, whose remote block ids the owner is told
    # (``_announcement`` copies them in C; ``pairs`` holds them as arrays).
    # Messages are unhashable: left out of the request's hash, as derived.
    wire_groups: tuple[transfers_pb2.GroupBlocks, ...] = field(default=(), compare=False)

    @classmethod
    def parse(cls, spec: transfers_pb2.TransferSpec, default_timeout_s: float) -> Request:
        if not spec.request_id:
            raise InvalidArgument("spec.request_id", "must not be empty")
        if not spec.remote_target or ":" not in spec.remote_target:
            raise InvalidArgument("spec.remote_target", "expected HOST:PORT")
        readers = check_readers(spec.readers, "spec.readers")
        if spec.release:
            return cls._release(spec, readers, default_timeout_s)
        if not spec.groups:
            raise InvalidArgument("spec.groups", "at least one transfer group is required")
        check_group_count(len(spec.groups))
        groups = tuple(spec.groups)
        tokens = token_groups(spec)
        if not tokens:
            # On the wire fields' lengths: refused before any id is copied.
            check_sizes([_wire_pairs(g) for g in groups])
        if not spec.capability:
            # Refused here, before any peer is dialled: a pull built from
            # params without a capability is never anyone's legitimate pull.
            raise PermissionDenied("spec.capability: a transfer needs the owner's capability")
        pairs = tuple(_array_pairs(g) for g in groups)
        return cls(
            request_id=spec.request_id[:256],
            local=requested_worker(spec.local_worker, "spec.local_worker"),
            target=spec.remote_target,
            remote=requested_worker(spec.remote_worker, "spec.remote_worker"),
            selections=tuple(
                LayerSelection(g.transfer_group, tuple(g.layer_names)) for g in spec.groups
            ),
            pairs=pairs,
            expected_generation=spec.remote_generation,
            timeout_s=spec.timeout_ms / 1000 if spec.timeout_ms else default_timeout_s,
            capability=spec.capability,
            tokens=tokens,
            readers=readers,
            wire_groups=groups,
        )

    @classmethod
    def _release(
        cls, spec: transfers_pb2.TransferSpec, readers: int, default_timeout_s: float
    ) -> Request:
        """A release: no blocks, only whose grant (a capability) it gives up."""
        if spec.groups:
            raise InvalidArgument("spec.groups", "a release names no blocks")
        if not spec.capability:
            raise PermissionDenied("spec.capability: a release needs the owner's capability")
        return cls(
            request_id=spec.request_id[:256],
            local=requested_worker(spec.local_worker, "spec.local_worker"),
            target=spec.remote_target,
            remote=requested_worker(spec.remote_worker, "spec.remote_worker"),
            selections=(),
            pairs=(),
            expected_generation=spec.remote_generation,
            timeout_s=spec.timeout_ms / 1000 if spec.timeout_ms else default_timeout_s,
            capability=spec.capability,
            readers=readers,
            release=True,
        )


def _wire_pairs(g: transfers_pb2.GroupBlocks) -> GroupPairs:
    """A wire group's block ids as the message holds them (for their lengths)."""
    return GroupPairs(g.transfer_group, g.local_block_ids, g.remote_block_ids)


def _array_pairs(g: transfers_pb2.GroupBlocks) -> GroupPairs:
    """A wire group's block ids as int64 arrays, as planning takes them."""
    return GroupPairs(g.transfer_group, block_ids(g.local_block_ids), block_ids(g.remote_block_ids))


def _code_name(err: BaseException) -> str:
    """The status code a failed transfer's caller sees, as a metric label."""
    if isinstance(err, asyncio.CancelledError):
        return "CANCELLED"
    return status_of(err)[0].name


def status(state: int, message: str = "", **stats: Any) -> transfers_pb2.TransferStatus:
    return transfers_pb2.TransferStatus(
        state=state,  # type: ignore[arg-type]
        message=message,
        stats=transfers_pb2.TransferStats(**stats),
    )


class TransferEngine:
    def __init__(
        self,
        *,
        config: DaemonConfig,
        table: WorkerTable,
        agent: NixlPort,
        agent_name: str,
        nixl: NixlRunner,
        progress: Progress,
        peers: Peers,
        metrics: Metrics,
        counters: admin_pb2.TransferCounters,
        pacing: Pacing | None = None,
        replaces_agents: tuple[str, ...] = (),
    ) -> None:
        self._config = config
        # This daemon's agents before its restart (BeginTransferRequest.
        # replaces_agents): their claims at owners are taken over.
        self._replaces_agents = replaces_agents
        self._pacing = pacing or Pacing()
        self._table = table
        self._agent = agent
        self._agent_name = agent_name
        self._nixl = nixl
        self._progress = progress
        self._metrics = metrics
        self._counters = counters
        self.peers = peers
        self._agents = RemoteAgents(agent, nixl, self._agent_changed)
        self._handshakes: Lru[tuple[str, WorkerKey], PeerHandshake] = Lru(MAX_CACHED_HANDSHAKES)
        self._handshaking: SingleFlight[tuple[str, WorkerKey], PeerHandshake] = SingleFlight(
            MAX_HANDSHAKES_IN_FLIGHT, "handshakes with remote daemons"
        )
        self._prepared: Lru[tuple[Any, ...], Prepared] = Lru(MAX_PREPARED)
        # Only successes are kept: a refused pair changes no cache, and is
        # compared again (cheaply) on its next request.
        self._compatible: Lru[tuple[Any, ...], bool] = Lru(MAX_COMPATIBLE)
        # Cache mutations (a handshake's result, prepare); never held while
        # waiting for a remote daemon.
        self._lock = asyncio.Lock()
        self._learning: set[asyncio.Future[PeerHandshake]] = set()
        self.in_flight = 0

    @property
    def remote_agent_count(self) -> int:
        return len(self._agents)

    def cache_sizes(self) -> dict[str, int]:
        """Entries of each cache (what a rejected request must not change)."""
        return {
            "handshakes": len(self._handshakes),
            "handshakes_in_flight": len(self._handshaking),
            "prepared": len(self._prepared),
            "remote_agents": len(self._agents),
        }

    # Caches ---------------------------------------------------------------

    async def _release(self, keys: list[tuple[Any, ...]]) -> None:
        """Forget cache entries; free their lists now or when the last
        transfer using them has posted."""
        for key in keys:
            p = self._prepared.pop(key)
            if p is not None:
                await self._retire(p)

    async def _retire(self, p: Prepared) -> None:
        p.stale = True
        if p.users == 0:
            await self._free(p)

    async def _free(self, p: Prepared) -> None:
        for dlist in (p.local_dlist, p.remote_dlist):
            if dlist is not None:
                await self._nixl(partial(self._agent.release_dlist, dlist))

    async def forget_local(self, key: WorkerKey, generation: int) -> None:
        """A local record was retired: drop lists prepared over its memory."""
        async with self._lock:
            await self._release([k for k in self._prepared if k[0] == key and k[1] == generation])

    async def _handshake(self, target: str, remote: WorkerKey) -> PeerHandshake:
        """Ask the remote daemon (no lock held: other targets go on), then
        apply its answer to the caches, shielded: a handshake whose callers
        all gave up is cancelled while it waits, never halfway through."""
        hs = await self.peers.handshake(target, remote)
        learn = asyncio.ensure_future(self._learn(target, remote, hs))
        self._learning.add(learn)  # a shielded task must stay referenced
        learn.add_done_callback(self._learning.discard)
        return await asyncio.shield(learn)

    async def _learn(self, target: str, remote: WorkerKey, hs: PeerHandshake) -> PeerHandshake:
        async with self._lock:
            if self._agents.agent_of(target) not in (None, hs.agent_name):
                # The remote daemon restarted: every list prepared against
                # its old agent goes before anything new is posted.
                await self._release([k for k in self._prepared if k[2] == target])
                for key in [k for k in self._handshakes if k[0] == target]:
                    self._handshakes.pop(key)
            await self._agents.load(target, hs.agent_name, hs.daemon_instance, hs.agent_metadata)
            old = self._handshakes.peek((target, remote))
            if old is not None and old.generation != hs.generation:
                await self._release(
                    [k for k in self._prepared if k[2] == target and k[3] == remote]
                )
            for (gone, _), _hs in self._handshakes.put((target, remote), hs):
                if not any(k[0] == gone for k in self._handshakes):
                    await self._agents.detach(gone)  # its lists go with its agent
            self._metrics.remote_agents.set(len(self._agents))
        return hs

    async def _agent_changed(self, name: str) -> None:
        """Lists prepared against a reloaded or removed remote agent go."""
        await self._release([k for k in self._prepared if k[5] == name])

    async def _remote(self, req: Request, refresh: bool) -> tuple[PeerHandshake, bool]:
        """The cached handshake, or one shared with every concurrent pull to
        the same target and worker."""
        key = (req.target, req.remote)
        hs = self._handshakes.get(key)
        if (
            hs is None
            or refresh
            or (req.expected_generation and req.expected_generation != hs.generation)
        ):
            hs = await self._handshaking.run(key, partial(self._handshake, *key))
            return hs, True
        return hs, False

    async def _prepare(
        self, local: WorkerRecord, hs: PeerHandshake, req: Request, write: bool
    ) -> Prepared:
        key = (*_pair_key(local, hs, req), req.selections)
        async with self._lock:
            found = self._prepared.get(key)
            if found is not None:
                found.users += 1
                return found
            self._check_compatible(local, hs, req)
            table = build_piece_table(local.model, hs.model, req.selections)
            local_mem = side_memory(local.model, "local worker")
            remote_mem = side_memory(hs.model, "remote worker")
            # Every check of the request against the table, before anything
            # is prepared or cached for it: a rejected request leaves the
            # caches as they were (the caller plans again, from the cache).
            plan_transfer(table, req.pairs, destination=Side.REMOTE if write else Side.LOCAL)
            local_rows = piece_dlist_rows(table, Side.LOCAL, local_mem[0])
            remote_rows = piece_dlist_rows(table, Side.REMOTE, remote_mem[0])
            local_dl = await self._nixl(partial(self._agent.prep_local, local_rows, local_mem[1]))
            remote_dl = await self._nixl(
                partial(self._agent.prep_remote, hs.agent_name, remote_rows, remote_mem[1])
            )
            prepared = Prepared(table, local_dl, remote_dl, local_mem, remote_mem, users=1)
            for _, evicted in self._prepared.put(key, prepared):
                await self._retire(evicted)
            return prepared

    def _check_compatible(self, local: WorkerRecord, hs: PeerHandshake, req: Request) -> None:
        """Both workers' KV caches mean the same thing (once per generations)."""
        pair = _pair_key(local, hs, req)
        if self._compatible.get(pair) is None:
            check_compatible(local.model, hs.model)
            self._compatible.put(pair, True)

    async def _done_with(self, p: Prepared) -> None:
        p.users -= 1
        if p.stale and p.users == 0:
            await self._free(p)

    # Transfers --------------------------------------------------------------

    async def run(
        self, spec: transfers_pb2.TransferSpec, write: bool
    ) -> AsyncIterator[transfers_pb2.TransferStatus]:
        req = Request.parse(spec, self._config.transfer_timeout_s)
        direction = "push" if write else "pull"
        record = self._table.get(req.local)
        record.pin()
        self.in_flight += 1
        started = time.perf_counter()
        try:
            deadline = self._pacing.now() + req.timeout_s
            async with asyncio.timeout(req.timeout_s):
                async for item in self._retried(req, record, write, deadline):
                    yield item
            self._metrics.labelled(self._metrics.transfers, direction, "done").inc()
            self._metrics.transfer_ended(direction, req.target, "OK", time.perf_counter() - started)
            if write:
                self._counters.pushes_done += 1
            else:
                self._counters.pulls_done += 1
        except TimeoutError:
            self._metrics.labelled(self._metrics.transfers, direction, "deadline").inc()
            self._metrics.transfer_ended(direction, req.target, "DEADLINE_EXCEEDED")
            self._counters.failed += 1
            raise DeadlineExceeded(
                f"transfer {req.request_id}: no completion in {req.timeout_s}s"
            ) from None
        except BaseException as err:
            self._metrics.labelled(self._metrics.transfers, direction, type(err).__name__).inc()
            self._metrics.transfer_ended(direction, req.target, _code_name(err))
            self._counters.failed += 1
            raise
        finally:
            self.in_flight -= 1
            record.unpin()

    async def _retried(
        self, req: Request, record: WorkerRecord, write: bool, deadline: float
    ) -> AsyncIterator[transfers_pb2.TransferStatus]:
        """Attempts of one transfer until one succeeds, one fails for good, or
        the time left cannot hold the next pause (then the last error)."""
        pacing = self._pacing
        handshaked = False
        for attempt in itertools.count():
            try:
                async for item in self._run(req, record, write, attempt > 0, handshaked):
                    handshaked |= item.state == transfers_pb2.TRANSFER_STATE_HANDSHAKING
                    yield item
                return
            except KvmapError as err:
                pause = (
                    pacing.policy.next_delay(attempt, pacing.draw(), deadline - pacing.now())
                    if retryable(err)
                    else None
                )
                if pause is None:
                    raise
                self._metrics.transfer_retries.labels(
                    "push" if write else "pull", err.code.name
                ).inc()
                log.info(
                    "transfer_retry",
                    request_id=req.request_id,
                    target=req.target,
                    worker=str(req.remote),
                    attempt=attempt + 1,
                    pause_s=round(pause, 3),
                    error=str(err),
                )
            await pacing.sleep(pause)

    async def _run(
        self, req: Request, record: WorkerRecord, write: bool, renew: bool, handshaked: bool
    ) -> AsyncIterator[transfers_pb2.TransferStatus]:
        """One attempt; ``renew`` asks the owner for a fresh handshake (a
        failed attempt may have met its restart)."""
        if req.release:
            yield await self._release_use(req)
            return
        for attempt in (0, 1):
            hs, fresh = await self._remote(req, refresh=renew or attempt > 0)
            handshaked |= fresh
            if fresh:
                yield status(
                    transfers_pb2.TRANSFER_STATE_HANDSHAKING,
                    f"handshake with {req.target}",
                    remote_generation=hs.generation,
                )
            begun = await self._begin(req, record, hs, write, retry=attempt == 0)
            if begun is not None:
                break
        else:  # pragma: no cover - the loop always breaks or raises
            raise Unavailable("transfer could not be planned")
        prepared, plan, token = begun
        post_s, done_s = await self._carry_out(req, hs, prepared, plan, token=token, write=write)
        self._account(plan, post_s, done_s)
        self._metrics.transfer_moved(
            "push" if write else "pull", req.target, plan.bytes, plan.descriptors
        )
        yield status(
            transfers_pb2.TRANSFER_STATE_DONE,
            "done",
            descriptors=plan.descriptors,
            bytes=plan.bytes,
            post_seconds=post_s,
            completion_seconds=done_s,
            remote_generation=hs.generation,
            handshaked=handshaked,
        )

    async def _begin(
        self, req: Request, record: WorkerRecord, hs: PeerHandshake, write: bool, *, retry: bool
    ) -> tuple[Prepared, TransferPlan, str] | None:
        """Plan the transfer and announce it to the owner: the lists, the
        plan and the owner's lease token; None when the owner reports a stale
        generation and ``retry`` allows one more handshake."""
        if req.expected_generation and req.expected_generation != hs.generation:
            raise RequestedGenerationGone(str(req.remote), req.expected_generation, hs.generation)
        if req.tokens:
            prepared, plan = await self._plan_tokens(record, hs, req, write)
        else:
            prepared = await self._prepare(record, hs, req, write)
        try:
            if prepared.table is not None:
                plan = plan_transfer(
                    prepared.table, req.pairs, destination=Side.REMOTE if write else Side.LOCAL
                )
            token = await self.peers.begin(req.target, self._announcement(req, hs, plan, write))
        except BaseException as err:
            await self._done_with(prepared)
            if not isinstance(err, StaleGeneration) or not retry:
                raise
            log.info("stale_remote_generation", target=req.target, worker=str(req.remote))
            return None  # re-handshake once, then plan again
        return prepared, plan, token

    async def _plan_tokens(
        self, local: WorkerRecord, hs: PeerHandshake, req: Request, write: bool
    ) -> tuple[Prepared, TransferPlan]:
        """A token-mode plan: explicit descriptors, nothing prepared or cached
        (they depend on the request's block ids and token count)."""
        async with self._lock:
            self._check_compatible(local, hs, req)
        plan = plan_token_transfer(
            local.model,
            hs.model,
            req.tokens,
            destination=Side.REMOTE if write else Side.LOCAL,
        )
        local_mem = side_memory(local.model, "local worker")
        remote_mem = side_memory(hs.model, "remote worker")
        return Prepared(None, None, None, local_mem, remote_mem, users=1), plan

    async def _release_use(self, req: Request) -> transfers_pb2.TransferStatus:
        """Tell the owner this caller gives up its use of the grant: no
        handshake, no plan, nothing moved."""
        await self.peers.begin(
            req.target,
            peer_pb2.BeginTransferRequest(
                request_id=req.request_id,
                worker=worker_id_to_proto(req.remote),
                peer_agent=self._agent_name,
                capability=req.capability,
                readers=req.readers,
                release=True,
            ),
        )
        return status(transfers_pb2.TRANSFER_STATE_DONE, "released")

    def _announcement(
        self, req: Request, hs: PeerHandshake, plan: TransferPlan, write: bool
    ) -> peer_pb2.BeginTransferRequest:
        announced = peer_pb2.BeginTransferRequest(
            request_id=req.request_id,
            worker=worker_id_to_proto(req.remote),
            generation=hs.generation,
            agent_name=hs.agent_name,
            peer_agent=self._agent_name,
            write=write,
            # A second past our deadline; the wire field is uint32 and the
            # caller picks the deadline (the owner caps leases anyway).
            lease_ms=min(int(req.timeout_s * 1000) + 1000, MAX_LEASE_MS),
            blocks=plan.blocks,
            bytes=plan.bytes,
            capability=req.capability,
            replaces_agents=self._replaces_agents,
            readers=req.readers,
        )
        # The owner's blocks this transfer touches: each must be granted.
        # Copied from the wire field to the wire field, in C: a list of
        # Python ints, or a message handed to the constructor, costs tens of
        # microseconds a group.
        for g in req.wire_groups:
            announced.groups.add(transfer_group=g.transfer_group, block_ids=g.remote_block_ids)
        return announced

    async def _carry_out(
        self,
        req: Request,
        hs: PeerHandshake,
        prepared: Prepared,
        plan: TransferPlan,
        *,
        token: str,
        write: bool,
    ) -> tuple[float, float]:
        """Post, wait, and tell the owner: by NIXL notification when done,
        by EndTransfer when not."""
        completed = False
        try:
            # The notification goes out in the same NIXL call that releases
            # the finished transfers: one thread hop per pull, not three.
            tell = partial(self._agent.send_notif, hs.agent_name, notification(token))
            post_s, done_s = await self._post_and_wait(prepared, plan, hs, write, then=tell)
            completed = True
        finally:
            await self._done_with(prepared)
            if not completed:
                await self.peers.end(req.target, token, completed=False)
        return post_s, done_s

    def _account(self, plan: TransferPlan, post_s: float, done_s: float) -> None:
        self._metrics.transfer_bytes.inc(plan.bytes)
        self._metrics.transfer_descriptors.inc(plan.descriptors)
        self._metrics.post_seconds.observe(post_s)
        self._metrics.completion_seconds.observe(done_s)
        self._counters.bytes += plan.bytes
        self._counters.descriptors += plan.descriptors
        self._counters.blocks += plan.blocks

    async def _post_and_wait(
        self,
        prepared: Prepared,
        plan: TransferPlan,
        hs: PeerHandshake,
        write: bool,
        *,
        then: Callable[[], None],
    ) -> tuple[float, float]:
        """Post the plan's transfers and wait for them; ``then`` runs on the
        NIXL thread right after they are released, only if all of them
        succeeded."""
        op = XferOp.WRITE if write else XferOp.READ

        def post() -> tuple[list[Xfer], float]:
            start = time.perf_counter()
            xfers = []
            if len(plan.local_indices):
                if prepared.local_dlist is None or prepared.remote_dlist is None:
                    # Only piece-table plans index prepared lists.
                    raise RuntimeError("a token-mode plan indexes no prepared list")
                xfers.append(
                    self._agent.post_prepped(
                        op,
                        prepared.local_dlist,
                        plan.local_indices,
                        prepared.remote_dlist,
                        plan.remote_indices,
                    )
                )
            if len(plan.runs):
                xfers.append(
                    self._agent.post_descs(
                        op,
                        run_dlist_rows(plan, Side.LOCAL, prepared.local_mem[0]),
                        run_dlist_rows(plan, Side.REMOTE, prepared.remote_mem[0]),
                        hs.agent_name,
                        mem_type=prepared.local_mem[1],
                        remote_mem_type=prepared.remote_mem[1],
                    )
                )
            return xfers, time.perf_counter() - start

        xfers, post_s = await self._nixl(post)
        start = time.perf_counter()
        try:
            states = await asyncio.gather(*(self._progress.watch(x) for x in xfers))
        except BaseException:
            await self._release_xfers(xfers, None)
            raise
        done_s = time.perf_counter() - start
        failed = [x for x, state in zip(xfers, states, strict=True) if state is not XferState.DONE]
        await self._release_xfers(xfers, None if failed else then)
        if failed:
            raise failed[0].error or TransferError("NIXL reported a failed transfer", "ERR")
        return post_s, done_s

    async def _release_xfers(self, xfers: list[Xfer], then: Callable[[], None] | None) -> None:
        """Release ``xfers`` (and run ``then``) in one NIXL call. Shielded: a
        pull cancelled meanwhile (its deadline) must not leave its handles
        behind."""
        for x in xfers:
            self._progress.forget(x)

        def release() -> None:
            for x in xfers:
                self._agent.release(x)
            if then is not None:
                then()

        await asyncio.shield(self._nixl(release))

    async def close(self) -> None:
        async with self._lock:
            await self._release(list(self._prepared))
            await self._agents.close()
        await self.peers.close()


def _pair_key(local: WorkerRecord, hs: PeerHandshake, req: Request) -> tuple[Any, ...]:
    """The two workers of a transfer as they are now (both generations and
    the peer's agent): what a compatibility verdict and a prepared list
    hold for."""
    return (local.key, local.generation, req.target, req.remote, hs.generation, hs.agent_name)
