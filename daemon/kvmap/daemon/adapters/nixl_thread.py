"""The one thread every NIXL call runs on. The agent is not documented as
thread-safe, and a single thread also orders registration against posting."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

T = TypeVar("T")


class NixlRunner(Protocol):
    """Runs a callable on the NIXL thread."""

    def __call__(self, fn: Callable[[], T], /) -> Awaitable[T]: ...


class NixlThread:
    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nixl")

    async def __call__(self, fn: Callable[[], T], /) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
