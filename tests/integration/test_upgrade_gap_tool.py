"""The upgrade-gap measurement (``python -m kvmap.tools.upgrade_gap``) runs
end to end with tiny settings and reports its figures; its numbers are
recorded in docs/upgrade.md, not asserted here (they depend on the machine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_upgrade_gap_reports_both_cases_with_no_failed_pull(tmp_path: Path) -> None:
    """Both restarts (SIGTERM, kill -9) are measured: each result has the gap, the old daemon's
    exit and the new one's start, the pull latency before and the latency added across the
    restart, at least one pull across the restart, recovery, and zero failed pulls (the decode
    daemon retried every pull that met the restart)."""
    out = tmp_path / "gap.json"
    run = subprocess.run(
        [sys.executable, "-m", "kvmap.tools.upgrade_gap", "--pulls-before", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    results = json.loads(out.read_text())
    assert [r["case"] for r in results] == ["SIGTERM", "kill -9"]
    for r in results:
        assert {"gap_s", "exit_s", "ready_s", "pull_s", "added_s"} <= r.keys(), r
        assert r["gap_s"] > 0 and r["pulls_across"] >= 1 and r["recovered"], r
        assert r["failed"] == 0, r
