"""Posting a plan on the NIXL thread (``engine.posting``), with a real NIXL
thread and progress pump and a stand-in agent (what is tested is who polls
a posted transfer and what a failed post leaves, not NIXL): the pump polls
a transfer from the moment it is posted, without waiting for the event loop
to take a turn, and a post that fails halfway releases what it made."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest

from kvmap.core.errors import TransferError
from kvmap.core.transfer_plan import TransferPlan
from kvmap.daemon.adapters.nixl_port import MemoryType, Xfer, XferOp, XferState
from kvmap.daemon.adapters.nixl_thread import NixlThread
from kvmap.daemon.engine.posting import Posting
from kvmap.daemon.engine.prepared import Prepared
from kvmap.daemon.engine.progress import Progress

pytestmark = pytest.mark.timeout(30)


class Agent:
    """The agent calls a post, a pass and a release make. A posted
    transfer stays in progress until ``finish``; ``polled`` is set when the
    pump first polls one."""

    def __init__(self, runs_fail: bool = False) -> None:
        self.runs_fail = runs_fail
        self.posted: list[Xfer] = []
        self.released: list[Xfer] = []
        self.polled = threading.Event()
        self.done = threading.Event()

    def post_prepped(self, op: XferOp, *_: Any) -> Xfer:
        x = Xfer(op, "owner", 1, 0.0, object())
        self.posted.append(x)
        return x

    def post_descs(self, op: XferOp, *_: Any, **__: Any) -> Xfer:
        if self.runs_fail:
            raise TransferError("the merged runs' post failed", "ERR")
        return self.post_prepped(op)

    def poll(self, xfer: Xfer) -> XferState:
        self.polled.set()
        return XferState.DONE if self.done.is_set() else XferState.PROC

    def take_notifs(self) -> dict[str, list[bytes]]:
        return {}

    def release(self, xfer: Xfer) -> None:
        self.released.append(xfer)


def plan(runs: int = 0) -> TransferPlan:
    return TransferPlan(
        local_indices=np.array([0, 1], dtype=np.int32),
        remote_indices=np.array([2, 3], dtype=np.int32),
        runs=np.array([[4096 * i, 8192 * i, 64] for i in range(runs)], dtype=np.int64).reshape(
            runs, 3
        ),
        blocks=2,
        bytes=128,
    )


def prepared() -> Prepared:
    lists: Any = object()  # the stand-in agent never looks at them
    dram = (0, MemoryType.DRAM)
    return Prepared(None, lists, lists, dram, dram, users=1)


def parts(agent: Agent) -> tuple[NixlThread, Progress, Posting]:
    fake: Any = agent
    nixl = NixlThread()
    pump = Progress(fake, nixl, on_notifs=lambda _: None, busy=lambda: False)
    pump.start()
    return nixl, pump, Posting(fake, nixl, pump)


def test_a_posted_transfer_is_polled_while_the_event_loop_is_busy() -> None:
    """The post hands its transfer to the pump on the NIXL thread: it is
    polled while the event loop is still busy with something else (here,
    blocked), and the pull's wait ends with the state the pump saw."""

    async def main() -> None:
        agent = Agent()
        nixl, pump, posting = parts(agent)
        moving = asyncio.ensure_future(posting.post_and_wait(prepared(), plan(), "owner", False))
        await asyncio.sleep(0)  # the post is queued on the NIXL thread
        # The loop takes no turn until this returns.
        polled_while_blocked = agent.polled.wait(5)
        agent.done.set()
        xfers, _, _ = await asyncio.wait_for(moving, 10)
        assert polled_while_blocked
        assert xfers == agent.posted and len(xfers) == 1
        assert agent.released == []  # the caller releases a completed transfer
        await pump.stop()
        nixl.shutdown()

    asyncio.run(main())


def test_a_post_that_fails_halfway_releases_what_it_made() -> None:
    """The merged runs' post fails after the prepared lists' transfer was
    posted: that transfer is released (nobody else holds its handle) and
    never polled again, and the caller gets the post's error."""

    async def main() -> None:
        agent = Agent(runs_fail=True)
        nixl, pump, posting = parts(agent)
        with pytest.raises(TransferError, match="merged runs"):
            await posting.post_and_wait(prepared(), plan(runs=2), "owner", False)
        assert len(agent.posted) == 1
        assert agent.released == agent.posted
        agent.polled.clear()
        pump.wake()
        await nixl(lambda: None)  # a call queued behind the wake: its pass ran
        assert not agent.polled.is_set()
        await pump.stop()
        nixl.shutdown()

    asyncio.run(main())


def test_a_wait_given_up_says_what_the_pump_knew_of_the_transfer() -> None:
    """A wait cancelled (its deadline) names, for each transfer, how many
    passes polled it and whether the pump still had it: a pump that never
    polled it reads differently from NIXL reporting it in progress."""

    async def main() -> None:
        agent = Agent()
        fake: Any = agent
        nixl = NixlThread()
        idle = Progress(fake, nixl, on_notifs=lambda _: None, busy=lambda: False)  # never started
        steps: list[str] = []
        waiting = Posting(fake, nixl, idle).post_and_wait(
            prepared(), plan(), "owner", False, steps.append
        )
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(waiting, 0.2)
        assert steps[-1].startswith("waiting for NIXL to complete it (READ of 1 descriptors ")
        assert steps[-1].endswith("ago, PROC after 0 polls, still watched; no pass yet)")
        assert agent.released == agent.posted  # released once given up
        nixl.shutdown()

    asyncio.run(main())
