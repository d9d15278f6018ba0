"""``kvmap.tools.gpu_demo``'s driver logic on CPU: the same daemons, pulls,
verification, notifications and report, with the CPU demo worker standing
in for the GPU worker, so a first run on a GPU machine fails only for GPU
reasons."""

from __future__ import annotations

from typing import Any

import pytest

from kvmap.tools import gpu_demo
from kvmap.tools.launch import DaemonProc, WorkerProc, start_worker

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def _cpu_worker(daemon: DaemonProc, engine_id: str, *extra: str, **_: Any) -> WorkerProc:
    args = list(extra)
    i = args.index("--device")
    del args[i : i + 2]  # the CPU worker has no --device
    return start_worker(daemon, engine_id, *args)


def test_both_planners_pull_verify_and_report(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    """The GPU demo, run with CPU workers in the GPU workers' place, verifies every byte under both
    planners, reports 432 vs 96 registered descriptors, skips the dead-worker check without
    nvidia-smi, and writes per-planner logs."""
    monkeypatch.setattr(gpu_demo, "start_gpu_worker", _cpu_worker)
    # No nvidia-smi: the memory figures and the dead-worker check are skipped.
    monkeypatch.setattr(gpu_demo, "gpu_memory_mib", lambda uuid: (None, {}))
    rc = gpu_demo.main(
        ["--blocks", "48", "--block-tokens", "16", "--mla-layers", "6", "--indexer-layers", "3",
         "--requests", "3", "--logs", str(tmp_path / "logs")]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "kvmap GPU demo: every byte verified" in out
    assert "dead-worker check skipped" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line[:3] == "  b"}
    rows.update({line.split()[0]: line.split() for line in out.splitlines() if line[:3] == "  c"})
    # Registered descriptors: 9 layers x 48 blocks vs 2 groups x 48 blocks.
    assert rows["baseline"][1] == "432" and rows["coalesce"][1] == "96"
    assert rows["baseline"][-1] == rows["coalesce"][-1] == "yes"
    assert {p.name for p in (tmp_path / "logs").iterdir()} == {"baseline", "coalesce"}
    assert any((tmp_path / "logs" / "coalesce").glob("prefill-*.log"))
