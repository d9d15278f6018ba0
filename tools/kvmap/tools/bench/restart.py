"""Restart figures (``restart`` in the JSON): how long ``kvmapd serve``
takes until it serves, and what a SIGTERM upgrade of a prefill daemon
costs a decode worker that pulls from it in a loop
(``kvmap.tools.upgrade_gap``: the daemon restarted on its state dir and
port)."""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

from kvmap.tools import upgrade_gap
from kvmap.tools.bench.options import Options
from kvmap.tools.bench.results import Restart
from kvmap.tools.launch import start_daemon


def ready_seconds(workdir: Path) -> float:
    """One ``kvmapd serve`` from its start until its ready file is written
    (the file's own time: the harness polls for it less often)."""
    start = time.time()
    daemon = start_daemon(workdir, name="kvmapd")
    try:
        return os.stat(workdir / "kvmapd.ready").st_mtime - start
    finally:
        daemon.stop()


def measure_restart(opts: Options) -> Restart:
    samples: dict[str, list[float]] = {"ready": [], "unreachable": [], "added_pull": []}
    with tempfile.TemporaryDirectory(prefix="kvmap-bench-restart-") as tmp:
        for i in range(opts.restart_rounds):
            samples["ready"].append(ready_seconds(Path(tmp) / f"d{i}"))
    for _ in range(opts.restart_rounds):
        (gap,) = upgrade_gap.run_cases(("SIGTERM",), pulls_before=10)
        if gap["failed"] or not gap["recovered"]:
            raise RuntimeError(f"restart: pulls failed across the upgrade: {gap}")
        samples["unreachable"].append(float(gap["gap_s"]))
        samples["added_pull"].append(float(gap["added_s"]))
    result = Restart(
        ready_seconds=statistics.median(samples["ready"]),
        unreachable_seconds=statistics.median(samples["unreachable"]),
        added_pull_seconds=statistics.median(samples["added_pull"]),
        samples=samples,
    )
    opts.progress(
        f"restart: ready {result.ready_seconds:.3f} s, SIGTERM upgrade unreachable "
        f"{result.unreachable_seconds:.3f} s, pull latency added {result.added_pull_seconds:.3f} s"
    )
    return result
