"""Drives NIXL from the daemon's own NIXL thread instead of UCX's progress
thread (which spins a whole core): a pump on that thread polls posted
transfers and takes incoming notifications, fast while this daemon's own
transfers are in flight, less often while peers read from it (``pace``),
slowly when idle, and wakes the event loop only for a pass that found
something (a finished transfer, a notification)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import structlog

from kvmap.core.errors import KvmapError
from kvmap.daemon.adapters.nixl_port import NixlPort, Xfer, XferState
from kvmap.daemon.adapters.nixl_thread import NixlThread

log = structlog.get_logger("kvmapd.progress")

# While this daemon's own transfers are posted: it polls them for completion.
BUSY_INTERVAL_S = 0.0002
# While a peer holds a lease on this daemon's memory and none of its own
# transfers is posted: the peer's read needs this side's UCX only now and
# then (its notification at the end, the protocol messages UCX sends
# between the two agents), and polling it at the busy pace cost the owner
# daemon twice the CPU per pull for no pull that ended sooner (its threads
# 0.96-1.00 ms a pull at 32 in flight, against 0.44-0.49 ms at this pace).
LEASE_INTERVAL_S = 0.001
IDLE_INTERVAL_S = 0.01
# A transfer NIXL has not completed this long after its post is logged
# (once): a pull that then runs out of time says where it waited.
SLOW_TRANSFER_S = 5.0

Notifs = dict[str, list[bytes]]


def pace(*, watching: bool, leased: bool) -> float:
    """Seconds until the next pass: the busy pace while this daemon waits
    for transfers it posted, the lease pace while only peers read from it,
    the idle pace otherwise (a lease's ``wake`` starts a pass at once)."""
    if watching:
        return BUSY_INTERVAL_S
    return LEASE_INTERVAL_S if leased else IDLE_INTERVAL_S


class Progress:
    """``busy`` (whether a peer holds a lease) is called on the NIXL thread
    at every pass: it must be a cheap read that is safe from any thread
    (``len`` of a dict is)."""

    def __init__(
        self,
        agent: NixlPort,
        nixl: NixlThread,
        on_notifs: Callable[[Notifs], None],
        busy: Callable[[], bool],
    ) -> None:
        self._agent = agent
        self._nixl = nixl
        self._on_notifs = on_notifs
        self._busy = busy
        # Read by the pump on the NIXL thread, changed on the event loop.
        self._lock = threading.Lock()
        # Keyed by the transfer itself (an Xfer compares by identity), never
        # by its id(): a pass's results and the slow ones it told of hold
        # their transfers, so a new transfer cannot take an old one's place.
        self._watched: dict[Xfer, asyncio.Future[XferState]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        # Passes in a row whose notifications NIXL failed to give (NIXL
        # thread only): logged when a streak starts and when it ends.
        self._notif_failures = 0
        # Watched transfers already logged as slow (NIXL thread only).
        self._told_slow: set[Xfer] = set()
        # time.monotonic() of the last pass's start, 0.0 before the first
        # (written on the NIXL thread, read anywhere): a transfer that runs
        # out of time says whether the pump was still passing.
        self.last_pass = 0.0

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._nixl.set_pump(self._pass)

    async def stop(self) -> None:
        self._nixl.set_pump(None)
        with self._lock:
            watched, self._watched = self._watched, {}
        for fut in watched.values():
            if not fut.done():
                fut.cancel()

    def adopt(self, xfer: Xfer, fut: asyncio.Future[XferState]) -> None:
        """Watch ``xfer``, its state going to ``fut`` (made on the event
        loop); safe from any thread. The post calls it on the NIXL thread
        right after posting, so the pump's next pass polls the transfer
        without the event loop taking a turn in between: the loop is woken
        once per transfer, when it is over, not also to start watching it
        (on a busy machine that turn waited for a core)."""
        with self._lock:
            self._watched[xfer] = fut
        self._nixl.wake()

    def wake(self) -> None:
        """Start a pass now and poll at the lease pace from then on: a peer
        is about to move bytes through this agent (a lease began), and UCX
        answers the peer only while this side calls in. Waiting out the idle
        interval would add up to that interval to the peer's transfer."""
        self._nixl.wake()

    def watching(self, xfer: Xfer) -> bool:
        """Whether the pump polls ``xfer`` (it was watched and no pass has
        handed it over yet)."""
        with self._lock:
            return xfer in self._watched

    def forget(self, xfer: Xfer) -> None:
        with self._lock:
            self._watched.pop(xfer, None)

    def _pass(self) -> float:
        """Runs on the NIXL thread: one progress pass; the seconds until
        the next one."""
        with self._lock:
            watched = list(self._watched)
        finished: dict[Xfer, XferState] = {}
        now = self.last_pass = time.monotonic()
        for x in watched:
            x.polls += 1
            state = self._agent.poll(x)
            if state is not XferState.PROC:
                finished[x] = state
            elif now - x.posted_at > SLOW_TRANSFER_S and x not in self._told_slow:
                self._told_slow.add(x)
                self._tell_slow(x, now)
        if self._told_slow:  # only those still waited for
            self._told_slow.intersection_update(x for x in watched if x not in finished)
        notifs = self._take_notifs()
        loop = self._loop
        if (finished or notifs) and loop is not None:
            loop.call_soon_threadsafe(self._deliver, finished, notifs)
        return pace(watching=bool(watched), leased=self._busy())

    @staticmethod
    def _tell_slow(x: Xfer, now: float) -> None:
        log.warning(
            "transfer_slow",
            op=x.op.value,
            peer_agent=x.remote_agent,
            descriptors=x.num_descs,
            after_s=round(now - x.posted_at, 1),
        )

    def _take_notifs(self) -> Notifs:
        """This pass's notifications; none when NIXL fails to give them.
        Such a failure must not lose the pass's finished transfers: their
        waiters would wait out their deadlines while the bytes are in place."""
        try:
            notifs = self._agent.take_notifs()
        except KvmapError as err:
            if not self._notif_failures:
                log.warning("take_notifs_failed", error=str(err))
            self._notif_failures += 1
            return {}
        if self._notif_failures:
            log.info("take_notifs_back", failed_passes=self._notif_failures)
            self._notif_failures = 0
        return notifs

    def _deliver(self, finished: dict[Xfer, XferState], notifs: Notifs) -> None:
        """On the event loop: what a pass found (a transfer forgotten since,
        its waiter gone, is skipped)."""
        for x, state in finished.items():
            with self._lock:
                fut = self._watched.pop(x, None)
            if fut is not None and not fut.done():
                fut.set_result(state)
        if notifs:
            self._on_notifs(notifs)
