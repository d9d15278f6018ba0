"""The owner's table of per-request capabilities (see ``core.grants``).

A grant is minted for one worker's request (Registry.GrantTransfer, Unix
socket only), persisted so that it survives a daemon restart, claimed by the
first peer agent whose BeginTransfer it allows, consumed when that transfer's
completion notification arrives (or when a reader releases its use without
a transfer), and released for a retry when the transfer fails or its lease
runs out. An open grant's use count is fixed, and stored, by its first
claim. Claims live only in memory: leases do not survive a restart either,
and a peer re-announces after one.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Protocol

import structlog

from kvmap.core import grants as core
from kvmap.core.errors import (
    AlreadyExists,
    FailedPrecondition,
    KvmapError,
    PermissionDenied,
    ResourceExhausted,
)
from kvmap.core.geometry import RegionMapModel, WorkerKey
from kvmap.core.grants import BlockIds, Grant
from kvmap.daemon.engine.workers import WorkerRecord

log = structlog.get_logger("kvmapd.grants")


class GrantStore(Protocol):
    """Where grants outlive the daemon (``state_store.StateStore``)."""

    def save_grant(self, grant: Grant, named: Sequence[tuple[int, BlockIds]] = ()) -> None: ...
    def update_grant(self, grant: Grant) -> None: ...
    def delete_grants(self, digests: Sequence[bytes]) -> None: ...
    def grants(self) -> list[Grant]: ...


def wall_ms() -> int:
    # Wall clock, not monotonic: expiries are persisted and reported to the
    # worker (expires_unix_ms), so they must mean the same after a restart.
    return time.time_ns() // 1_000_000


@dataclass
class _Entry:
    grant: Grant
    # The peer agent whose transfers hold the grant now, and how many.
    claimed_by: str = ""
    active: int = 0
    # The authenticated peer (``api.authorization.peer_identity``) that
    # agent called from: an agent name is only what a caller declares.
    claimed_peer: str = ""

    def held_by_other(self, peer: str, agent: str) -> bool:
        return bool(self.claimed_by) and (self.claimed_peer, self.claimed_by) != (peer, agent)


def reader_layout(record: WorkerRecord) -> core.ReaderLayout:
    """What the granting worker registered about who can read it."""
    return core.ReaderLayout(
        tp_size=record.model.tp_size,
        tp_rank=record.key.tp_rank,
        kv_heads=record.model.heads.total_kv_heads if record.model.heads else 0,
    )


class GrantTable:
    def __init__(self, store: GrantStore, clock: Callable[[], int] = wall_ms) -> None:
        self._store = store
        self._clock = clock
        self._entries: dict[bytes, _Entry] = {}
        self._per_worker: dict[WorkerKey, int] = {}
        self._blocks = 0
        # Each worker's group limits, with the model they were read from: a
        # model is a worker's plan, unchanged until it is re-planned, and
        # reading the limits walks every region (one per layer) per grant.
        self._limits: dict[WorkerKey, tuple[RegionMapModel, dict[int, int]]] = {}
        for grant in store.grants():
            self._add(grant)
        self.sweep()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def granted_blocks(self) -> int:
        return self._blocks

    def snapshot(self) -> list[tuple[Grant, str, int]]:
        """Every grant with its claim's holder ("" when none) and active
        transfers: the operator's live view."""
        return [(e.grant, e.claimed_by, e.active) for e in self._entries.values()]

    def _add(self, grant: Grant) -> None:
        self._entries[grant.digest] = _Entry(grant)
        self._per_worker[grant.worker] = self._per_worker.get(grant.worker, 0) + 1
        self._blocks += grant.block_count

    def _persist(self, action: str, write: Callable[[], None]) -> None:
        """A change the table has already made in memory, written through.
        Withdrawing, consuming and re-binding must take effect even when the
        store cannot keep it (full disk, read-only): refusing more is safe,
        so the table goes ahead and says loudly what a restart may bring back."""
        try:
            write()
        except KvmapError as err:
            log.error("grant_change_not_stored", action=action, error=str(err))

    def _remove(self, digests: Sequence[bytes], persist: bool = True) -> None:
        if not digests:
            return
        for d in digests:
            grant = self._entries.pop(d).grant
            left = self._per_worker[grant.worker] - 1
            if left:
                self._per_worker[grant.worker] = left
            else:
                del self._per_worker[grant.worker]
            self._blocks -= grant.block_count
        if persist:
            self._persist("delete", partial(self._store.delete_grants, digests))

    # Minting and withdrawing --------------------------------------------------

    def grant(
        self,
        record: WorkerRecord,
        *,
        request_id: str,
        groups: Sequence[tuple[int, BlockIds]],
        ttl_ms: int,
        max_uses: int,
        open_uses: bool = False,
        unread_release: int = core.UnreadRelease.UNSPECIFIED,
        access: int = core.Access.READ,
        capability: str = "",
    ) -> tuple[str, Grant]:
        """Mint a capability for ``record``'s worker; the caller checked that
        the worker is attached. Returns the capability (the only copy) and
        its grant (``unread_release``: the worker's word on a release
        declaring no readers, stored with it). ``capability``: one the
        worker drew (checked for form; ALREADY_EXISTS if a grant has it),
        else one drawn here."""
        request_id = core.check_request_id(request_id)
        ttl_ms = core.check_ttl(ttl_ms)
        max_uses = core.check_grant_uses(max_uses, open_uses)
        unread = core.check_unread_release(unread_release, open_uses)
        direction = core.check_access(access)
        blocks = core.granted_blocks(groups, self._group_limits(record))
        self._check_room(record.key, sum(len(ids) for ids in blocks.values()))
        if capability:
            capability = core.check_caller_capability(capability)
            if core.digest(capability) in self._entries:
                raise AlreadyExists("capability: already a grant's")
        else:
            capability = new_capability()
        grant = Grant(
            digest=core.digest(capability),
            worker=record.key,
            generation=record.generation,
            request_id=request_id,
            blocks=blocks,
            expires_unix_ms=self._clock() + ttl_ms,
            max_uses=max_uses,
            unread_release=unread,
            access=direction,
        )
        # First: a failed write leaves nothing behind.
        self._store.save_grant(grant, named=groups)
        self._add(grant)
        return capability, grant

    def _group_limits(self, record: WorkerRecord) -> dict[int, int]:
        cached = self._limits.get(record.key)
        if cached is not None and cached[0] is record.model:
            return cached[1]
        limits = core.group_limits(record.model)
        self._limits[record.key] = (record.model, limits)
        return limits

    def _check_room(self, worker: WorkerKey, blocks: int) -> None:
        def full() -> str:
            if self._per_worker.get(worker, 0) >= core.MAX_GRANTS_PER_WORKER:
                return f"worker {worker} has {core.MAX_GRANTS_PER_WORKER} grants (the limit)"
            if len(self._entries) >= core.MAX_GRANTS:
                return f"{core.MAX_GRANTS} grants outstanding in all (the limit)"
            if self._blocks + blocks > core.MAX_GRANTED_BLOCKS:
                return f"{core.MAX_GRANTED_BLOCKS} granted block ids in all (the limit)"
            return ""

        if full():
            self.sweep()  # expired grants make room before anything is refused
            why = full()
            if why:
                raise ResourceExhausted(why)

    def revoke(self, worker: WorkerKey, request_id: str) -> list[bytes]:
        """Withdraw every grant of a request; their digests."""
        gone = [
            d
            for d, e in self._entries.items()
            if e.grant.worker == worker and e.grant.request_id == request_id
        ]
        self._remove(gone)
        return gone

    def drop_worker(self, worker: WorkerKey) -> None:
        """The worker's memory is gone or replaced: none of its grants holds."""
        self._limits.pop(worker, None)
        self._remove([d for d, e in self._entries.items() if e.grant.worker == worker])

    def rebind(self, worker: WorkerKey, generation: int) -> None:
        """The worker was re-planned over the same memory (replan, restore
        after a restart): its block ids still mean the same blocks."""
        for entry in self._entries.values():
            if entry.grant.worker == worker and entry.grant.generation != generation:
                entry.grant = replace(entry.grant, generation=generation)
                self._persist("rebind", partial(self._store.update_grant, entry.grant))

    def sweep(self) -> int:
        """Forget grants expired more than ``EXPIRED_KEPT_MS`` ago."""
        cutoff = self._clock() - core.EXPIRED_KEPT_MS
        gone = [d for d, e in self._entries.items() if e.grant.expires_unix_ms <= cutoff]
        self._remove(gone)
        if gone:
            log.info("grants_expired", count=len(gone), left=len(self._entries))
        return len(gone)

    # Peers --------------------------------------------------------------------

    def find(self, capability: str) -> Grant:
        """The grant of a presented capability; PermissionDenied when there
        is none. Looked up by digest: the secret is never compared."""
        entry = self._entries.get(core.digest(capability)) if capability else None
        if entry is None:
            raise PermissionDenied(core.DENIED)
        return entry.grant

    def admit(
        self,
        capability: str,
        *,
        record: WorkerRecord,
        request_id: str,
        groups: Iterable[tuple[int, BlockIds]],
        peer_agent: str,
        peer: str,
        replaces: frozenset[str] = frozenset(),
        readers: int = 0,
        write: bool = False,
    ) -> Grant:
        """Every check of a BeginTransfer's capability, changing nothing. A
        claim held by an agent in ``replaces`` (the caller's daemon before a
        restart) does not stand in the way when the same authenticated
        ``peer`` holds it: the caller takes it over (``taken_over``) once
        everything else has passed. Another peer's claim stands, whatever
        agent names the caller declares. The grant returned has the use
        count ``readers`` fixes (``claim`` keeps it)."""
        grant = core.check_binding(
            self.find(capability),
            worker=record.key,
            generation=record.generation,
            request_id=request_id,
            groups=groups,
        )
        if (grant.access is core.Access.WRITE) != write:
            # A read grant never lets a peer write, nor a write grant read.
            raise PermissionDenied(core.DENIED)
        entry = self._entries[grant.digest]
        taken = entry.claimed_by in replaces and entry.claimed_peer == peer
        # A taken-over claim's transfers died with their agent: they will
        # never complete, so they count against no use.
        active = 0 if taken else entry.active
        if entry.held_by_other(peer, peer_agent) and not taken:
            raise PermissionDenied(core.DENIED)
        grant = core.declare_readers(grant, readers, reader_layout(record))
        if active + grant.uses >= grant.max_uses:
            raise PermissionDenied(core.DENIED)
        if grant.expired(self._clock()):
            raise FailedPrecondition(f"capability for request {request_id} expired")
        return grant

    def claimed_by(self, digest: bytes) -> str:
        """The agent whose transfers hold the grant now ("" when none)."""
        entry = self._entries.get(digest)
        return entry.claimed_by if entry is not None else ""

    def holder(self, digest: bytes) -> tuple[str, str]:
        """The (authenticated peer, agent) whose transfers hold the grant now
        (empty strings when none)."""
        entry = self._entries.get(digest)
        return (entry.claimed_peer, entry.claimed_by) if entry is not None else ("", "")

    def seconds_left(self, grant: Grant) -> float:
        """How long the grant has until it expires (a lease under it ends
        no later)."""
        return max(0.0, (grant.expires_unix_ms - self._clock()) / 1000)

    def claim(self, grant: Grant, peer_agent: str, peer: str) -> None:
        """A lease now holds the grant for ``peer_agent`` of the
        authenticated ``peer`` (after ``admit``)."""
        entry = self._entries[grant.digest]
        entry.claimed_by = peer_agent
        entry.claimed_peer = peer
        entry.active += 1
        if entry.grant.max_uses != grant.max_uses:
            # The first claim fixed an open grant's count: a restart keeps it.
            entry.grant = replace(entry.grant, max_uses=grant.max_uses)
            self._persist("fix_uses", partial(self._store.update_grant, entry.grant))

    def release_use(
        self,
        capability: str,
        *,
        record: WorkerRecord,
        request_id: str,
        readers: int,
        peer_agent: str,
        peer: str,
    ) -> Grant:
        """A reader that needs none of the blocks gives up its use
        (BeginTransfer with ``release``): every check first, as ``admit``
        (another peer's claim stands); then one use spent
        (``core.release_use``). Returns the grant after."""
        grant = core.check_owner(
            self.find(capability),
            worker=record.key,
            generation=record.generation,
            request_id=request_id,
        )
        entry = self._entries[grant.digest]
        if entry.held_by_other(peer, peer_agent):
            raise PermissionDenied(core.DENIED)
        if grant.expired(self._clock()):
            raise FailedPrecondition(f"capability for request {request_id} expired")
        after = core.release_use(grant, readers, reader_layout(record))
        if entry.active + after.uses > after.max_uses:
            # Every use left is held by a transfer in flight (or spent).
            raise PermissionDenied(core.DENIED)
        self._spend(entry, after)
        return after

    def release(self, digest: bytes) -> None:
        """A transfer under the grant ended without completing: the claim goes,
        and the grant may be used again until it expires."""
        entry = self._entries.get(digest)
        if entry is None:
            return  # revoked or swept meanwhile
        entry.active = max(0, entry.active - 1)
        if entry.active == 0:
            entry.claimed_by = ""
            entry.claimed_peer = ""

    def complete(self, digest: bytes, persist: bool = True) -> Grant | None:
        """A transfer under the grant completed: one use is spent. Returns
        the grant after (None when it was revoked or swept meanwhile). With
        ``persist`` False the caller stores the use (``StateStore.record_use``
        with the worker's event, in one transaction) or, failing that, hands
        it to ``persist_use``."""
        entry = self._entries.get(digest)
        if entry is None:
            return None
        self.release(digest)
        grant = replace(entry.grant, uses=entry.grant.uses + 1)
        self._spend(entry, grant, persist)
        return grant

    def persist_use(self, grant: Grant) -> None:
        """Store a use ``complete`` left to its caller, as ``complete`` does."""
        if grant.exhausted:
            self._persist("delete", partial(self._store.delete_grants, [grant.digest]))
        else:
            self._persist("use", partial(self._store.update_grant, grant))

    def _spend(self, entry: _Entry, grant: Grant, persist: bool = True) -> None:
        """``grant`` (one more use spent) replaces the entry's; used up, it goes."""
        if grant.exhausted:
            self._remove([grant.digest], persist=False)
        else:
            entry.grant = grant
        if persist:
            self.persist_use(grant)


def new_capability() -> str:
    """256 random bits, URL-safe: it travels in kv_transfer_params (JSON)."""
    return secrets.token_urlsafe(32)
