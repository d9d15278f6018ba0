"""The repository stands on its own: no file points at something outside it.

A clone is all a reader, a CI runner or a container build has. References to
a sibling folder of the checkout (the ``shared`` folder beside it), to absolute paths of one machine
(``/work/...``) or to documents that are not in the tree are dead links for
everyone else. Scans every file of the checkout (tracked, and new files git
does not ignore) and names each offending file and line.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# This file spells out the references it rejects, as examples.
SELF = Path(__file__).resolve().relative_to(REPO).as_posix()

# A path that starts with ../ as a token of its own: after a space, a quote,
# a backtick, a bracket or "=", not inside a longer path ("$(dirname "$0")/../..")
# or an ellipsis (".../bin/kvmapd"), whose start this scan cannot know.
_PARENT_PATH = re.compile(r"(?<![\w./$~-])((?:\.\./)+[\w.\-/]*)")
# Spelled in two parts so that this file does not itself hold the reference
# it rejects (repository-wide greps for it stay quiet).
SIBLING = "../" + "shared"
_SIBLING_SHARED = re.compile(re.escape(SIBLING) + r"\b")
# Absolute paths of the machine the project was developed on.
_MACHINE_PATH = re.compile(r"(?<![\w.])/work(?:/|\b)")
# Markdown files named anywhere (docs/vllm.md, README.md, DESIGN.md).
_MARKDOWN_NAME = re.compile(r"(?<![\w.\-/])((?:\.{1,2}/)*[\w\-][\w.\-/]*\.md)\b")
# Markdown links and images: [text](target) / ![alt](target).
_MARKDOWN_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)")
# A Python name quoted in a document: `kvmap.core.planner.PLANNERS`.
# kvmap.v1.* also names gRPC services (kvmap.v1.Registry): not checked.
_QUOTED_MODULE = re.compile(r"`(kvmap(?:\.(?!v1\b)[A-Za-z_]\w*)+)`")
# A repository path quoted in a document: `core/kvmap/core/planner.py`.
_QUOTED_PATH = re.compile(r"`((?:\.ci|client|daemon|deploy|docs|protos|tests|tools)/[^`\s]*)`")


def checkout_files() -> list[str]:
    """Tracked files and new files git does not ignore, as a clone would hold
    them once committed."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True, timeout=60,
    )  # fmt: skip
    names = out.stdout.decode().split("\0")
    return sorted(n for n in names if n and (REPO / n).is_file())


def _inside(path: Path) -> bool:
    return Path(os.path.normpath(path)).is_relative_to(REPO)


def _markdown_exists(name: str, here: Path, basenames: set[str]) -> bool:
    if "/" not in name:
        return name in basenames
    return any(Path(os.path.normpath(base / name)).is_file() for base in (here, REPO))


def _module_source(dotted: str) -> str | None:
    """The source of module or package ``dotted`` in a source root; "" for a
    namespace folder; None when there is none."""
    for root in ("core", "daemon", "client", "protos/gen", "tools"):
        base = REPO / root / dotted.replace(".", "/")
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate.read_text(encoding="utf-8")
        if base.is_dir():
            return ""
    return None


def _python_name_exists(dotted: str) -> bool:
    """``dotted`` is a kvmap module, or a module followed by one name that
    the module defines (a class, function or assignment at any indentation)
    or imports (a re-export, such as a documented module path kept for a
    module that moved)."""
    if _module_source(dotted) is not None:
        return True
    module, _, attr = dotted.rpartition(".")
    source = _module_source(module)
    if not source:
        return False
    definition = rf"^\s*(?:(?:async\s+)?def|class)\s+{attr}\b|^\s*{attr}\s*[:=]"
    return re.search(definition, source, re.MULTILINE) is not None or attr in _imported(source)


def _imported(source: str) -> set[str]:
    """The names a module's import statements bind."""
    return {
        alias.asname or alias.name.split(".")[0]
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }


def _leaving(line: str, here: Path) -> Iterator[str]:
    """Why each reference of ``line`` (in a file of folder ``here``) leaves
    the repository."""
    if _SIBLING_SHARED.search(line):
        yield f"refers to {SIBLING}, outside the repository: {line.strip()}"
    if _MACHINE_PATH.search(line):
        yield f"absolute /work path of one machine: {line.strip()}"
    for target in _PARENT_PATH.findall(line):
        if not _inside(here / target):
            yield f"{target} resolves outside the repository"


def _dangling_in_markdown(line: str, here: Path) -> Iterator[str]:
    """Why each link, quoted path or quoted module of a markdown ``line``
    points at nothing in the repository."""
    for target in _MARKDOWN_LINK.findall(line):
        if target.startswith("/"):
            yield f"link {target} is an absolute path"
        elif "://" not in target and not target.startswith("mailto:"):
            if not _inside(here / target):
                yield f"link {target} resolves outside the repository"
            elif not (here / target).exists():
                yield f"link {target} points at nothing in the repository"
    for quoted in _QUOTED_PATH.findall(line):
        # ``tests/x.py::test_name`` (a pytest node id): the file and the test in it.
        path, _, test = quoted.partition("::")
        if not any(REPO.glob(path.rstrip("/"))):
            yield f"{quoted} is not in the repository"
        elif test and f"def {test}(" not in (REPO / path).read_text():
            yield f"{quoted}: {path} defines no {test}"
    for dotted in _QUOTED_MODULE.findall(line):
        if not _python_name_exists(dotted):
            yield f"{dotted} is not a module, or a name defined in one, of kvmap"


