"""The owner's side of a transfer: a peer announces it (BeginTransfer), the
owner pins the worker's registration under a lease, and the NIXL
notification the peer sends after completion ends it. A lease that runs out
releases the pin too: a peer that never finishes is its own problem, never a
leak here."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

from kvmap.core.errors import ResourceExhausted, StaleGeneration
from kvmap.daemon.engine.workers import WorkerRecord
from kvmap.tracing import NULL_SPAN, Span

# Notification payload a puller sends to the owner's agent when it is done.
NOTIF_PREFIX = b"kvmap1:done:"
# Concurrent announced transfers per authenticated peer (a stated limit: a
# peer cannot pin unbounded registrations). Counted by who the connection
# says the peer is, not by the agent names it declares: invented names would
# otherwise each bring a quota of their own.
MAX_LEASES_PER_PEER = 1024
MAX_LEASES = 8192
DEFAULT_LEASE_S = 60.0
MAX_LEASE_S = 600.0


# SHA-256 digest of a capability (engine.grants); named here because a Lease
# field is called ``bytes``.
GrantDigest = bytes


@dataclass
class Lease:
    token: str
    request_id: str
    record: WorkerRecord
    peer_agent: str
    write: bool
    blocks: int
    bytes: int
    expires_at: float
    # Digest of the capability (engine.grants) the lease holds a claim on.
    grant: GrantDigest = b""
    # The authenticated peer that announced it (``api.authorization.peer_identity``).
    peer: str = ""
    # The caller's id of the transfer (BeginTransferRequest.transfer_id), logged.
    transfer_id: str = ""
    # The lease's span (a child of the caller's span of the transfer): it
    # ends with the lease, however that ends.
    span: Span = NULL_SPAN


def notification(token: str) -> bytes:
    return NOTIF_PREFIX + token.encode()


def token_of(message: bytes) -> str | None:
    if message.startswith(NOTIF_PREFIX):
        return message[len(NOTIF_PREFIX) :].decode(errors="replace")
    return None


class LeaseTable:
    def __init__(self) -> None:
        self._leases: dict[str, Lease] = {}
        self._per_peer: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def begin(
        self,
        record: WorkerRecord,
        *,
        generation: int,
        request_id: str,
        peer_agent: str,
        write: bool,
        blocks: int,
        nbytes: int,
        lease_s: float,
        grant: GrantDigest = b"",
        peer: str = "",
    ) -> Lease:
        if generation != record.generation:
            raise StaleGeneration(str(record.key), generation, record.generation)
        if self._per_peer.get(peer, 0) >= MAX_LEASES_PER_PEER:
            raise ResourceExhausted(
                f"peer {peer or peer_agent} has {MAX_LEASES_PER_PEER} transfers outstanding "
                "(the limit)"
            )
        if len(self._leases) >= MAX_LEASES:
            raise ResourceExhausted(f"{MAX_LEASES} transfers outstanding in all (the limit)")
        lease = Lease(
            token=secrets.token_hex(16),
            request_id=request_id,
            record=record,
            peer_agent=peer_agent,
            write=write,
            blocks=blocks,
            bytes=nbytes,
            expires_at=time.monotonic() + min(max(lease_s, 0.001), MAX_LEASE_S),
            grant=grant,
            peer=peer,
        )
        record.pin()
        self._leases[lease.token] = lease
        self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
        return lease

    def finish(self, token: str) -> Lease | None:
        lease = self._leases.pop(token, None)
        if lease is not None:
            lease.record.unpin()
            left = self._per_peer[lease.peer] - 1
            if left:
                self._per_peer[lease.peer] = left
            else:
                del self._per_peer[lease.peer]
        return lease

    def get(self, token: str) -> Lease | None:
        return self._leases.get(token)

    def held_by(self, peer_agent: str, grant: GrantDigest, peer: str = "") -> list[Lease]:
        """The leases ``peer_agent`` of the authenticated ``peer`` holds under
        one grant."""
        return [
            lease
            for lease in self._leases.values()
            if lease.peer_agent == peer_agent and lease.grant == grant and lease.peer == peer
        ]

    def finish_from(self, token: str, sender: str) -> Lease | None:
        """End a lease on a completion notification, only if it came from the
        agent that holds the lease: another agent that learnt a token cannot
        make the owner free a request's blocks."""
        lease = self._leases.get(token)
        if lease is None or lease.peer_agent != sender:
            return None
        return self.finish(token)

    def snapshot(self) -> list[Lease]:
        """Every lease now (the operator's live view; never its tokens)."""
        return list(self._leases.values())

    def holder(self, token: str) -> str | None:
        lease = self._leases.get(token)
        return None if lease is None else lease.peer_agent

    def expire(self, now: float | None = None) -> list[Lease]:
        now = time.monotonic() if now is None else now
        gone = [t for t, lease in self._leases.items() if lease.expires_at <= now]
        return [lease for t in gone if (lease := self.finish(t)) is not None]
