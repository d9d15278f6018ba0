"""The owner's side of a transfer: the capabilities its workers grant, the
leases that pin a worker while a peer reads (or writes) it, a reader's
release of its use, and the end of each: a NIXL notification from the
lease's agent, the peer's EndTransfer, or the lease running out."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from kvmap.core.convert import check_requested
from kvmap.core.errors import (
    SHUTTING_DOWN,
    FailedPrecondition,
    HandshakeAgain,
    PermissionDenied,
    Unavailable,
)
from kvmap.core.geometry import WorkerKey
from kvmap.core.grants import DENIED, Access, Grant
from kvmap.core.transfer_requests import Announcement, ReleaseNotice
from kvmap.core.worker_events import TransferDirection, TransferFinished
from kvmap.daemon.adapters.metrics import Metrics
from kvmap.daemon.engine.events import EventOutbox
from kvmap.daemon.engine.grants import GrantTable
from kvmap.daemon.engine.leases import DEFAULT_LEASE_S, Lease, LeaseTable, token_of
from kvmap.daemon.engine.lifecycle import Lifecycle
from kvmap.daemon.engine.stats import TransferCounters
from kvmap.daemon.engine.workers import WorkerTable
from kvmap.tracing import NULL_SPAN, Span

log = structlog.get_logger("kvmapd")

# Agent names remembered with the authenticated peer that first used each
# (least recently used forgotten first): a daemon has one agent per start,
# so even a host of many daemons restarting often stays far below.
MAX_BOUND_AGENTS = 4096


def lease_fields(lease: Lease) -> dict[str, Any]:
    """A lease's transfer as every log line about it names it (the same
    fields as the caller's daemon logs: docs/operate.md, "Logs"), and its
    trace's id when it is traced."""
    fields = {
        "request_id": lease.request_id,
        "transfer_id": lease.transfer_id,
        "peer": lease.peer,
        "peer_agent": lease.peer_agent,
        "worker": str(lease.record.key),
    }
    if lease.span.trace_id():
        fields["trace_id"] = lease.span.trace_id()
    return fields


class AgentBindings:
    """Each peer agent name bound to the authenticated peer that first
    announced a transfer under it: another peer declaring that name is
    refused, so a name in a lease, a claim or ``replaces_agents`` always
    means the peer that holds it."""

    def __init__(self, limit: int = MAX_BOUND_AGENTS) -> None:
        self._limit = limit
        self._peers: dict[str, str] = {}

    def check(self, agent: str, peer: str) -> None:
        """PermissionDenied when another peer holds the name ``agent``."""
        bound = self._peers.get(agent, peer)
        if bound != peer:
            log.warning("agent_name_of_other_peer", agent=agent[:256], peer=peer, holder=bound)
            raise PermissionDenied(DENIED)

    def bind(self, agent: str, peer: str) -> None:
        """Bind ``agent`` to ``peer`` (after ``check`` and the call's other
        checks passed: a refused call binds nothing)."""
        self._peers.pop(agent, None)
        self._peers[agent] = peer  # most recently used last
        if len(self._peers) > self._limit:
            del self._peers[next(iter(self._peers))]


