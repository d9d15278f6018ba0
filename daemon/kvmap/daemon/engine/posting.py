"""Posting a planned transfer on the NIXL thread, waiting for NIXL to
complete it, and releasing its handles: the part of a transfer that talks
to NIXL (``engine.transfers`` runs the rest)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from kvmap.core.errors import KvmapError, TransferError
from kvmap.core.transfer_pieces import Side
from kvmap.core.transfer_plan import TransferPlan, run_dlist_rows
from kvmap.daemon.adapters.nixl_port import NixlPort, Xfer, XferOp, XferState
from kvmap.daemon.adapters.nixl_thread import NixlRunner
from kvmap.daemon.engine.prepared import Prepared
from kvmap.daemon.engine.progress import Progress
from kvmap.tracing import current


class Posting:
    """Every call it makes on the agent runs on the NIXL thread (``nixl``)."""

    def __init__(self, agent: NixlPort, nixl: NixlRunner, progress: Progress) -> None:
        self._agent = agent
        self._nixl = nixl
        self._progress = progress

    async def post_and_wait(
        self,
        prepared: Prepared,
        plan: TransferPlan,
        remote_agent: str,
        write: bool,
        stage: Callable[[str], None] = lambda now: None,
    ) -> tuple[list[Xfer], float, float]:
        """Post the plan's transfers and wait for them: the completed
        handles (the caller releases them), the post's and the wait's
        seconds (``stage`` hears which). Handles of a failed or cancelled
        wait are released here."""
        loop = asyncio.get_running_loop()
        # One per transfer a post can make (the prepared lists' and the
        # merged runs'): the post hands them to the pump on the NIXL thread.
        outcomes = [loop.create_future(), loop.create_future()]

        def post() -> tuple[list[Xfer], float]:
            start = time.perf_counter()
            xfers = self._post(prepared, plan, remote_agent, write)
            for x, outcome in zip(xfers, outcomes, strict=False):
                self._progress.adopt(x, outcome)
            return xfers, time.perf_counter() - start

        stage("posting it on the NIXL thread")
        with current().child("kvmap.post", descriptors=plan.descriptors):
            xfers, post_s = await self._posted(self._nixl(post))
        stage("waiting for NIXL to complete it")
        start = time.perf_counter()
        try:
            with current().child("kvmap.wait"):
                states = await asyncio.gather(*outcomes[: len(xfers)])
        except BaseException:
            # A deadline's message names the step it came in: say what the
            # pump knew of each transfer before they are released.
            stage(f"waiting for NIXL to complete it ({self._waited_on(xfers)})")
            await self.release(xfers, None)
            raise
        done_s = time.perf_counter() - start
        failed = [x for x, state in zip(xfers, states, strict=True) if state is not XferState.DONE]
        if failed:
            await self.release(xfers, None)
            raise failed[0].error or TransferError("NIXL reported a failed transfer", "ERR")
        return xfers, post_s, done_s

    def _waited_on(self, xfers: list[Xfer]) -> str:
        """What was known of transfers still waited for: NIXL reporting them
        in progress pass after pass, a pump that never polled them, or one
        that stopped passing (its last pass long ago)."""
        now = time.monotonic()
        last = self._progress.last_pass
        pump = f"the progress pump's last pass {now - last:.1f}s ago" if last else "no pass yet"
        return "; ".join(
            [
                f"{x.op.value} of {x.num_descs} descriptors posted {now - x.posted_at:.1f}s ago, "
                f"{x.state.value} after {x.polls} polls, "
                + ("still watched" if self._progress.watching(x) else "no longer watched")
                for x in xfers
            ]
            + [pump]
        )

    def _post(
        self, prepared: Prepared, plan: TransferPlan, remote_agent: str, write: bool
    ) -> list[Xfer]:
        """On the NIXL thread: post the plan's transfers. When the second
        post fails, the first transfer is released before the error goes
        up: nobody would hold its handle."""
        op = XferOp.WRITE if write else XferOp.READ
        xfers: list[Xfer] = []
        try:
            if len(plan.local_indices):
                if prepared.local_dlist is None or prepared.remote_dlist is None:
                    # Only piece-table plans index prepared lists.
                    raise RuntimeError("a token-mode plan indexes no prepared list")
                xfers.append(
                    self._agent.post_prepped(
                        op,
                        prepared.local_dlist,
                        plan.local_indices,
                        prepared.remote_dlist,
                        plan.remote_indices,
                    )
                )
            if len(plan.runs):
                xfers.append(
                    self._agent.post_descs(
                        op,
                        run_dlist_rows(plan, Side.LOCAL, prepared.local_mem[0]),
                        run_dlist_rows(plan, Side.REMOTE, prepared.remote_mem[0]),
                        remote_agent,
                        mem_type=prepared.local_mem[1],
                        remote_mem_type=prepared.remote_mem[1],
                    )
                )
        except BaseException:
            for x in xfers:
                with contextlib.suppress(KvmapError):
                    self._agent.release(x)
            raise
        return xfers

    async def _posted(
        self, posting: Awaitable[tuple[list[Xfer], float]]
    ) -> tuple[list[Xfer], float]:
        """The post's handles. A caller cancelled while the NIXL thread
        posts (its deadline; its owner refusing a pull read meanwhile) waits
        for the post to return and releases what it made: the transfers run
        on regardless, and handles nobody holds are never released."""
        job = asyncio.ensure_future(posting)
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            try:
                xfers, _ = await asyncio.shield(job)
            except BaseException:  # nothing was posted, or cancelled once more
                raise asyncio.CancelledError from None
            await self.release(xfers, None)
            raise

    async def release(self, xfers: list[Xfer], then: Callable[[], None] | None) -> None:
        """Release ``xfers`` (and run ``then``) in one NIXL call. Shielded: a
        pull cancelled meanwhile (its deadline) must not leave its handles
        behind."""
        for x in xfers:
            self._progress.forget(x)

        def release() -> None:
            for x in xfers:
                self._agent.release(x)
            if then is not None:
                then()

        await asyncio.shield(self._nixl(release))
