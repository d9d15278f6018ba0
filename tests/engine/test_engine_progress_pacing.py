"""The progress pump on the NIXL thread: passes run at the pump's pace
between NIXL calls, ``wake`` starts one at once, a pass that finds nothing
does not touch the event loop, a watched transfer is seen done, and ``stop``
ends the passes and cancels what was still watched."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import structlog

from kvmap.core.errors import TransferError
from kvmap.daemon.adapters.nixl_port import Xfer, XferOp, XferState
from kvmap.daemon.adapters.nixl_thread import NixlThread
from kvmap.daemon.engine import progress
from kvmap.daemon.engine.progress import Progress

pytestmark = pytest.mark.timeout(30)


class Agent:
    """The two calls a pass makes; counts passes (on the NIXL thread) and
    lets a test wait for the next one."""

    def __init__(self) -> None:
        self.passes = 0
        self.passed = threading.Event()
        self.notifs: dict[str, list[bytes]] = {}
        self.threads: set[str] = set()

    def poll(self, xfer: Xfer) -> XferState:
        return xfer.state

    def take_notifs(self) -> dict[str, list[bytes]]:
        self.threads.add(threading.current_thread().name)
        self.passes += 1
        self.passed.set()
        notifs, self.notifs = self.notifs, {}
        return notifs


def xfer() -> Xfer:
    return Xfer(XferOp.READ, "peer", 1, 0.0, object())


async def next_pass(agent: Agent) -> None:
    agent.passed.clear()
    await asyncio.to_thread(agent.passed.wait, 10)


def watch(p: Progress, x: Xfer) -> asyncio.Future[XferState]:
    """Watch ``x`` as a post does (``Progress.adopt``), from the event loop."""
    fut: asyncio.Future[XferState] = asyncio.get_running_loop().create_future()
    p.adopt(x, fut)
    return fut


def pump_for(agent: Agent, nixl: NixlThread, received: list[Any] | None = None) -> Progress:
    fake: Any = agent
    sink = received if received is not None else []
    return Progress(fake, nixl, on_notifs=sink.append, busy=lambda: False)


def test_wake_runs_a_pass_during_an_idle_pause_and_stop_ends_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With an idle interval far longer than the test, only ``wake`` can
    start the next pass; after ``stop`` no pass runs (a wake is then only a
    queued no-op) and a watched transfer's future is cancelled."""
    monkeypatch.setattr(progress, "IDLE_INTERVAL_S", 3600.0)

    async def main() -> None:
        agent, nixl = Agent(), NixlThread()
        p = pump_for(agent, nixl)
        p.start()
        # A call queued behind start's wake returns once its pass ran (the
        # queue is FIFO and a wake's pass runs before the next item).
        first = await nixl(lambda: agent.passes)
        assert first >= 1
        for n in (1, 2):
            p.wake()
            assert await nixl(lambda: agent.passes) == first + n
        pending = watch(p, x := xfer())
        await p.stop()
        assert pending.cancelled() and x.state is XferState.PROC
        before = agent.passes
        p.wake()
        assert await nixl(lambda: agent.passes) == before  # a call after the wake: no pass ran
        assert agent.threads == {"nixl_0"}
        nixl.shutdown()

    asyncio.run(main())


def test_a_watched_transfer_is_seen_done_and_notifs_reach_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A transfer watched during an idle pause is polled at once and its
    future resolves with the state NIXL reports; notifications a pass takes
    reach ``on_notifs`` on the event loop's thread."""
    monkeypatch.setattr(progress, "IDLE_INTERVAL_S", 3600.0)

    async def main() -> None:
        agent, nixl = Agent(), NixlThread()
        received: list[Any] = []
        p = pump_for(agent, nixl, received)
        p.start()
        await next_pass(agent)
        x = xfer()
        x.state = XferState.DONE
        assert await watch(p, x) is XferState.DONE
        agent.notifs = {"peer": [b"done:1"]}
        p.wake()
        while not received:
            await asyncio.sleep(0.001)
        assert received == [{"peer": [b"done:1"]}]
        await p.stop()
        nixl.shutdown()

    asyncio.run(main())


