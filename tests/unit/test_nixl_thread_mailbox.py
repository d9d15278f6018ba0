"""The NIXL thread's queue: items in order, a put from any thread wakes the
reader, and a timed wait returns once its time is up, also when the time
runs out while the wait is interrupted (the case in which CPython 3.11's
and 3.12's ``queue.SimpleQueue.get(timeout=...)`` waits until the next put:
the progress pump stopped between passes and a lone pull waited out its
deadline)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest

from kvmap.daemon.adapters.nixl_thread import Mailbox

# A SIGALRM interrupts the wait after 1 ms and its handler runs 20 ms: the
# 5 ms wait's time is up by the time the wait looks again.
INTERRUPTED_WAIT = """
import signal, time
signal.signal(signal.SIGALRM, lambda signum, frame: time.sleep(0.02))
signal.setitimer(signal.ITIMER_REAL, 0.001)
start = time.monotonic()
print(repr({wait}), round(time.monotonic() - start, 3))
"""


def _interrupted(setup: str, wait: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Run ``wait`` (an expression) in a fresh interpreter's main thread,
    interrupted as above; killed after ``timeout_s``."""
    code = textwrap.dedent(setup) + INTERRUPTED_WAIT.format(wait=wait)
    return subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=timeout_s
    )


def test_items_come_out_in_order_and_an_empty_wait_ends_when_its_time_is_up() -> None:
    """First in, first out; an empty mailbox answers None at once with no
    time to wait, and after (not before) the time given."""
    box = Mailbox()
    for item in ("a", "b", "c"):
        box.put(item)
    assert len(box) == 3
    assert [box.get(timeout=1.0) for _ in range(3)] == ["a", "b", "c"]
    assert box.get(timeout=0.0) is None
    start = time.monotonic()
    assert box.get(timeout=0.05) is None
    waited = time.monotonic() - start
    assert 0.05 <= waited < 2.0, waited


def test_a_put_from_another_thread_wakes_the_waiting_reader() -> None:
    """A put from a timer thread ends a long wait at once; a ring left over
    from an item taken without waiting neither loses nor invents an item."""
    box = Mailbox()
    box.put("stale")
    assert box.get() == "stale"  # its ring is still pending: heard, not lost
    threading.Timer(0.05, box.put, args=("job",)).start()
    start = time.monotonic()
    assert box.get(timeout=10.0) == "job"
    assert time.monotonic() - start < 5.0
    assert box.get(timeout=0.01) is None  # two rings, one item: no phantom


def test_a_wait_whose_time_runs_out_while_interrupted_returns() -> None:
    """The mailbox's own wait, and the NIXL thread's wait between pump passes
    (``NixlThread._next``, run here on the main thread, which a signal can
    interrupt), each return once the handler is done."""
    mailbox = _interrupted(
        "from kvmap.daemon.adapters.nixl_thread import Mailbox\nbox = Mailbox()",
        "box.get(timeout=0.005)",
        15.0,
    )
    assert mailbox.returncode == 0 and mailbox.stdout.startswith("None "), mailbox
    between_passes = _interrupted(
        """
        import time
        from kvmap.daemon.adapters.nixl_thread import NixlThread
        nixl = NixlThread()  # its thread is never started
        nixl._pump = lambda: 0.01
        nixl._due = time.monotonic() + 0.005
        """,
        "nixl._next(nixl._jobs)",
        15.0,
    )
    assert between_passes.returncode == 0, between_passes
    assert between_passes.stdout.startswith("None "), between_passes


@pytest.mark.skipif(sys.version_info >= (3, 13), reason="SimpleQueue was rewritten in 3.13")
def test_the_interrupted_wait_is_the_one_simple_queue_never_returns_from() -> None:
    """What the test above guards against, on this interpreter: the same
    interrupted wait on a ``queue.SimpleQueue`` sleeps until a put. (Tried
    three times: on a busy machine the signal may come before the wait.)"""
    outcomes = []
    for _ in range(3):
        try:
            outcomes.append(
                _interrupted("import queue\nq = queue.SimpleQueue()", "q.get(timeout=0.005)", 3.0)
            )
        except subprocess.TimeoutExpired:
            return
    pytest.fail(f"every interrupted SimpleQueue.get returned: {outcomes}")
