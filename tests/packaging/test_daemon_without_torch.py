"""kvmapd runs without torch and vLLM (the image has neither): its NIXL adapter
loads NIXL's CUDA-specific module directly, because ``import nixl`` imports
torch wherever the CPU torch wheel is installed, as it is in this environment.

Both tests run here, next to an installed torch, so that they fail the moment
anything on the daemon's path imports it again (``import nixl`` in the adapter
is the known way back): one real ``kvmapd serve`` process, read through
/proc, and one process that imports the daemon's entry point and moves bytes
between two real NIXL agents.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvmap.tools.launch import local_env, start_daemon

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

# The distributions the daemon must never load.
HEAVY = ("torch", "vllm")

# Imports what `kvmapd serve` imports, creates two real agents (UCX over
# loopback), READs 64 KiB from one into the other, checks every byte and
# prints the heavy top-level modules then loaded.
TRANSFER = r"""
import json, sys, time
import numpy as np
import kvmap.daemon.cli.kvmapd, kvmap.daemon.api.server
from kvmap.daemon.adapters.nixl_agent import NixlAgent, XferOp, XferState

n = 1 << 16
src = (np.arange(n) % 251).astype(np.uint8)
dst = np.zeros(n, dtype=np.uint8)
with NixlAgent.create("torchless-target") as target, NixlAgent.create("torchless-reader") as reader:
    target.register_dram(src.ctypes.data, n)
    reader.register_dram(dst.ctypes.data, n)
    peer = reader.add_remote(target.metadata())
    xfer = reader.post_descs(
        XferOp.READ, [[dst.ctypes.data, n, 0]], [[src.ctypes.data, n, 0]], peer
    )
    deadline = time.monotonic() + 60
    while reader.poll(xfer) is XferState.PROC and time.monotonic() < deadline:
        target.take_notifs()  # the target's side of UCX progress
    assert xfer.state is XferState.DONE, (xfer.state, xfer.error)
    assert (dst == src).all()
    reader.release(xfer)
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(sys.argv[1:]))
print(json.dumps({"heavy": heavy}))
"""


def _python(tmp_path: Path, code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter, as the daemon's tests run it
    (loopback UCX, temporary files in ``tmp_path``); it must exit 0."""
    out = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=tmp_path, env=local_env(tmp_path), capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def test_torch_is_installed_here() -> None:
    """The tests below prove something only where torch is importable (it is,
    in the environment .ci/setup makes): otherwise `import nixl` would not
    import it either."""
    assert importlib.util.find_spec("torch") is not None


def test_a_daemon_process_never_loads_torch(tmp_path: Path) -> None:
    """A real `kvmapd serve`, ready (its NIXL agent created), has mapped no
    torch or vLLM file into its memory."""
    daemon = start_daemon(tmp_path / "daemon")
    try:
        maps = Path(f"/proc/{daemon.proc.pid}/maps").read_text()
    finally:
        daemon.stop()
    assert "nixl" in maps  # the agent is there...
    loaded = {name for name in HEAVY if f"/{name}/" in maps}
    assert loaded == set()  # ...and nothing of torch's


def test_nixl_transfers_without_importing_torch(tmp_path: Path) -> None:
    """A process that imports the daemon's entry point, creates two real NIXL
    agents and completes a READ between them (every byte checked) has imported
    neither torch nor vLLM."""
    out = _python(tmp_path, TRANSFER, *HEAVY)
    assert json.loads(out.stdout.splitlines()[-1]) == {"heavy": []}


def test_the_adapter_picks_the_package_import_nixl_picks(tmp_path: Path) -> None:
    """The CUDA-specific package the adapter loads is the one NIXL's own meta
    package chooses here (which imports torch to choose it): the same bindings."""
    code = (
        "import nixl\n"
        "from kvmap.daemon.adapters.nixl_loader import nixl_module\n"
        "print(nixl._api.__name__, nixl_module('_api').__name__)\n"
    )
    out = _python(tmp_path, code)
    by_nixl, by_adapter = out.stdout.split()
    assert by_adapter == by_nixl


# Imports the daemon's entry point, logs an exception with the daemon's
# text renderer, and says whether rich was imported.
RICH = r"""
import sys
import kvmap.daemon.cli.kvmapd
from kvmap.daemon.adapters.logs import configure_logging, log
configure_logging("text")
try:
    1 / 0
except ZeroDivisionError:
    log.exception("boom", worker="w0")
print("rich" if sys.modules.get("rich") is not None else "no rich", "structlog.dev" in sys.modules)
"""


def test_the_daemon_leaves_rich_unimported(tmp_path: Path) -> None:
    """rich (installed here, as vLLM's dependency; the image has none) is not
    imported by the daemon's entry point, although structlog imports it
    wherever it is installed (a sixth of a start, for tracebacks the daemon
    never draws with it); the daemon's text logs still render, an exception's
    traceback included."""
    assert importlib.util.find_spec("rich") is not None  # else this proves nothing
    out = _python(tmp_path, RICH)
    assert out.stdout.split() == ["no", "rich", "True"]
    assert "boom" in out.stderr and "worker=w0" in out.stderr, out.stderr
    assert "ZeroDivisionError: division by zero" in out.stderr, out.stderr
