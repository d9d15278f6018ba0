"""Shared test hooks: the Hypothesis profile (``hypothesis_profiles``),
each test's tier and whether it runs in the serial phase (``tiers``), the
zygotes the processes a test starts are forked from (``zygote``), and the
reaping of the processes a test started."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import hypothesis_profiles
import pytest
import tiers
import zygote

from kvmap.tools import launch

hypothesis_profiles.load_profile()
# Stand-in workers are forked from a zygote that imported them once: the
# suite starts hundreds, each ~2 CPU-s of imports otherwise.
zygote.install()

TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with its tier and, where it must run alone, ``serial``;
    a test marked with a second tier by hand is an error (``-m`` would run it
    in both). The longest files go first (``tiers.LONGEST_FIRST``)."""

    def path_of(item: pytest.Item) -> str:
        return Path(item.path).resolve().relative_to(TESTS).as_posix()

    items.sort(key=lambda item: tiers.start_rank(path_of(item)))
    for item in items:
        path = path_of(item)
        markers = {m.name for m in item.iter_markers()}
        tier = tiers.tier_of(path, markers)
        item.add_marker(tier)
        if tiers.is_serial(path, markers):
            item.add_marker("serial")
        marked = [name for name in tiers.TIERS if name in markers | {tier}]
        if marked != [tier]:
            raise pytest.UsageError(f"{item.nodeid}: tier {tier}, but marked {marked}")


# How much of each log a failed test shows: the end, where a hang or an
# error is, of the last few processes it started.
LOG_TAIL_CHARS = 6000
LOGS_SHOWN = 6


@pytest.fixture(autouse=True)
def _reap_processes(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that fails halfway must not leave the daemons and workers it
    started running (they would load the machine for every later test).
    Processes of wider-scoped fixtures were started before the mark."""
    mark = launch.started_count()
    request.node.stash[_STARTED_MARK] = mark
    yield
    launch.kill_started(since=mark)


_STARTED_MARK = pytest.StashKey[int]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item) -> Iterator[None]:
    """A failed test's report ends with the logs of the daemons and workers
    it started: a failure seen once in CI can be read from CI's output."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()  # type: ignore[attr-defined]
    mark = item.stash.get(_STARTED_MARK, None)
    if report.when != "call" or not report.failed or mark is None:
        return
    for path in launch.started_logs(since=mark)[-LOGS_SHOWN:]:
        try:
            text = path.read_text(errors="replace")
        except OSError as err:
            text = f"(unreadable: {err})"
        report.sections.append((f"log {path}", text[-LOG_TAIL_CHARS:]))
