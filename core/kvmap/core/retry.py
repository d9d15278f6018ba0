"""When a transfer that failed is tried again, and when not.

A pull or push fails for two kinds of reasons. Some pass: the peer's daemon
(or its worker) is restarting, so it is unreachable for a moment
(UNAVAILABLE, also what a worker that is re-registering after a restart
answers), or it came back with a new NIXL agent or generation, which a fresh
handshake cures (FAILED_PRECONDITION with the reason HANDSHAKE_AGAIN). The
others are about the request and stay: PERMISSION_DENIED, INVALID_ARGUMENT,
NOT_FOUND, a FAILED_PRECONDITION without that reason (an expired
capability, incompatible geometry), RESOURCE_EXHAUSTED of a stated limit.
Only the first kind is retried, with exponential backoff and jitter, while
the transfer's own deadline allows; and the owner's refusal of a capability
(``OwnerRefused``) in a transfer's first ``GRANT_RACE_S``: a prefill worker
draws its capabilities itself and grants them off vLLM's scheduler thread
(GrantTransferRequest.capability), so a fast decode can ask before the
owner has the grant. Later the refusal stands: a capability is never
granted long after it was handed on.

``retryable`` is the daemon's one classification of a failed attempt;
``RetryPolicy`` is the project's one backoff arithmetic, shared with the
client: its connector's pulls (which classify their own errors: the local
daemon restarting under a pull) and its ``WorkerSession``'s reconnections
(``kvmap.client.session.Backoff``: this arithmetic with the session's
defaults).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmap.core.errors import (
    HANDSHAKE_AGAIN,
    ErrorCode,
    KvmapError,
    OwnerRefused,
    RequestedGenerationGone,
)

# How long after a transfer started an owner's refusal of its capability is
# taken for a grant still on its way (the prefill worker's background grant
# is a local call of a millisecond or two; a decode reaches the owner after
# the router's and its own hops).
GRANT_RACE_S = 0.25


def retryable(err: BaseException, elapsed_s: float = float("inf")) -> bool:
    """Whether a failed transfer attempt may succeed if tried again;
    ``elapsed_s``: since the transfer started (the grant race)."""
    if not isinstance(err, KvmapError) or isinstance(err, RequestedGenerationGone):
        # A bug is not a restart; a generation the spec pins that a fresh
        # handshake showed gone never comes back.
        return False
    if err.code is ErrorCode.UNAVAILABLE:
        return True
    if isinstance(err, OwnerRefused):
        return elapsed_s < GRANT_RACE_S
    return err.code is ErrorCode.FAILED_PRECONDITION and err.reason == HANDSHAKE_AGAIN


@dataclass(frozen=True)
class RetryPolicy:
    """Delays between attempts: ``initial_s`` growing by ``multiplier`` up to
    ``max_s``, each scaled by a factor in ``[1 - jitter, 1]`` drawn by the
    caller (so that the pulls of a fleet restarted together do not retry in
    step, and so that this stays a pure function). ``attempt_s`` is the time
    an attempt is given after its pause: one started closer to the deadline
    would mostly end in DEADLINE_EXCEEDED, which hides the error that says
    why the transfer failed (and tells a silent peer from a closed port)."""

    initial_s: float = 0.05
    max_s: float = 1.0
    multiplier: float = 2.0
    jitter: float = 0.5
    attempt_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s:
            raise ValueError(f"retry: need 0 < initial_s <= max_s, got {self}")
        if self.multiplier < 1 or not 0 <= self.jitter < 1:
            raise ValueError(f"retry: need multiplier >= 1 and 0 <= jitter < 1, got {self}")
        if not 0 <= self.attempt_s < float("inf"):
            raise ValueError(f"retry: need a finite attempt_s >= 0, got {self}")

    def delay(self, attempt: int, draw: float) -> float:
        """The pause after failed attempt ``attempt`` (0 for the first),
        with ``draw`` in [0, 1) from the caller's random source."""
        if attempt < 0 or not 0 <= draw < 1:
            raise ValueError(f"retry: need attempt >= 0 and 0 <= draw < 1, got {attempt}, {draw}")
        try:
            grown = self.initial_s * self.multiplier**attempt
        except OverflowError:  # far past max_s: many attempts at a large multiplier
            grown = self.max_s
        return min(grown, self.max_s) * (1 - self.jitter * draw)

    def next_delay(self, attempt: int, draw: float, remaining_s: float) -> float | None:
        """The pause before the next attempt, or None when the time left
        cannot hold the pause and then ``attempt_s`` (the caller gives up with
        the last error: an attempt that starts at the deadline cannot finish
        by it)."""
        pause = self.delay(attempt, draw)
        return pause if pause + self.attempt_s < remaining_s else None
