"""Pull and push: handshake with the remote daemon (cached per target,
worker and generation), plan descriptors from the common refinement of both
region maps, announce the transfer to the owner, post it (a pull, with
``check_before_read`` off, while the owner checks the announcement), wait
for NIXL to complete it, report DONE, then release it and notify the owner.

The engine takes checked requests (``core.transfer_requests``; their wire
forms are ``core.transfer_wire``) and yields reports. Its only state is
caches (``engine.prepared``): handshakes per target and worker, and
prepared descriptor lists per (local generation, remote generation, layer
selection).

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
import secrets
import time
from collections.abc import AsyncIterator, Awaitable
from functools import partial
from typing import Protocol

import structlog

from kvmap.core.config import DaemonConfig
from kvmap.core.errors import (
    DeadlineExceeded,
    KvmapError,
    RequestedGenerationGone,
    StaleGeneration,
    Unavailable,
)
from kvmap.core.geometry import WorkerKey
from kvmap.core.push_offers import Offer
from kvmap.core.retry import retryable
from kvmap.core.token_plan import plan_token_transfer
from kvmap.core.transfer_pieces import Side
from kvmap.core.transfer_plan import TransferPlan, plan_transfer
from kvmap.core.transfer_requests import (
    Announcement,
    Phase,
    ReleaseNotice,
    TransferReport,
    TransferRequest,
    UseRelease,
)
from kvmap.daemon.adapters.metrics import Metrics
from kvmap.daemon.adapters.nixl_port import NixlPort, Xfer
from kvmap.daemon.adapters.nixl_thread import NixlRunner
from kvmap.daemon.adapters.peer_client import MAX_CHANNELS, PeerHandshake
from kvmap.daemon.engine.bounded import SingleFlight
from kvmap.daemon.engine.leases import notification
from kvmap.daemon.engine.pacing import Pacing, within
from kvmap.daemon.engine.posting import Posting
from kvmap.daemon.engine.prepared import HandshakeKey, Prepared, TransferCaches, side_memory
from kvmap.daemon.engine.progress import Progress
from kvmap.daemon.engine.stage import new_stage, say_where, stage
from kvmap.daemon.engine.stats import TransferCounters
from kvmap.daemon.engine.workers import WorkerRecord, WorkerTable
from kvmap.tracing import NULL_SPAN, OFF, Span, Tracer, code_name, current, use

log = structlog.get_logger("kvmapd.transfers")

# Handshakes waiting for a remote daemon at once. Each holds a peer channel;
# staying under the client's channel limit means a new handshake never
# closes the channel of one in flight, and leaves channels for healthy peers
# while dead targets time out (connect_timeout_s).
MAX_HANDSHAKES_IN_FLIGHT = MAX_CHANNELS // 2
# BeginTransferRequest.lease_ms is a uint32.
MAX_LEASE_MS = 2**32 - 1

# Transfer ids: a random prefix per process and a counter, unique across
# daemons and restarts without a urandom read per transfer.
_TRANSFER_ID_PREFIX = secrets.token_hex(4)
_transfer_ids = itertools.count(1)


def new_transfer_id() -> str:
    """An id for one transfer, sent to the owner (BeginTransferRequest.
    transfer_id) so that both daemons' log lines about it can be joined."""
    return f"{_TRANSFER_ID_PREFIX}{next(_transfer_ids):08x}"