class OwnerSide:
    """Grants, leases and what ends them, for the workers of this daemon."""

    def __init__(
        self,
        *,
        agent_name: str,
        table: WorkerTable,
        grants: GrantTable,
        leases: LeaseTable,
        events: EventOutbox,
        lifecycle: Lifecycle,
        metrics: Metrics,
        counters: TransferCounters,
        draining: Callable[[], bool],
        wake: Callable[[], None],
    ) -> None:
        self._agent_name = agent_name
        self._table = table
        self._grants = grants
        self._leases = leases
        self._events = events
        self._lifecycle = lifecycle
        self._metrics = metrics
        self._counters = counters
        self._draining = draining
        # Wakes the progress loop: the peer posts as soon as we answer.
        self._wake = wake
        self._agents = AgentBindings()

    def _refuse_while_draining(self) -> None:
        if self._draining():
            raise Unavailable(SHUTTING_DOWN)

    def grant(
        self,
        key: WorkerKey,
        *,
        request_id: str,
        groups: Sequence[tuple[int, Sequence[int]]],
        ttl_ms: int,
        max_uses: int,
        open_uses: bool = False,
        unread_release: int = 0,
        access: int = 0,
        capability: str = "",
    ) -> tuple[str, Grant]:
        """Registry.GrantTransfer: a capability for one request's blocks of an
        attached worker (its transfer_finished event must reach someone);
        ``capability``: one the worker drew, else the daemon draws it."""
        self._refuse_while_draining()
        record = self._table.get(key)
        if self._table.subscriber_count(key) == 0 and not self._lifecycle.may_grant_unattached(key):
            raise FailedPrecondition(f"worker {key} has no Attach stream open")
        return self._grants.grant(
            record,
            request_id=request_id,
            groups=groups,
            ttl_ms=ttl_ms,
            max_uses=max_uses,
            open_uses=open_uses,
            unread_release=unread_release,
            access=access,
            capability=capability,
        )

    def revoke(self, key: WorkerKey, request_id: str) -> int:
        """Registry.RevokeTransfer: idempotent for a known worker. Returns
        the writes into the worker's blocks that peers announced under the
        request's grants (revoked now, or before) and have not finished:
        their bytes may still land, so the blocks must not be reused yet."""
        self._table.get(key)
        self._grants.revoke(key, request_id)
        return sum(
            1
            for lease in self._leases.snapshot()
            if lease.write and lease.record.key == key and lease.request_id == request_id
        )

    def begin(self, a: Announcement, *, peer: str, span: Span = NULL_SPAN) -> Lease:
        """Peer.BeginTransfer (its arguments checked by the wire parse) from
        the authenticated ``peer``: capability, agent, worker, generation and
        limits before the lease and the grant's claim. The lease ends
        ``span`` (its trace's) when it ends."""
        self._refuse_while_draining()
        # No capability, no answer about workers or agents.
        self._grants.find(a.capability)
        self._agents.check(a.peer_agent, peer)
        if a.agent_name and a.agent_name != self._agent_name:
            raise HandshakeAgain(
                f"transfer planned against agent {a.agent_name}; this daemon runs "
                f"{self._agent_name} (it restarted): handshake again"
            )
        record = self._lifecycle.worker_for_peer(check_requested(a.worker, "worker"))
        replaces = frozenset(a.replaces_agents)
        grant = self._grants.admit(
            a.capability,
            record=record,
            request_id=a.request_id,
            groups=a.groups,
            peer_agent=a.peer_agent,
            peer=peer,
            replaces=replaces,
            readers=a.readers,
            write=a.write,
        )
        asked_s = (a.lease_ms / 1000) if a.lease_ms else DEFAULT_LEASE_S
        lease = self._leases.begin(
            record,
            generation=a.generation,
            request_id=a.request_id,
            peer_agent=a.peer_agent,
            write=a.write,
            blocks=a.blocks,
            nbytes=a.nbytes,
            # No lease outlives its grant: the blocks it pins are promised
            # to the request only that long.
            lease_s=min(asked_s, self._grants.seconds_left(grant)),
            grant=grant.digest,
            peer=peer,
        )
        lease.transfer_id = a.transfer_id
        lease.span = span
        span.set(lease_s=round(lease.expires_at - time.monotonic(), 3))
        self._agents.bind(a.peer_agent, peer)
        self._take_over(grant.digest, replaces, peer)
        self._grants.claim(grant, a.peer_agent, peer)
        self._wake()
        # Debug: a line per transfer would cost the hot path at info.
        log.debug("transfer_begun", **lease_fields(lease), blocks=a.blocks, bytes=a.nbytes)
        return lease

    def release(self, n: ReleaseNotice, *, peer: str) -> Grant:
        """A reader (the authenticated ``peer``) that needs none of the
        blocks gives up its use: every check (capability, worker, request,
        claim, expiry, declared count) before one use is spent and the
        worker told; no lease, no pin."""
        self._refuse_while_draining()
        self._grants.find(n.capability)  # no capability, no answer about workers
        self._agents.check(n.peer_agent, peer)
        record = self._lifecycle.worker_for_peer(check_requested(n.worker, "worker"))
        used = self._grants.release_use(
            n.capability,
            record=record,
            request_id=n.request_id,
            readers=n.readers,
            peer_agent=n.peer_agent,
            peer=peer,
        )
        self._agents.bind(n.peer_agent, peer)
        self._metrics.served(peer, "OK")
        log.info(
            "transfer_use_released",
            request_id=n.request_id,
            transfer_id=n.transfer_id,
            peer=peer,
            peer_agent=n.peer_agent,
            worker=str(record.key),
            uses=used.uses,
            max_uses=used.max_uses,
        )
        done = TransferFinished(
            request_id=n.request_id,
            direction=TransferDirection.PUSHED_TO
            if used.access is Access.WRITE
            else TransferDirection.PULLED_FROM,
            peer_agent=n.peer_agent,
            released=True,
        )
        self._events.tell_finished(record.key, done, used)
        return used

    def _take_over(self, digest: bytes, replaces: frozenset[str], caller: str) -> None:
        """End the leases of a replaced agent under this grant (after the new
        lease pinned the worker, so the pin never lapses): each releases its
        claim and unpins once, here, and the dead agent's late EndTransfer or
        notification finds no lease."""
        peer, holder = self._grants.holder(digest)
        if holder not in replaces or peer != caller:
            return  # only a peer's own earlier agents are its to replace
        for old in self._leases.held_by(holder, digest, peer):
            self._leases.finish(old.token)
            self._grants.release(digest)
            log.warning("claim_taken_over", **lease_fields(old))
            old.span.fail("CANCELLED", "taken over by the agent that replaced its own")
            old.span.end()

    def end(self, token: str, *, peer: str) -> Lease | None:
        """A peer gave up on a transfer (EndTransfer): the pin goes, and the
        capability may be tried again. Only the authenticated peer that
        announced the lease can end it: from any other, a token it learnt
        is answered as an unknown one and changes nothing."""
        lease = self._leases.get(token)
        if lease is not None and lease.peer != peer:
            log.warning("end_from_other_peer", peer=peer, holder=lease.peer)
            return None
        lease = self._leases.finish(token)
        if lease is not None:
            self._grants.release(lease.grant)
            self._metrics.served(lease.peer, "CANCELLED")
            log.warning("transfer_ended_by_peer", **lease_fields(lease))
            lease.span.fail("CANCELLED", "ended by the peer (EndTransfer)")
            lease.span.end()
        return lease

    def expire(self, now: float | None = None) -> list[Lease]:
        """End leases that ran out (their capabilities may be tried again)
        and forget long-expired grants."""
        gone = self._leases.expire(now)
        self._metrics.leases_expired.inc(len(gone))
        for lease in gone:
            self._grants.release(lease.grant)
            self._metrics.served(lease.peer, "DEADLINE_EXCEEDED")
            log.warning("lease_expired", **lease_fields(lease))
            lease.span.fail("DEADLINE_EXCEEDED", "the lease ran out before a notification")
            lease.span.end()
        self._grants.sweep()
        return gone

    def on_notifs(self, notifs: dict[str, list[bytes]]) -> None:
        """NIXL notifications from pullers/pushers: the transfer is complete."""
        for peer, messages in notifs.items():
            for message in messages:
                token = token_of(message)
                lease = self._leases.finish_from(token, peer) if token else None
                if lease is None:
                    self._unmatched_notif(peer, message, token)
                    continue
                self._finished(lease, peer)

    def _finished(self, lease: Lease, peer: str) -> None:
        # Its use is stored with the event (``tell_finished``).
        used = self._grants.complete(lease.grant, persist=False)
        self._counters.served_done += 1
        self._counters.served_blocks += lease.blocks
        self._metrics.served(lease.peer, "OK", lease.bytes)
        log.debug("transfer_finished", **lease_fields(lease))
        lease.span.event("notified")
        direction = TransferDirection.PUSHED_TO if lease.write else TransferDirection.PULLED_FROM
        done = TransferFinished(request_id=lease.request_id, direction=direction, peer_agent=peer)
        self._events.tell_finished(lease.record.key, done, used, store_use=True)
        if used is not None:
            lease.span.set(uses=used.uses, max_uses=used.max_uses)
        lease.span.event("worker_told")
        lease.span.end()

    def _unmatched_notif(self, peer: str, message: bytes, token: str | None) -> None:
        holder = self._leases.holder(token) if token else None
        if holder is not None:
            # A live lease's token from an agent that does not hold it: a
            # forged (or misrouted) "done"; the lease and its blocks stay.
            log.warning("notif_from_other_agent", peer_agent=peer, holder=holder)
        else:
            log.info("notif_unmatched", peer_agent=peer, message=message[:64])
