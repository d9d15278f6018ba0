"""kvmapd starts NIXL's UCX backend without UCX's memory hooks (which cost
every agent ~0.4 s of CPU at start, on a restart's gap), unless the
operator set ``UCX_MEM_EVENTS`` already; the harness gives every process it
starts the same setting."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvmap.daemon.adapters.nixl_loader import UCX_MEMORY_EVENTS, disable_ucx_memory_events
from kvmap.tools.launch import local_env


def test_memory_events_are_off_unless_the_operator_set_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Unset, the variable becomes ``no`` before UCX reads it; an operator's
    own value (here ``yes``) is left as it is."""
    monkeypatch.delenv(UCX_MEMORY_EVENTS, raising=False)
    disable_ucx_memory_events()
    assert os.environ[UCX_MEMORY_EVENTS] == "no"
    monkeypatch.setenv(UCX_MEMORY_EVENTS, "yes")
    disable_ucx_memory_events()
    assert os.environ[UCX_MEMORY_EVENTS] == "yes"


def test_processes_the_harness_starts_get_the_daemons_setting(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Daemons, workers, raw NIXL agents and vLLM engines started through
    ``launch.local_env`` run UCX as kvmapd does (and on loopback only),
    unless the environment already says otherwise."""
    monkeypatch.delenv(UCX_MEMORY_EVENTS, raising=False)
    env = local_env(tmp_path)
    assert env[UCX_MEMORY_EVENTS] == "no" and env["UCX_NET_DEVICES"] == "lo"
    monkeypatch.setenv(UCX_MEMORY_EVENTS, "yes")
    assert local_env(tmp_path)[UCX_MEMORY_EVENTS] == "yes"
