"""The progress loop's pause (one future and one timer, not a task per
pass): it ends on ``wake`` rather than after its interval, stopping the loop
mid-pause leaves no timer or waiter behind, and a transfer watched during an
idle pause is polled at once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from kvmap.daemon.adapters.nixl_port import Xfer, XferOp, XferState
from kvmap.daemon.engine import progress
from kvmap.daemon.engine.progress import Progress

pytestmark = pytest.mark.timeout(30)
T = TypeVar("T")


class Agent:
    """The two calls a pass makes; counts passes and lets a test await one."""

    def __init__(self) -> None:
        self.passes = 0
        self.passed = asyncio.Event()

    def poll(self, xfer: Xfer) -> XferState:
        return xfer.state

    def take_notifs(self) -> dict[str, list[bytes]]:
        self.passes += 1
        self.passed.set()
        return {}


async def inline(fn: Callable[[], T]) -> T:
    return fn()


def xfer() -> Xfer:
    return Xfer(XferOp.READ, "peer", 1, 0.0, object())


def loop_with(agent: Agent, busy: Callable[[], bool] = lambda: False) -> Progress:
    fake: Any = agent
    return Progress(fake, inline, on_notifs=lambda notifs: None, busy=busy)


def test_wake_ends_an_idle_pause_and_stop_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With an idle interval far longer than the test, only ``wake`` can
    start the next pass; ``stop`` in mid-pause cancels its timer and ends the
    loop's task, and a watched transfer's future is cancelled with it."""
    monkeypatch.setattr(progress, "IDLE_INTERVAL_S", 3600.0)

    async def main() -> None:
        agent = Agent()
        p = loop_with(agent)
        p.start()
        await agent.passed.wait()  # the first pass, then an hour's pause
        for n in (2, 3):
            agent.passed.clear()
            p.wake()
            await agent.passed.wait()
            assert agent.passes == n
        loop = asyncio.get_running_loop()
        pending = p.watch(x := xfer())
        await p.stop()
        assert pending.cancelled() and x.state is XferState.PROC
        assert p._waiter is None
        timers = [h for h in getattr(loop, "_scheduled", []) if not h.cancelled()]
        assert timers == []

    asyncio.run(main())


def test_a_watched_transfer_is_seen_done(monkeypatch: pytest.MonkeyPatch) -> None:
    """A transfer watched during an idle pause is polled at once and its
    future resolves with the state NIXL reports."""
    monkeypatch.setattr(progress, "IDLE_INTERVAL_S", 3600.0)

    async def main() -> None:
        agent = Agent()
        p = loop_with(agent)
        p.start()
        await agent.passed.wait()
        x = xfer()
        x.state = XferState.DONE
        assert await p.watch(x) is XferState.DONE
        await p.stop()

    asyncio.run(main())