def leaks(name: str, text: str, basenames: set[str]) -> Iterator[str]:
    """``file:line: why`` for every reference of ``text`` (the contents of the
    repository file ``name``) that leaves the repository or, in a markdown
    file, points at nothing in it."""
    here = (REPO / name).parent
    markdown = name.endswith(".md")
    for number, line in enumerate(text.splitlines(), start=1):
        found = list(_leaving(line, here))
        if markdown:
            found += _dangling_in_markdown(line, here)
        found += (
            f"names {doc}, which is not in the repository"
            for doc in _MARKDOWN_NAME.findall(line)
            if not _markdown_exists(doc, here, basenames)
        )
        yield from (f"{name}:{number}: {why}" for why in found)


def _read(name: str) -> str | None:
    try:
        return (REPO / name).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None  # images, the binary API image: no text references


def test_no_file_refers_outside_the_repository() -> None:
    """No file of the checkout refers to the sibling shared folder, to /work paths, to a ../
    path or markdown link that leaves the repository, or to a .md document
    the repository does not hold, and no markdown file links to or quotes a
    path or kvmap module that does not exist; the failure lists file:line
    and why."""
    files = checkout_files()
    basenames = {Path(n).name for n in files}
    found = [
        leak
        for name in files
        if name != SELF and (text := _read(name)) is not None
        for leak in leaks(name, text, basenames)
    ]
    assert found == [], "\n".join(found)


@pytest.mark.parametrize(
    ("name", "line"),
    [
        # The README's line before the architecture moved into docs/.
        ("README.md", f"`{SIBLING}/DESIGN.md` for the architecture and the coalescing rules."),
        ("docs/benchmarks.md", f"(vLLM PR 60851, `{SIBLING}/reference/vllm-pr-60851.txt`:"),
        ("tools/kvmap/tools/bench/profiles.py", f"# {SIBLING}/reference/vllm-pr-60851.txt"),
        ("core/kvmap/core/planner.py", "applies the coalescing rules of DESIGN.md:"),
        ("README.md", "See [the design](../DESIGN.md)."),
        ("docs/gpu.md", "See [the notes](../../notes/gpu.md)."),
        ("docs/gpu.md", "Logs are in /work/main/.venv/logs."),
        ("docs/gpu.md", "Run ../../outside/script.sh first."),
        ("README.md", "Examples: [docs/examples](docs/examples/glm53-rank.json)."),
        ("docs/benchmarks.md", "Defined in `daemon/bench/profiles.py`, each with its source:"),
        ("docs/load.md", "Planners live in `kvmap.daemon.planner` (`PLANNERS`)."),
        ("docs/load.md", "Every planner in `kvmap.core.planner.PLANERS`."),
    ],
)
def test_catches_references_that_leave_the_repository(name: str, line: str) -> None:
    """Each kind of reference that leaves the repository is reported, among
    them the README's former pointer to DESIGN.md in the sibling shared folder."""
    basenames = {Path(n).name for n in checkout_files()}
    assert list(leaks(name, line, basenames)), line


@pytest.mark.parametrize(
    ("name", "line"),
    [
        ("deploy/k8s/base/deployment.yaml", "# See ../README.md for the reasoning."),
        ("deploy/k8s/overlays/decode/kustomization.yaml", "  - ../../base"),
        ("tests/gpu/run_on_device.sh", 'root=$(cd "$(dirname "$0")/../.." && pwd)'),
        ("tests/deploy/test_upgrade_script.py", '# "python .../kvmapd serve ..."'),
        ("README.md", "All options: [docs/vllm.md](docs/vllm.md), https://example.com/x.md"),
        ("docs/gpu.md", "See [the README](../README.md) and /tmp/kvmap-0/kvmapd.sock."),
        ("README.md", "- `protos/kvmap/v1/*.proto` and `deploy/k8s/` and `tests/unit/`"),
        ("README.md", "`kvmap.core.planner.PLANNERS`, `kvmap.tools`, `kvmap.v1.Peer`"),
        # A name a module re-exports (the connector's documented module path).
        ("docs/vllm.md", "`kvmap.client.vllm_connector.KVMapConnector`"),
    ],
)
def test_accepts_references_inside_the_repository(name: str, line: str) -> None:
    """References that stay inside the repository (kustomize bases, paths
    relative to a script, URLs, /tmp paths) are not reported."""
    basenames = {Path(n).name for n in checkout_files()}
    assert list(leaks(name, line, basenames)) == []
