"""A NIXL call that holds the NIXL thread (and with it every transfer of
the daemon) is logged once, from the event loop, with the thread's stack:
where a pull that then runs out of time was held."""

from __future__ import annotations

import asyncio
import threading

from structlog.testing import capture_logs

from kvmap.daemon.adapters.nixl_thread import NixlThread


def held_in_nixl(gate: threading.Event) -> str:
    """Stands in for a NIXL call that does not return until ``gate`` is set."""
    gate.wait(10.0)
    return "returned"


def quick_call() -> int:
    """A NIXL call that returns at once."""
    return 2


def test_a_call_that_holds_the_nixl_thread_is_logged_once_with_its_stack() -> None:
    """A call running past the limit is logged once (however often the loop
    asks), naming the call and showing the frame it is held in; a call that
    returns in time, and the thread when idle, are not logged."""

    async def main() -> None:
        nixl = NixlThread()
        try:
            assert await nixl(lambda: 1) == 1
            gate = threading.Event()
            with capture_logs() as logs:
                nixl.tell_if_stuck(0.0)  # idle: nothing runs
                call = asyncio.ensure_future(nixl(lambda: held_in_nixl(gate)))
                for _ in range(500):  # until the held call has run 0.2 s
                    nixl.tell_if_stuck(0.2)
                    if logs:
                        break
                    await asyncio.sleep(0.01)
                for _ in range(5):  # asked again: already told
                    nixl.tell_if_stuck(0.2)
                    await asyncio.sleep(0.02)
                gate.set()
                assert await call == "returned"
                quick = await nixl(quick_call)
                nixl.tell_if_stuck(0.0)  # a call that returned is not running
            slow = [e for e in logs if e["event"] == "nixl_call_slow"]
            assert quick == 2 and len(slow) == 1, logs
            assert "test_a_call_that_holds" in slow[0]["call"]
            assert slow[0]["after_s"] >= 0.2
            assert "held_in_nixl" in slow[0]["stack"] and "gate.wait" in slow[0]["stack"]
        finally:
            nixl.shutdown()

    asyncio.run(main())
