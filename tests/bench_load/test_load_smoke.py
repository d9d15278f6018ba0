"""Smoke test of ``python -m kvmap.tools.load``: tiny N and M, real daemons; its figures
are all there and every pull verified. Not a performance test: no figure is
compared with a threshold."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SCRIPT_MODULE = "kvmap.tools.load"
FIGURES = [
    "wall_s", "pulls_per_s", "gb_per_s", "p50_ms", "p99_ms", "max_ms",
    "post_p50_ms", "post_p99_ms", "completion_p50_ms", "completion_p99_ms",
]  # fmt: skip


def test_load_script_reports_its_figures_and_verifies_every_pull() -> None:
    """The load script with 3 clients and 2 decode daemons completes and verifies every pull, the
    prefill daemon serves each pull plus one warm-up per client, and every reported figure is
    finite and positive, in its JSON and its table."""
    clients, pulls = 3, 4
    proc = subprocess.run(
        [
            sys.executable, "-m", SCRIPT_MODULE, "--clients", str(clients), "--pulls", str(pulls),
            "--decode-daemons", "2", "--blocks-per-pull", "4", "--prefill-blocks", "32",
            "--block-tokens", "16", "--decode-planner", "baseline", "--json",
        ],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    out = proc.stdout.strip().splitlines()
    r = json.loads(out[-1])
    table = "\n".join(out[:-1])

    assert r["pulls"] == clients * pulls
    assert r["failed_pulls"] == 0 and r["first_error"] is None
    assert r["verified_pulls"] == clients * pulls
    assert r["bad_blocks"] == 0
    # Every pull plus one warm-up per client reached the prefill daemon.
    assert r["prefill_served"] == clients * (pulls + 1)
    # Two groups x 4 blocks, the MLA and indexer rows of 16 tokens.
    assert r["bytes_per_pull"] == 4 * 16 * (6 * 656 + 3 * 132)
    for name in FIGURES:
        assert isinstance(r[name], (int, float)) and math.isfinite(r[name]), (name, r[name])
        assert r[name] > 0, (name, r[name])
    assert r["p50_ms"] <= r["p99_ms"] <= r["max_ms"]
    assert r["machine"]["cpus"] >= 1 and r["machine"]["mem_gib"] > 0

    for words in ("pulls/s", "GB/s", "p50", "p99", "every pull verified"):
        assert words in table, table