def test_an_empty_pass_does_not_wake_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Busy passes that find nothing stay on the NIXL thread: the loop sees
    no callback from them (each would cost both threads a hop)."""
    monkeypatch.setattr(progress, "IDLE_INTERVAL_S", progress.BUSY_INTERVAL_S)

    async def main() -> None:
        agent, nixl = Agent(), NixlThread()
        p = pump_for(agent, nixl)
        loop = asyncio.get_running_loop()
        calls: list[object] = []
        real = loop.call_soon_threadsafe

        def counted(callback: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append(callback)
            return real(callback, *args, **kwargs)

        monkeypatch.setattr(loop, "call_soon_threadsafe", counted)
        p.start()
        while agent.passes < 50:
            await asyncio.sleep(0.002)
        delivered = [c for c in calls if getattr(c, "__func__", None) is Progress._deliver]
        assert delivered == []  # 50 passes, not one of them handed to the loop
        agent.notifs = {"peer": [b"x"]}
        while not delivered:  # the check above can fail: a pass with news is handed over
            await asyncio.sleep(0.002)
            delivered = [c for c in calls if getattr(c, "__func__", None) is Progress._deliver]
        await p.stop()
        nixl.shutdown()

    asyncio.run(main())


def test_a_call_nobody_awaits_any_more_is_not_started() -> None:
    """As with an executor: a call cancelled before the NIXL thread reaches
    it never runs; one already queued behind it still does."""

    async def main() -> None:
        nixl = NixlThread()
        gate, ran = threading.Event(), []
        blocker = nixl(lambda: gate.wait(10))
        dropped = asyncio.ensure_future(nixl(lambda: ran.append("dropped")))
        kept = nixl(lambda: ran.append("kept"))
        dropped.cancel()
        gate.set()
        await blocker
        await kept
        assert ran == ["kept"]
        nixl.shutdown()

    asyncio.run(main())


class FailingNotifs(Agent):
    """An agent whose notifications NIXL fails to give (for ``failing``
    passes, then again as ever)."""

    def __init__(self, failing: int) -> None:
        super().__init__()
        self.failing = failing

    def take_notifs(self) -> dict[str, list[bytes]]:
        notifs = super().take_notifs()
        if self.passes <= self.failing:
            raise TransferError("take_notifs: NIXL_ERR_BACKEND: no", "NIXL_ERR_BACKEND")
        return notifs


def test_a_pass_whose_notifs_fail_still_hands_over_finished_transfers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NIXL failing to give notifications (every pass, for a while) does not
    keep a finished transfer from its waiter, which would otherwise wait out
    its deadline with its bytes in place; the failure is logged once per
    streak and notifications flow again when NIXL gives them."""
    monkeypatch.setattr(progress, "IDLE_INTERVAL_S", progress.BUSY_INTERVAL_S)

    async def main() -> None:
        agent, nixl = FailingNotifs(failing=10**9), NixlThread()
        received: list[Any] = []
        p = pump_for(agent, nixl, received)
        with structlog.testing.capture_logs() as logs:
            p.start()
            x = xfer()
            x.state = XferState.DONE
            assert await asyncio.wait_for(watch(p, x), 10) is XferState.DONE
            while agent.passes < 20:
                await asyncio.sleep(0.002)
            agent.failing = agent.passes  # NIXL gives them again from the next pass
            agent.notifs = {"peer": [b"done:1"]}
            while not received:
                await asyncio.sleep(0.002)
            await p.stop()
        nixl.shutdown()
        assert received == [{"peer": [b"done:1"]}]
        events = [e["event"] for e in logs if e["event"].startswith("take_notifs")]
        assert events == ["take_notifs_failed", "take_notifs_back"]

    asyncio.run(main())


class Stuck(Agent):
    """An agent whose transfers never complete."""

    def poll(self, xfer: Xfer) -> XferState:
        return XferState.PROC


def test_a_transfer_nixl_does_not_complete_is_logged_once_as_slow(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A watched transfer still in progress SLOW_TRANSFER_S after its post is logged
    once (``transfer_slow``, naming the peer agent and the descriptors) however many
    passes see it, and one posted just now is not."""
    monkeypatch.setattr(progress, "IDLE_INTERVAL_S", progress.BUSY_INTERVAL_S)

    async def main() -> None:
        agent, nixl = Stuck(), NixlThread()
        p = pump_for(agent, nixl)
        old = Xfer(
            XferOp.READ, "owner-agent", 7, time.monotonic() - progress.SLOW_TRANSFER_S - 1, object()
        )
        new = Xfer(XferOp.READ, "other-agent", 3, time.monotonic(), object())
        with structlog.testing.capture_logs() as logs:
            p.start()
            watch(p, old)
            watch(p, new)
            start = agent.passes
            while agent.passes < start + 50:
                await asyncio.sleep(0.002)
            await p.stop()
        nixl.shutdown()
        slow = [e for e in logs if e["event"] == "transfer_slow"]
        assert [(e["peer_agent"], e["descriptors"]) for e in slow] == [("owner-agent", 7)]

    asyncio.run(main())


def test_a_pass_result_for_a_forgotten_transfer_never_finishes_the_one_now_watched() -> None:
    """A pass saw transfer A done; before its result reached the loop A was
    forgotten (its waiter gave up) and B is watched (it could have reused
    A's ``id``, by which transfers were once filed). The result is A's, not
    B's: B's future stays pending, still watched, and a later pass that sees
    B done finishes it."""

    async def main() -> None:
        nixl = NixlThread()
        p = pump_for(Agent(), nixl)
        try:
            a, b = xfer(), xfer()
            b.state = XferState.PROC
            fut_b = watch(p, b)
            p._deliver({a: XferState.DONE}, {})  # A's result, A forgotten
            assert not fut_b.done() and b in p._watched
            p._deliver({b: XferState.DONE}, {})
            assert await asyncio.wait_for(fut_b, 5) is XferState.DONE
        finally:
            await p.stop()
            nixl.shutdown()

    asyncio.run(main())


def test_the_pace_follows_what_the_daemon_waits_for() -> None:
    """A pass polls again at the busy pace while this daemon's own transfer
    is watched (leases or not), at the lease pace while only a peer holds a
    lease, and at the idle pace when neither: the owner of a read does not
    spin at the reader's pace."""
    leased = [True]

    async def main() -> None:
        agent, nixl = Agent(), NixlThread()
        fake: Any = agent
        p = Progress(fake, nixl, on_notifs=lambda n: None, busy=lambda: leased[0])
        assert await nixl(p._pass) == progress.LEASE_INTERVAL_S
        x = xfer()
        pending = watch(p, x)
        assert await nixl(p._pass) == progress.BUSY_INTERVAL_S
        leased[0] = False
        assert await nixl(p._pass) == progress.BUSY_INTERVAL_S
        p.forget(x)
        pending.cancel()
        assert await nixl(p._pass) == progress.IDLE_INTERVAL_S
        nixl.shutdown()

    assert progress.BUSY_INTERVAL_S < progress.LEASE_INTERVAL_S < progress.IDLE_INTERVAL_S
    asyncio.run(main())
