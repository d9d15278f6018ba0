"""A replan is stored before it is published (``DaemonApp`` over the fake
NIXL and a real SQLite store): the stored row carries the new planner and
generation, and a store that cannot take the write leaves the worker on its
old plan, with nothing of the attempt left behind."""

from __future__ import annotations

import pytest
from harness import cluster, run
from structlog.testing import capture_logs

pytestmark = pytest.mark.timeout(60)


def test_a_replan_is_stored_with_its_generation() -> None:
    """After a replan the stored row and the stored generation counter are the new plan's, so a
    restarted daemon (which seeds its counters from them) never issues that number again."""

    async def main() -> None:
        async with cluster() as c:
            a = await c.node("a")
            w = c.worker("w")
            await a.register(w)
            (new,) = await a.app.replan("baseline")
            (row,) = a.app.store.workers()
            assert (row.planner, row.generation) == ("baseline", new.generation) == ("baseline", 2)
            assert a.app.store.generations()[w.key] == 2

    run(main())


def test_a_replan_the_store_refuses_keeps_the_old_plan() -> None:
    """With the store read-only, a replan changes no worker: the table still holds the old record
    (its generation, its live descriptor list), the new list is released, the store row is the
    old one, and the refusal is logged as an error naming the worker."""

    async def main() -> None:
        async with cluster() as c:
            a = await c.node("a")
            w = c.worker("w")
            old = await a.register(w)
            a.app.store._db.execute("PRAGMA query_only=1")
            with capture_logs() as logs:
                done = await a.app.replan("baseline")
            a.app.store._db.execute("PRAGMA query_only=0")
            assert done == [] and a.app.table.get(w.key) is old
            assert a.agent.live_dlists == (old.local_dlist,) and not old.local_dlist.released
            (row,) = a.app.store.workers()
            assert (row.planner, row.generation) == ("coalesce", 1)
            (refusal,) = [e for e in logs if e["event"] == "replan_not_stored"]
            assert refusal["log_level"] == "error" and refusal["worker"] == str(w.key)

    run(main())
