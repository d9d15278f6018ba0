"""The one thread every NIXL call runs on. The agent is not documented as
thread-safe, and a single thread also orders registration against posting.

The thread also runs the progress pump (``engine.progress``) between calls,
at the pump's own pace: UCX moves bytes only while an agent is called into,
so passes come thousands of times a second while transfers are in flight.
A pass that finds nothing stays on this thread; waking the event loop for
every pass (a future, a self-pipe write and an epoll wake per pass, on both
threads) cost more CPU per pull than the pass itself (moving the passes
here, with the parsing and planning changes made beside it, took the
decode daemon's event loop from ~2.2 to ~1.4 ms a pull at 32 in flight).

Its queue is a ``Mailbox``, not a ``queue.SimpleQueue``: CPython 3.11's and
3.12's ``SimpleQueue.get(timeout=...)`` can block until the next ``put``
however short its timeout (below), and between pulls nothing else is put:
the pump stopped, and a pull in flight waited out its whole deadline."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import structlog

T = TypeVar("T")

log = structlog.get_logger("kvmapd.nixl_thread")

# A pump pass: runs on the NIXL thread, returns the seconds until the next.
Pump = Callable[[], float]


class NixlRunner(Protocol):
    """Runs a callable on the NIXL thread."""

    def __call__(self, fn: Callable[[], T], /) -> Awaitable[T]: ...


class _Job:
    __slots__ = ("fn", "future", "loop")

    def __init__(
        self, fn: Callable[[], Any], future: asyncio.Future[Any], loop: asyncio.AbstractEventLoop
    ) -> None:
        self.fn, self.future, self.loop = fn, future, loop


# Queue items that are not calls: run a pump pass now; end the thread.
_WAKE = object()
_STOP = object()


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return  # its caller stopped waiting; what the call did stands
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class Mailbox:
    """A queue with one reader whose timed wait returns in time.

    ``queue.SimpleQueue.get(timeout=t)`` in CPython 3.11 and 3.12 takes its
    lock first and then recomputes the time left; when the queue is still
    empty and ``t`` has run out by then (a wait of a few microseconds, a
    preemption, a signal handler), the time left is negative, and a negative
    timeout means "wait forever": the reader sleeps until the next ``put``.
    The NIXL thread waits this way between pump passes, thousands of times a
    second, and with one transfer in flight no ``put`` comes until the
    transfer's deadline (seen as pulls ending "no completion in 30.0s"
    in 3 of 7 long bench runs; none in 8 with this mailbox).
    Here the items sit in a deque and a plain lock is the doorbell:
    ``Lock.acquire(timeout=...)`` stops at a negative time left."""

    def __init__(self) -> None:
        self._items: collections.deque[object] = collections.deque()
        # Held while nobody has rung; ``put`` releases it, ``get`` takes it.
        self._bell = threading.Lock()
        self._bell.acquire()

    def put(self, item: object) -> None:
        """From any thread."""
        self._items.append(item)
        with contextlib.suppress(RuntimeError):  # rung already, not yet heard
            self._bell.release()

    def get(self, timeout: float | None = None) -> object | None:
        """The oldest item; None once ``timeout`` seconds passed without one
        (None: wait as long as it takes). The reader's thread only, so an
        item seen here is still there to take. A ring may be stale (its
        item was taken without waiting): the wait goes on for the time
        left. No context managers: the NIXL thread waits here thousands of
        times a second."""
        items = self._items
        if not items:
            if timeout is None:
                while not items:
                    self._bell.acquire()
            elif timeout > 0:
                deadline = time.monotonic() + timeout
                left = timeout
                while not items and self._bell.acquire(timeout=left):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
            if not items:
                return None
        return items.popleft()

    def __len__(self) -> int:
        return len(self._items)


class NixlThread:
    def __init__(self) -> None:
        self._jobs = Mailbox()
        self._pump: Pump | None = None
        self._due = 0.0  # time.monotonic() of the next pump pass
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        # The call or pump pass running now: (time.monotonic() it started,
        # its name), (0.0, "") between them. One tuple, so that the event
        # loop reads both halves of the same call (``tell_if_stuck``).
        self._running: tuple[float, str] = (0.0, "")
        self._told = 0.0  # the start of the call last logged as stuck

    def __call__(self, fn: Callable[[], T], /) -> Awaitable[T]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._started()
        self._jobs.put(_Job(fn, future, loop))
        return future

    def set_pump(self, pump: Pump | None) -> None:
        """Run ``pump`` between calls, first at once, then each time the
        seconds it returned have passed (None: no more passes)."""
        self._pump = pump
        self._due = 0.0
        self.wake()

    def wake(self) -> None:
        """A pump pass as soon as the call now running (if any) returns."""
        self._started()
        self._jobs.put(_WAKE)

    def tell_if_stuck(self, limit_s: float) -> None:
        """From the event loop: a NIXL call (or progress pass) that has run
        ``limit_s`` or more is logged once, with the NIXL thread's stack.
        While it runs no other NIXL call and no progress pass does, so every
        transfer of the daemon waits; the stack says in which NIXL call."""
        started, name = self._running
        held_s = time.monotonic() - started
        if not started or started == self._told or held_s < limit_s:
            return
        self._told = started
        thread = self._thread
        frame = sys._current_frames().get(thread.ident) if thread and thread.ident else None
        stack = "".join(traceback.format_stack(frame)[-6:]) if frame is not None else ""
        log.warning(
            "nixl_call_slow",
            call=name,
            after_s=round(held_s, 1),
            stack=stack,
        )

    def shutdown(self) -> None:
        """Finish the calls already queued, then end the thread."""
        self._pump = None
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(_STOP)
            thread.join()

    def _started(self) -> None:
        if self._thread is not None:
            return
        with self._lock:
            if self._thread is None:
                # A daemon thread, so that a runner never shut down cannot
                # hold the interpreter open; shutdown() joins it.
                self._thread = threading.Thread(target=self._main, name="nixl_0", daemon=True)
                self._thread.start()

    def _main(self) -> None:
        jobs = self._jobs
        while True:
            item = self._next(jobs)
            if item is _STOP:
                return
            if isinstance(item, _Job):
                self._run(item)
            elif item is _WAKE:
                self._due = 0.0
            pump = self._pump
            if pump is not None and time.monotonic() >= self._due:
                self._running = (time.monotonic(), "progress pass")
                self._due = time.monotonic() + self._pass(pump)
                self._running = (0.0, "")

    def _next(self, jobs: Mailbox) -> object:
        """The next queued item; None (a plain pump turn) when none came
        before the next pass is due."""
        if self._pump is None:
            return jobs.get()
        return jobs.get(timeout=max(0.0, self._due - time.monotonic()))

    def _run(self, job: _Job) -> None:
        if job.future.cancelled():
            return  # as an executor does: a call nobody awaits any more is not started
        result: Any = None
        error: BaseException | None = None
        self._running = (time.monotonic(), _name(job.fn))
        try:
            result = job.fn()
        except BaseException as err:  # handed to the awaiting caller
            error = err
        # Over before its caller hears of it: the loop never finds a call
        # that has returned still running (tell_if_stuck).
        self._running = (0.0, "")
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is left to tell
            job.loop.call_soon_threadsafe(_settle, job.future, result, error)

    @staticmethod
    def _pass(pump: Pump) -> float:
        try:
            return pump()
        except Exception:
            log.exception("progress_pass_failed")
            return 0.01


def _name(fn: Callable[[], Any]) -> str:
    """What a queued call is, for a log line (``Posting.post_and_wait.<locals>.post``)."""
    inner = getattr(fn, "func", fn)  # a functools.partial's function
    return str(getattr(inner, "__qualname__", None) or type(inner).__name__)
