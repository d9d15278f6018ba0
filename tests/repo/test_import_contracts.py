"""The import-linter contracts of pyproject.toml (run by ``.ci/check``) hold
on the tree, and each one breaks when the import it forbids is planted in a
copy of the sources."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = REPO / "pyproject.toml"
ROOTS = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["tool"]["setuptools"]["packages"][
    "find"
]["where"]
CONTRACTS = {
    c["id"]: c["name"]
    for c in tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["tool"]["importlinter"][
        "contracts"
    ]
}
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
# An import against the way the layers point closes a circle too (the layer
# below already imports the one above's importer), so it also breaks this one.
CYCLES = "no-import-cycles"


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Python files of every source root, as the package is laid out."""
    copy = tmp_path_factory.mktemp("sources")
    for root in ROOTS:
        for path in (REPO / root).rglob("*.py"):
            target = copy / path.relative_to(REPO)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
    return copy


def _lint(tree: Path) -> tuple[int, dict[str, str]]:
    """lint-imports' exit status and each contract's verdict (KEPT / BROKEN)."""
    out = subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", str(PYPROJECT)],
        cwd=tree, capture_output=True, text=True, timeout=120, check=False,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(str(tree / r) for r in ROOTS)},
    )  # fmt: skip
    verdicts = {}
    for line in out.stdout.splitlines():
        for cid, name in CONTRACTS.items():
            if line.startswith(f"{name} "):
                # "NAME KEPT", or "NAME KEPT (1 ignored import)"
                verdicts[cid] = line[len(name) :].split()[0]
    assert set(verdicts) == set(CONTRACTS), out.stdout + out.stderr
    return out.returncode, verdicts


def test_contracts_cover_the_layer_rules() -> None:
    """pyproject.toml declares the nine contracts of docs/architecture.md's
    import rules: removing one fails here, not silently."""
    assert set(CONTRACTS) == {
        "daemon-layers",
        "engine-speaks-domain",
        "engine-builds-no-adapters",
        "core-is-pure",
        "daemon-stands-alone",
        "tracing-stands-alone",
        "opentelemetry-in-one-module",
        "client-uses-core-only",
        CYCLES,
    }


def test_the_sources_keep_every_contract(sources: Path) -> None:
    """The unmodified copy of the sources keeps every contract, so each
    failure below is the planted import's doing."""
    status, verdicts = _lint(sources)
    assert (status, set(verdicts.values())) == (0, {"KEPT"}), verdicts


@pytest.mark.parametrize(
    ("module", "planted", "broken"),
    [
        ("core/kvmap/core/geometry.py", "import grpc", {"core-is-pure"}),
        ("core/kvmap/core/geometry.py", "import nixl", {"core-is-pure", "daemon-stands-alone"}),
        (
            "core/kvmap/core/errors.py",
            "from kvmap.daemon.engine import app",
            # The client, the adapters and kvmap.tracing import the core's
            # errors, so they now reach the engine too.
            {
                "core-is-pure",
                "client-uses-core-only",
                "daemon-layers",
                "tracing-stands-alone",
                CYCLES,
            },
        ),
        (
            "core/kvmap/core/geometry.py",
            "import kvmap.client.errors",
            # The daemon imports the core, so it now reaches the client too.
            {"core-is-pure", "daemon-stands-alone", CYCLES},
        ),
        ("core/kvmap/core/geometry.py", "import vllm", {"core-is-pure", "daemon-stands-alone"}),
        (
            "daemon/kvmap/daemon/adapters/logs.py",
            "import kvmap.daemon.api.rpc",
            {"daemon-layers", CYCLES},
        ),
        (
            "daemon/kvmap/daemon/engine/leases.py",
            "import kvmap.tools.launch",
            {"daemon-stands-alone", CYCLES},
        ),
        ("daemon/kvmap/daemon/adapters/memory.py", "import torch", {"daemon-stands-alone"}),
        # The engine reads no message and makes no call: the api's wire
        # modules convert, the adapters call.
        (
            "daemon/kvmap/daemon/engine/leases.py",
            "from kvmap.v1 import types_pb2",
            {"engine-speaks-domain"},
        ),
        ("daemon/kvmap/daemon/engine/workers.py", "import grpc", {"engine-speaks-domain"}),
        # The engine takes its NIXL agent from bootstrap, never makes one.
        (
            "daemon/kvmap/daemon/engine/app.py",
            "from kvmap.daemon.adapters.nixl_agent import NixlAgent",
            {"engine-builds-no-adapters"},
        ),
        # bootstrap is above the api: the api reaching up to it is a
        # layer broken, and a circle (bootstrap imports api.server).
        (
            "daemon/kvmap/daemon/api/rpc.py",
            "import kvmap.daemon.bootstrap",
            {"daemon-layers", CYCLES},
        ),
        ("daemon/kvmap/daemon/adapters/nixl_agent.py", "import nixl", {"daemon-stands-alone"}),
        ("daemon/kvmap/daemon/api/rpc.py", "import kvmap.client.errors", {"daemon-stands-alone"}),
        (
            "client/kvmap/client/errors.py",
            "import kvmap.daemon.engine.app",
            {"client-uses-core-only"},
        ),
        (
            "client/kvmap/client/errors.py",
            "import kvmap.tools.launch",
            {"client-uses-core-only", CYCLES},
        ),
        (
            "daemon/kvmap/daemon/engine/transfers.py",
            "import opentelemetry.trace",
            {"opentelemetry-in-one-module"},
        ),
        (
            "client/kvmap/client/connector/traces.py",
            "from opentelemetry import trace",
            {"opentelemetry-in-one-module"},
        ),
        (
            "core/kvmap/tracing/__init__.py",
            "import kvmap.client.errors",
            # The daemon imports kvmap.tracing, so it now reaches the client
            # too; and the client imports kvmap.tracing: a circle.
            {"tracing-stands-alone", "daemon-stands-alone", CYCLES},
        ),
        # The bench's pod and runner, as they were before the runner's split.
        ("tools/kvmap/tools/bench/pod.py", "from kvmap.tools.bench import runner", {CYCLES}),
        # No module cycle (profiles imports only the core), but the package
        # kvmap.tools.bench and the module kvmap.tools.launch, siblings,
        # would import each other.
        ("tools/kvmap/tools/launch.py", "import kvmap.tools.bench.profiles", {CYCLES}),
    ],
)
def test_a_planted_import_breaks_its_contract(
    sources: Path, tmp_path: Path, module: str, planted: str, broken: set[str]
) -> None:
    """One forbidden import appended to one module makes lint-imports fail and
    breaks exactly the contracts that forbid it (directly or through the
    modules that import that one), and no other."""
    tree = tmp_path / "tree"
    shutil.copytree(sources, tree)
    with (tree / module).open("a", encoding="utf-8") as f:
        f.write(f"\n{planted}\n")
    status, verdicts = _lint(tree)
    assert status != 0
    assert {cid for cid, v in verdicts.items() if v == "BROKEN"} == broken
