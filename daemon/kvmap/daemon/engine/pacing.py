"""How a transfer's attempts are paced (its backoff, on a clock a test may
replace) and bounded (the deadline of the whole stream of its reports)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from kvmap.core.retry import RetryPolicy

T = TypeVar("T")


# A pull's attempts against an owner that is restarting: at most 0.25 s
# apart, so that a pull waiting on an upgraded daemon goes through within a
# quarter second of its return (an upgrade's gap is ~1 s); a failed attempt
# against a peer that is down costs a refused connection, not a timeout.
# The last attempt starts with at least half a second left: one begun at the
# deadline's edge on a busy host ended DEADLINE_EXCEEDED where its twins
# ended UNAVAILABLE naming the unreachable daemon (a silent port told from a
# closed one by the answer), and a real pull needs tens of milliseconds.
PULL_RETRY = RetryPolicy(initial_s=0.05, max_s=0.25, attempt_s=0.5)


@dataclass(frozen=True)
class Pacing:
    """The backoff between a transfer's attempts: its policy, and the clock,
    sleep and random draws it runs on (an engine test hands in a virtual
    clock whose sleep only moves it, so deadlines are exact and instant)."""

    policy: RetryPolicy = field(default_factory=lambda: PULL_RETRY)
    now: Callable[[], float] = time.monotonic
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    draw: Callable[[], float] = random.random


async def within(timeout_s: float, items: AsyncIterator[T]) -> AsyncIterator[T]:
    """``items``, the whole of which must come within ``timeout_s`` (else
    TimeoutError). The deadline is only ever enforced while the next item is
    made, never while the caller holds one: a timeout that cancelled the
    caller's task while it was sending a report (a servicer writing it to
    gRPC) would cancel the RPC's handler instead of ending the transfer with
    DEADLINE_EXCEEDED, and the client would hear nothing until its own
    deadline."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    iterator = aiter(items)
    while True:
        async with asyncio.timeout_at(deadline):
            try:
                item = await anext(iterator)
            except StopAsyncIteration:
                return
        yield item
