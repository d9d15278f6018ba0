"""End to end on a GPU: two daemons and two GPU workers, scattered pulls
verified byte for byte, under both planners (``kvmap.tools.gpu_demo``, at
a small geometry; tests/gpu/run_on_device.sh runs it at scale).

Skipped, with the reason, where there is no CUDA GPU, driver or NIXL."""

from __future__ import annotations

import subprocess
import sys

import pytest
from cuda_env import REASON, nixl_skip_reason

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.integration,
    pytest.mark.skipif(bool(REASON), reason=REASON or "-"),
    pytest.mark.timeout(300),
]


def test_gpu_pulls_verify_under_both_planners() -> None:
    """On a real GPU the GPU demo runs both planners and every pulled byte verifies."""
    if reason := nixl_skip_reason():
        pytest.skip(reason)
    args = [sys.executable, "-m", "kvmap.tools.gpu_demo", "--blocks", "96"]
    args += ["--block-tokens", "16", "--mla-layers", "6", "--indexer-layers", "3"]
    args += ["--requests", "3", "--no-release-check"]
    out = subprocess.run(args, check=False, capture_output=True, text=True, timeout=280)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-6000:]
    assert "kvmap GPU demo: every byte verified" in out.stdout
    for planner in ("baseline", "coalesce"):
        assert f"== planner {planner}" in out.stdout
