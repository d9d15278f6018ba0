"""What the daemon is doing now, for the operator's live view
(``Admin.GetStatus``, ``kvmapctl status``): its own transfers in flight
and a short ring of recent failed RPCs.

Kept apart from the transfer engine on purpose: the Transfers servicer
enters and leaves each transfer here and the RPC interceptor records each
failure, so the view costs a pull one dict entry and nothing on its path
through the engine. Both collections are bounded: the transfers by what is
in flight, the failures by ``RECENT_ERRORS`` entries of at most
``MAX_ERROR_CHARS`` characters each (a stranger's refused calls cannot grow
the daemon)."""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvmap.core.geometry import WorkerKey
from kvmap.core.transfer_requests import TransferRequest, UseRelease

# Enough to see what went wrong in the last minutes of a busy daemon; the
# logs (and metrics) keep the whole history.
RECENT_ERRORS = 32
MAX_ERROR_CHARS = 512


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass
class InFlight:
    """One of this daemon's own transfers, from its RPC's start to its end."""

    key: int
    request_id: str
    kind: str  # "pull", "push" or "release"
    local: WorkerKey
    target: str
    remote: WorkerKey
    started: float  # the monotonic clock's, for the age
    started_unix_ms: int
    # The last phase the worker was told ("" before the first report).
    phase: str = ""


@dataclass(frozen=True)
class PeerRefusal:
    """A TCP call of Peer or RegionMaps refused as not authorized."""

    at_unix_ms: int
    peer: str
    reason: str


@dataclass(frozen=True)
class FailedCall:
    """One RPC that ended with an error status."""

    at_unix_ms: int
    listener: str
    method: str
    code: str
    message: str
    request_id: str


class Activity:
    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], int] = wall_ms,
    ) -> None:
        self._clock = clock
        self._wall = wall
        self.started = clock()
        self.started_unix_ms = wall()
        self._keys = itertools.count()
        self._transfers: dict[int, InFlight] = {}
        self._failures: deque[FailedCall] = deque(maxlen=RECENT_ERRORS)
        # TCP callers refused as not authorized peers (api.authorization):
        # a daemon whose peers all fail to authenticate says so here.
        self.peer_calls_refused = 0
        self.last_peer_refusal: PeerRefusal | None = None

    def uptime_s(self) -> float:
        return self._clock() - self.started

    def age_s(self, entry: InFlight) -> float:
        return self._clock() - entry.started

    def begin(self, req: TransferRequest | UseRelease, kind: str) -> InFlight:
        entry = InFlight(
            key=next(self._keys),
            request_id=req.request_id,
            kind=kind,
            local=req.local,
            target=req.target,
            remote=req.remote,
            started=self._clock(),
            started_unix_ms=self._wall(),
        )
        self._transfers[entry.key] = entry
        return entry

    def end(self, entry: InFlight) -> None:
        self._transfers.pop(entry.key, None)

    def transfers(self) -> list[InFlight]:
        """In flight now, oldest first."""
        return list(self._transfers.values())

    def failed(self, listener: str, method: str, code: str, message: str, request_id: str) -> None:
        self._failures.append(
            FailedCall(
                at_unix_ms=self._wall(),
                listener=listener,
                method=method,
                code=code,
                message=message[:MAX_ERROR_CHARS],
                request_id=request_id[:128],
            )
        )

    def peer_refused(self, peer: str, reason: str) -> None:
        self.peer_calls_refused += 1
        self.last_peer_refusal = PeerRefusal(self._wall(), peer[:128], reason[:MAX_ERROR_CHARS])

    def failures(self) -> list[FailedCall]:
        """The last ``RECENT_ERRORS`` failed RPCs, oldest first."""
        return list(self._failures)
