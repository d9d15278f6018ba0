"""Drives NIXL from the daemon's own loop instead of UCX's progress thread
(which spins a whole core): polls posted transfers and incoming
notifications on the NIXL thread, fast while anything is in flight and
slowly when idle."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import structlog

from kvmap.daemon.adapters.nixl_port import NixlPort, Xfer, XferState
from kvmap.daemon.adapters.nixl_thread import NixlRunner

log = structlog.get_logger("kvmapd.progress")

BUSY_INTERVAL_S = 0.0002
IDLE_INTERVAL_S = 0.01


class Progress:
    def __init__(
        self,
        agent: NixlPort,
        nixl: NixlRunner,
        on_notifs: Callable[[dict[str, list[bytes]]], None],
        busy: Callable[[], bool],
    ) -> None:
        self._agent = agent
        self._nixl = nixl
        self._on_notifs = on_notifs
        self._busy = busy
        self._watched: dict[int, tuple[Xfer, asyncio.Future[XferState]]] = {}
        # A wake since the last pass, and the pause it ends (if one is on).
        self._woken = False
        self._waiter: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="nixl-progress")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for _, fut in self._watched.values():
            if not fut.done():
                fut.cancel()
        self._watched.clear()

    def watch(self, xfer: Xfer) -> asyncio.Future[XferState]:
        fut: asyncio.Future[XferState] = asyncio.get_running_loop().create_future()
        self._watched[id(xfer)] = (xfer, fut)
        self.wake()
        return fut

    def wake(self) -> None:
        """Start a pass now and poll at the busy pace: a peer is about to
        move bytes through this agent (a lease began), and UCX moves them
        only while this side calls in. Waiting out the idle interval would
        add up to that interval to the peer's transfer."""
        self._woken = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def forget(self, xfer: Xfer) -> None:
        self._watched.pop(id(xfer), None)

    def _tick(self) -> tuple[dict[int, XferState], dict[str, list[bytes]]]:
        """Runs on the NIXL thread: one progress pass."""
        states = {key: self._agent.poll(x) for key, (x, _) in list(self._watched.items())}
        return states, self._agent.take_notifs()

    async def _run(self) -> None:
        while True:
            try:
                states, notifs = await self._nixl(self._tick)
            except Exception:
                log.exception("progress_tick_failed")
                states, notifs = {}, {}
            for key, state in states.items():
                if state is XferState.PROC:
                    continue
                entry = self._watched.pop(key, None)
                if entry is not None and not entry[1].done():
                    entry[1].set_result(state)
            if notifs:
                self._on_notifs(notifs)
            busy = bool(self._watched) or self._busy()
            self._woken = False
            await self._pause(BUSY_INTERVAL_S if busy else IDLE_INTERVAL_S)

    async def _pause(self, seconds: float) -> None:
        """Until ``wake`` or ``seconds`` pass: one future and one timer.
        ``asyncio.wait_for`` on an event starts and cancels a task per pass,
        thousands of passes a second while busy, on the loop every pull
        shares (measured: docs/benchmarks.md, "Per-pull CPU")."""
        if self._woken:
            return
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(seconds, _settle, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None


def _settle(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
