"""Shared test hooks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvmap.tools import launch


@pytest.fixture(autouse=True)
def _reap_processes() -> Iterator[None]:
    """A test that fails halfway must not leave the daemons and workers it
    started running (they would load the machine for every later test).
    Processes of wider-scoped fixtures were started before the mark."""
    mark = launch.started_count()
    yield
    launch.kill_started(since=mark)
