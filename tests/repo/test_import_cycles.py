"""No import cycles anywhere in ``kvmap``: in the graph of its modules that
grimp builds (as ``lint-imports`` reads the source roots: core, daemon,
client, tools and the generated ``kvmap.v1``), no strongly connected
component holds more than one module; and a cycle planted in a copy of the
sources is found and named.

Every import counts, the lazy ones inside functions (the CLI and the bench
import some modules only when a command needs them) and those under
``TYPE_CHECKING`` included: each is a dependency of the importing module all
the same, and a cycle is no easier to follow for being hidden in a function
body. Only a package's implicit import of its ``__init__`` is not an edge.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOTS: list[str] = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"][
    "setuptools"
]["packages"]["find"]["where"]

# Runs in a fresh interpreter whose PYTHONPATH holds one tree's source roots,
# so that a copy of the sources is read instead of the installed package.
_GRAPH_SCRIPT = """
import json, grimp
graph = grimp.build_graph("kvmap", cache_dir=None)
print(json.dumps({m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}))
"""


def import_graph(tree: Path) -> dict[str, list[str]]:
    """Each module of ``kvmap`` under ``tree`` and the modules it imports."""
    out = subprocess.run(
        [sys.executable, "-c", _GRAPH_SCRIPT],
        cwd=tree, capture_output=True, text=True, timeout=120, check=False,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(str(tree / r) for r in ROOTS)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    graph: dict[str, list[str]] = json.loads(out.stdout)
    return graph


def cycles(graph: Mapping[str, Sequence[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, each
    sorted (Tarjan's algorithm, iterative: the graph has ~200 modules and
    chains deeper than a comfortable recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        work = [(root, iter(graph.get(root, ())))]
        while work:
            node, edges = work[-1]
            step = next((m for m in edges if m not in index or m in stack), None)
            if step is not None and step not in index:
                index[step] = low[step] = len(index)
                stack.append(step)
                work.append((step, iter(graph.get(step, ()))))
                continue
            if step is not None:
                low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = stack[stack.index(node) :]
                del stack[stack.index(node) :]
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def test_the_cycle_finder_finds_exactly_the_cycles() -> None:
    """The finder reports a two-module and a three-module cycle, each once and
    sorted, and nothing for a chain, a diamond or a module importing a
    module outside the graph."""
    graph = {
        "a": ["b"],
        "b": ["a", "c"],
        "c": ["d"],
        "d": ["e", "f"],
        "e": ["g"],
        "f": ["g"],
        "g": ["outside"],
        "x": ["y"],
        "y": ["z"],
        "z": ["x", "a"],
    }
    assert cycles(graph) == [["a", "b"], ["x", "y", "z"]]
    assert cycles({k: v for k, v in graph.items() if k not in ("b", "z")}) == []


def test_kvmap_has_no_import_cycles() -> None:
    """No module of kvmap reaches itself through its imports; the failure
    names the modules of each cycle."""
    graph = import_graph(REPO)
    assert "kvmap.tools.bench.runner" in graph and "kvmap.core.planner" in graph
    assert cycles(graph) == []


@pytest.mark.parametrize(
    ("module", "planted", "cycle"),
    [
        (
            "tools/kvmap/tools/bench/pod.py",
            "from kvmap.tools.bench import runner",
            ["kvmap.tools.bench.pod", "kvmap.tools.bench.runner"],
        ),
        (
            # A lazy import inside a function counts as much as one at the top.
            "core/kvmap/core/geometry.py",
            "def _late() -> None:\n    from kvmap.core import planner",
            ["kvmap.core.geometry", "kvmap.core.planner"],
        ),
    ],
)
def test_a_planted_import_makes_a_cycle_that_is_found(
    tmp_path: Path, module: str, planted: str, cycle: list[str]
) -> None:
    """One import appended to a copy of one module closes a cycle, and the
    check finds exactly that cycle."""
    tree = tmp_path / "tree"
    for root in ROOTS:
        shutil.copytree(
            REPO / root, tree / root, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
    with (tree / module).open("a", encoding="utf-8") as f:
        f.write(f"\n\n{planted}\n")
    assert cycles(import_graph(tree)) == [cycle]