class Peers(Protocol):
    """The calls made to remote daemons' Peer service (``peer_client.PeerClient``)."""

    async def handshake(self, target: str, worker: WorkerKey) -> PeerHandshake: ...
    async def begin(self, target: str, announcement: Announcement, timeout_s: float) -> str: ...
    async def release(self, target: str, notice: ReleaseNotice, timeout_s: float) -> None: ...
    async def end(self, target: str, token: str) -> None: ...
    async def offer_push(self, target: str, offer: Offer, timeout_s: float) -> int: ...
    async def close(self) -> None: ...


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
        counters: TransferCounters,
        pacing: Pacing | None = None,
        replaces_agents: tuple[str, ...] = (),
        tracer: Tracer = OFF,
    ) -> None:
        self._config = config
        self._tracer = tracer
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
        self._caches = TransferCaches(agent, nixl, metrics)
        self._posting = Posting(agent, nixl, progress)
        self._handshaking: SingleFlight[HandshakeKey, PeerHandshake] = SingleFlight(
            MAX_HANDSHAKES_IN_FLIGHT, "handshakes with remote daemons"
        )
        self._learning: set[asyncio.Future[PeerHandshake]] = set()
        # Finished transfers still releasing their handles and telling the
        # owner (after their caller heard DONE): awaited before closing.
        self._finishing: set[asyncio.Task[None]] = set()
        self.in_flight = 0

    @property
    def busy(self) -> bool:
        """Transfers in flight, or finished ones not yet released and told
        to their owner (a drain waits for both)."""
        return bool(self.in_flight or self._finishing)

    @property
    def remote_agent_count(self) -> int:
        return len(self._caches.agents)

    def peer_handshakes(self) -> list[tuple[str, WorkerKey, PeerHandshake]]:
        """The remote workers this daemon holds a handshake of now (target,
        worker, what the peer said): the operator's live view of peers."""
        cached = self._caches.handshakes
        return [(k.target, k.worker, hs) for k in cached if (hs := cached.peek(k)) is not None]

    def cache_sizes(self) -> dict[str, int]:
        """Entries of each cache (what a rejected request must not change)."""
        return {
            "handshakes": len(self._caches.handshakes),
            "handshakes_in_flight": len(self._handshaking),
            "prepared": len(self._caches),
            "remote_agents": len(self._caches.agents),
        }

    # Caches ---------------------------------------------------------------

    async def forget_local(self, key: WorkerKey, generation: int) -> None:
        """A local record was retired: drop lists prepared over its memory."""
        await self._caches.forget_local(key, generation)

    async def _handshake(self, key: HandshakeKey) -> PeerHandshake:
        """Ask the remote daemon (no lock held: other targets go on), then
        apply its answer to the caches, shielded: a handshake whose callers
        all gave up is cancelled while it waits, never halfway through."""
        # Runs in a task of its own, which inherits the first caller's span.
        with current().child("kvmap.handshake", peer=key.target, worker=str(key.worker)):
            hs = await self.peers.handshake(key.target, key.worker)
        learn = asyncio.ensure_future(self._caches.learn(key, hs))
        self._learning.add(learn)  # a shielded task must stay referenced
        learn.add_done_callback(self._learning.discard)
        return await asyncio.shield(learn)

    async def _remote(self, req: TransferRequest, refresh: bool) -> tuple[PeerHandshake, bool]:
        """The cached handshake, or one shared with every concurrent pull to
        the same target and worker."""
        key = HandshakeKey(req.target, req.remote)
        hs = self._caches.handshakes.get(key)
        if (
            hs is None
            or refresh
            or (req.expected_generation and req.expected_generation != hs.generation)
        ):
            stage().set("waiting for the owner's handshake")
            hs = await self._handshaking.run(key, partial(self._handshake, key))
            return hs, True
        return hs, False

    # Transfers --------------------------------------------------------------

    async def run(
        self,
        req: TransferRequest | UseRelease,
        write: bool,
        transfer_id: str = "",
        traceparent: str = "",
    ) -> AsyncIterator[TransferReport]:
        """A pull (a push with ``write``), or the release of a use (counted
        as a pull, as it always was), in reports. Every log line of the
        calling task from here on (the RPC's rejection too) carries the
        transfer's ids: the caller's ``transfer_id`` or a new one; its span
        (a child of the caller's ``traceparent``) is the task's current one."""
        direction = "push" if write else "pull"
        # Bound, not scoped: the RPC's own failure line comes after this
        # generator ends; the RPC interceptor clears the context.
        transfer_id = transfer_id or new_transfer_id()
        structlog.contextvars.bind_contextvars(
            request_id=req.request_id,
            transfer_id=transfer_id,
            peer=req.target,
            peer_agent="",  # known after the handshake
            worker=str(req.remote),
        )
        span = self._span(req, direction, transfer_id, traceparent)
        use(span)
        if span.trace_id():  # traced: the log lines name the trace too
            structlog.contextvars.bind_contextvars(trace_id=span.trace_id())
        record = self._table.get(req.local)
        where = new_stage()
        record.pin()
        self.in_flight += 1
        self._metrics.transfers_in_flight.inc()
        started = time.perf_counter()
        try:
            deadline = self._pacing.now() + req.timeout_s
            attempts = self._retried(req, record, write, deadline, transfer_id)
            async for item in within(req.timeout_s, attempts):
                yield item
            self._succeeded(direction, req.target, time.perf_counter() - started)
        except TimeoutError:
            late = DeadlineExceeded(
                f"transfer {req.request_id} with {req.target}:"
                f" no completion in {req.timeout_s}s, {where.now}"
            )
            self._failed(direction, req.target, late, span)
            raise late from None
        except BaseException as err:
            say_where(err, where.now)
            self._failed(direction, req.target, err, span)
            raise
        finally:
            span.end()
            use(NULL_SPAN)
            self.in_flight -= 1
            self._metrics.transfers_in_flight.dec()
            record.unpin()

    def _succeeded(self, direction: str, target: str, seconds: float) -> None:
        self._metrics.labelled(self._metrics.transfers, direction, "OK").inc()
        self._metrics.transfer_ended(direction, target, "OK", seconds)
        # Debug: one line per transfer would cost the hot path at info.
        log.debug("transfer_done", direction=direction, seconds=round(seconds, 6))
        if direction == "push":
            self._counters.pushes_done += 1
        else:
            self._counters.pulls_done += 1

    def _failed(self, direction: str, target: str, err: BaseException, span: Span) -> None:
        """Count a failed transfer, under the code its caller gets."""
        code = code_name(err)
        span.fail(code, str(err))
        self._metrics.labelled(self._metrics.transfers, direction, code).inc()
        self._metrics.transfer_ended(direction, target, code)
        self._counters.failed += 1

    def _span(
        self, req: TransferRequest | UseRelease, direction: str, transfer_id: str, parent: str
    ) -> Span:
        """The transfer's span (``NULL_SPAN``, at the cost of this branch,
        when tracing is off)."""
        if not self._tracer.enabled:
            return NULL_SPAN
        return self._tracer.start(
            "kvmap.release" if isinstance(req, UseRelease) else f"kvmap.{direction}",
            parent=parent,
            server=True,
            attributes={
                "request_id": req.request_id,
                "transfer_id": transfer_id,
                "peer": req.target,
                "worker": str(req.remote),
                "local_worker": str(req.local),
            },
        )

    async def _retried(
        self,
        req: TransferRequest | UseRelease,
        record: WorkerRecord,
        write: bool,
        deadline: float,
        transfer_id: str,
    ) -> AsyncIterator[TransferReport]:
        """Attempts of one transfer until one succeeds, one fails for good, or
        the time left cannot hold the next pause (then the last error)."""
        pacing = self._pacing
        handshaked = False
        started = pacing.now()
        for attempt in itertools.count():
            try:
                attempt_reports = self._run(
                    req, record, write, attempt > 0, handshaked, transfer_id=transfer_id
                )
                async for item in attempt_reports:
                    handshaked |= item.phase is Phase.HANDSHAKING
                    yield item
                return
            except KvmapError as err:
                pause = (
                    pacing.policy.next_delay(attempt, pacing.draw(), deadline - pacing.now())
                    if retryable(err, pacing.now() - started)
                    else None
                )
                if pause is None:
                    raise
                self._metrics.transfer_retries.labels(
                    "push" if write else "pull", err.code.name
                ).inc()
                current().event("retry", code=err.code.name, attempt=attempt + 1)
                # The transfer's ids are in the logging context (``run``).
                log.warning(
                    "transfer_retry",
                    code=err.code.name,
                    attempt=attempt + 1,
                    pause_s=round(pause, 3),
                    error=str(err),
                )
            await pacing.sleep(pause)

    async def _run(
        self,
        req: TransferRequest | UseRelease,
        record: WorkerRecord,
        write: bool,
        renew: bool,
        handshaked: bool,
        *,
        transfer_id: str,
    ) -> AsyncIterator[TransferReport]:
        """One attempt; ``renew`` asks the owner for a fresh handshake (a
        failed attempt may have met its restart)."""
        if isinstance(req, UseRelease):
            yield await self._release_use(req, transfer_id)
            return
        for attempt in (0, 1):
            hs, fresh = await self._remote(req, refresh=renew or attempt > 0)
            handshaked |= fresh
            structlog.contextvars.bind_contextvars(peer_agent=hs.agent_name)
            current().set(peer_agent=hs.agent_name, remote_generation=hs.generation)
            if fresh:
                log.info("peer_handshake", generation=hs.generation)
                yield TransferReport(
                    Phase.HANDSHAKING,
                    f"handshake with {req.target}",
                    remote_generation=hs.generation,
                )
            moved = await self._move(
                req, record, hs, write, retry=attempt == 0, transfer_id=transfer_id
            )
            if moved is not None:
                break
        else:  # pragma: no cover - the loop always breaks or raises
            raise Unavailable("transfer could not be planned")
        plan, post_s, done_s = moved
        self._account(plan, post_s, done_s)
        current().set(blocks=plan.blocks, bytes=plan.bytes, descriptors=plan.descriptors)
        self._metrics.transfer_moved(
            "push" if write else "pull", req.target, plan.bytes, plan.descriptors
        )
        yield TransferReport(
            Phase.DONE,
            "done",
            descriptors=plan.descriptors,
            bytes=plan.bytes,
            post_seconds=post_s,
            completion_seconds=done_s,
            remote_generation=hs.generation,
            handshaked=handshaked,
        )

    async def _move(
        self,
        req: TransferRequest,
        record: WorkerRecord,
        hs: PeerHandshake,
        write: bool,
        *,
        retry: bool,
        transfer_id: str,
    ) -> tuple[TransferPlan, float, float] | None:
        """Plan the transfer, have the owner begin it and carry it out: the
        plan and the post's and the wait's seconds; None when the owner
        reports a stale generation and ``retry`` allows one more handshake.
        With ``check_before_read`` off, a pull reads while the owner checks
        its BeginTransfer (not after it) and is DONE only once the owner said
        yes; a refused pull fails, what its read left never reported loaded.
        A push writes the owner's memory: it always waits for the answer."""
        if req.expected_generation and req.expected_generation != hs.generation:
            raise RequestedGenerationGone(str(req.remote), req.expected_generation, hs.generation)
        where = stage()
        where.set("planning")
        # Ended however it ends: a refused or failed preparation too.
        with current().child("kvmap.plan") as planning:
            prepared, plan = await self._prepared_plan(record, hs, req, write)
            planning.set(descriptors=plan.descriptors, bytes=plan.bytes)
        announcement = self._announcement(req, hs, plan, write, transfer_id)
        # The whole transfer's time (it is bounded by its deadline anyway).
        begin: Awaitable[str] = self.peers.begin(req.target, announcement, req.timeout_s)
        moving = None
        if not write and not self._config.check_before_read:
            begin = asyncio.ensure_future(begin)  # sent first: the owner checks meanwhile
            moving = asyncio.ensure_future(
                self._posting.post_and_wait(prepared, plan, hs.agent_name, write)
            )
        where.set("waiting for the owner's BeginTransfer answer")
        try:
            token = await begin
        except BaseException as err:
            if moving is not None:
                await self._give_up(moving)
            await self._caches.done_with(prepared)
            if not isinstance(err, StaleGeneration) or not retry:
                raise
            log.info("stale_remote_generation", generation=hs.generation)
            return None  # re-handshake once, then plan again
        try:
            if moving is None:  # in order: no task of its own needed
                post = self._posting.post_and_wait(prepared, plan, hs.agent_name, write, where.set)
                xfers, post_s, done_s = await post
            else:
                where.set("waiting for NIXL to complete it")
                xfers, post_s, done_s = await moving
        except BaseException:
            await self._caches.done_with(prepared)
            await self.peers.end(req.target, token)
            raise
        self._finish_later(record, prepared, xfers, hs, token)
        return plan, post_s, done_s

    async def _prepared_plan(
        self, record: WorkerRecord, hs: PeerHandshake, req: TransferRequest, write: bool
    ) -> tuple[Prepared, TransferPlan]:
        """The transfer's lists (cached, or a token-mode transfer's own) and
        its plan; the lists are given back when the plan is refused."""
        if req.tokens:
            return await self._plan_tokens(record, hs, req, write)
        prepared = await self._caches.prepare(record, hs, req, write)
        assert prepared.table is not None  # cached lists always have their table
        try:
            destination = Side.REMOTE if write else Side.LOCAL
            return prepared, plan_transfer(prepared.table, req.pairs, destination=destination)
        except BaseException:
            await self._caches.done_with(prepared)
            raise

    async def _plan_tokens(
        self, local: WorkerRecord, hs: PeerHandshake, req: TransferRequest, write: bool
    ) -> tuple[Prepared, TransferPlan]:
        """A token-mode plan: explicit descriptors, nothing prepared or cached
        (they depend on the request's block ids and token count)."""
        await self._caches.check_compatible(local, hs, req)
        plan = plan_token_transfer(
            local.model,
            hs.model,
            req.tokens,
            destination=Side.REMOTE if write else Side.LOCAL,
        )
        local_mem = side_memory(local.model, "local worker")
        remote_mem = side_memory(hs.model, "remote worker")
        return Prepared(None, None, None, local_mem, remote_mem, users=1), plan

    async def _release_use(self, req: UseRelease, transfer_id: str) -> TransferReport:
        """Tell the owner this caller gives up its use of the grant: no
        handshake, no plan, nothing moved."""
        notice = ReleaseNotice(
            request_id=req.request_id,
            worker=req.remote,
            peer_agent=self._agent_name,
            capability=req.capability,
            readers=req.readers,
            transfer_id=transfer_id,
            traceparent=current().traceparent(),
        )
        stage().set("waiting for the owner's answer to the release")
        await self.peers.release(req.target, notice, req.timeout_s)
        return TransferReport(Phase.DONE, "released")

    def _announcement(
        self,
        req: TransferRequest,
        hs: PeerHandshake,
        plan: TransferPlan,
        write: bool,
        transfer_id: str,
    ) -> Announcement:
        return Announcement(
            request_id=req.request_id,
            worker=req.remote,
            generation=hs.generation,
            agent_name=hs.agent_name,
            peer_agent=self._agent_name,
            write=write,
            # A second past our deadline; the wire field is uint32 and the
            # caller picks the deadline (the owner caps leases anyway).
            lease_ms=min(int(req.timeout_s * 1000) + 1000, MAX_LEASE_MS),
            blocks=plan.blocks,
            nbytes=plan.bytes,
            capability=req.capability,
            # The owner's blocks this transfer touches: each must be granted.
            groups=req.remote_blocks,
            replaces_agents=self._replaces_agents,
            readers=req.readers,
            transfer_id=transfer_id,
            traceparent=current().traceparent(),
        )

    async def _give_up(self, moving: asyncio.Future[tuple[list[Xfer], float, float]]) -> None:
        """A read the owner did not agree to: stopped (a wait stopped
        releases what it posted), or released if it had already finished."""
        moving.cancel()
        await asyncio.wait({moving})
        if moving.cancelled() or moving.exception() is not None:
            return  # its error does not count: the owner's does
        xfers, _, _ = moving.result()
        await self._posting.release(xfers, None)

    def _finish_later(
        self,
        record: WorkerRecord,
        prepared: Prepared,
        xfers: list[Xfer],
        hs: PeerHandshake,
        token: str,
    ) -> None:
        """The bytes are in place: the caller hears DONE now. Releasing the
        handles and the owner's notification (one NIXL call, ~1 ms on a
        busy loop) follow off the reply's path."""
        record.pin()  # the handles' memory stays registered until released
        finish = asyncio.ensure_future(self._finish(record, prepared, xfers, hs, token))
        self._finishing.add(finish)
        finish.add_done_callback(self._finishing.discard)

    async def _finish(
        self,
        record: WorkerRecord,
        prepared: Prepared,
        xfers: list[Xfer],
        hs: PeerHandshake,
        token: str,
    ) -> None:
        """Release a completed transfer's handles and notify its owner, in
        one NIXL call. A failure here comes after the caller was told DONE
        (its bytes had landed): it is logged, and the owner's lease runs
        out instead of ending at the notification."""
        # A child of the pull's span, which may have ended by now.
        with current().child("kvmap.notify") as span:
            try:
                tell = partial(self._agent.send_notif, hs.agent_name, notification(token))
                await self._posting.release(xfers, tell)
                span.event("owner_notified")
            except Exception as err:
                span.fail(code_name(err), str(err))
                log.warning("owner_not_notified", error=str(err), peer_agent=hs.agent_name)
            finally:
                await self._caches.done_with(prepared)
                record.unpin()

    def _account(self, plan: TransferPlan, post_s: float, done_s: float) -> None:
        self._metrics.transfer_bytes.inc(plan.bytes)
        self._metrics.transfer_descriptors.inc(plan.descriptors)
        self._metrics.post_seconds.observe(post_s)
        self._metrics.completion_seconds.observe(done_s)
        self._counters.bytes += plan.bytes
        self._counters.descriptors += plan.descriptors
        self._counters.blocks += plan.blocks

    async def close(self) -> None:
        # Finished transfers release their handles before any list goes.
        await asyncio.gather(*self._finishing, return_exceptions=True)
        await self._caches.close()
        await self.peers.close()
