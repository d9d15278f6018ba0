"""``python -m kvmap.tools.bench.copy_threads`` at a small size: a real owner
process and real NIXL agents, one per copy thread; every row is a copy whose
bytes were all checked against the source (not timed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ARGS = ("--mib", "8", "--threads", "1,2", "--repeats", "1")


def test_every_thread_count_copies_the_whole_buffer(tmp_path: Path) -> None:
    """One and two copy threads each read the whole 8 MiB buffer (the tool
    fails a round whose bytes differ from the owner's), and the JSON carries
    memcpy and one row per thread count, in the order asked."""
    out = tmp_path / "copy.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvmap.tools.bench.copy_threads", *ARGS, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=200,
        cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(out.read_text())
    assert rows[0]["variant"] == "memcpy, one thread" and rows[0]["gbps"] > 0
    copies = rows[1:]
    assert [r["threads"] for r in copies] == [1, 2]
    assert all(r["bytes"] == 8 << 20 and r["gbps"] > 0 for r in copies)
