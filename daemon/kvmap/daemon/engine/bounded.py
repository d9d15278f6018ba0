"""Bounded building blocks for state that requests create: a least-recently
used map with a stated size, and single-flight work per key with a stated
limit on how much may be in flight at once.

Targets, workers and layer selections come from requests, so nothing keyed
by them may grow without bound, and one slow key must not hold up others.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kvmap.core.errors import ResourceExhausted

K = TypeVar("K")
V = TypeVar("V")


class Lru(Generic[K, V]):
    """A map of at most ``size`` entries; ``put`` returns the entries it
    evicted (least recently used first) for the caller to release."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"an LRU needs room for one entry, not {size}")
        self.size = size
        self._items: OrderedDict[K, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[K]:
        return iter(list(self._items))

    def get(self, key: K) -> V | None:
        """The entry (now the most recently used), or None."""
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def peek(self, key: K) -> V | None:
        """The entry, without counting as a use."""
        return self._items.get(key)

    def put(self, key: K, value: V) -> list[tuple[K, V]]:
        self._items[key] = value
        self._items.move_to_end(key)
        evicted = []
        while len(self._items) > self.size:
            evicted.append(self._items.popitem(last=False))
        return evicted

    def pop(self, key: K) -> V | None:
        return self._items.pop(key, None)


@dataclass
class _Flight(Generic[V]):
    task: asyncio.Task[V]
    waiters: int = 0


class SingleFlight(Generic[K, V]):
    """At most one run of the work per key at a time: callers asking for a
    key already in flight share its result (or its error; nothing is kept
    once it finishes, so a failure is retried by the next caller). At most
    ``limit`` keys are in flight: the next is refused with RESOURCE_EXHAUSTED
    naming ``what`` and the limit. A run whose callers all gave up
    (cancelled, timed out) is cancelled, so it frees its slot."""

    def __init__(self, limit: int, what: str) -> None:
        self.limit = limit
        self._what = what
        self._flights: dict[K, _Flight[V]] = {}

    def __len__(self) -> int:
        return len(self._flights)

    async def run(self, key: K, work: Callable[[], Coroutine[Any, Any, V]]) -> V:
        flight = self._flights.get(key)
        if flight is None:
            if len(self._flights) >= self.limit:
                raise ResourceExhausted(
                    f"{self.limit} {self._what} in flight (the limit); retry later"
                )
            flight = _Flight(asyncio.get_running_loop().create_task(work()))
            self._flights[key] = flight
            flight.task.add_done_callback(lambda _: self._landed(key, flight))
        flight.waiters += 1
        try:
            # Shielded: one caller giving up does not cancel the others' run.
            return await asyncio.shield(flight.task)
        finally:
            flight.waiters -= 1
            if flight.waiters == 0 and not flight.task.done():
                # Forgotten now, not when the cancellation lands: a caller
                # arriving meanwhile starts a run of its own.
                self._forget(key, flight)
                flight.task.cancel()

    def _forget(self, key: K, flight: _Flight[V]) -> None:
        if self._flights.get(key) is flight:
            del self._flights[key]

    def _landed(self, key: K, flight: _Flight[V]) -> None:
        self._forget(key, flight)
        if not flight.task.cancelled():
            # Retrieved by its callers; marked retrieved for the case where
            # every caller left just as it failed.
            flight.task.exception()
