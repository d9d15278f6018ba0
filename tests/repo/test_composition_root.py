"""Only the daemon's composition root, ``kvmap.daemon.bootstrap``, builds
its adapters: no other module of ``kvmap.daemon`` above the adapters calls
an adapter's constructor or factory, so the engine and the api run on what
the root hands them (the engine's tests hand in fakes the same way).
Import-linter cannot say "does not construct"; the contract
``engine-builds-no-adapters`` keeps the engine off the adapters that exist
only to be built, and this test covers the rest (docs/architecture.md,
"The daemon's layers")."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DAEMON = REPO / "daemon" / "kvmap" / "daemon"
ROOT = DAEMON / "bootstrap.py"

# What builds an adapter: a call of one of these classes or functions, or
# any use of one of these factories (``partial(NixlAgent.create, ...)``).
CONSTRUCTORS = {
    "StateStore",
    "FdHandoffServer",
    "NixlThread",
    "PeerClient",
    "Metrics",
    "ShmImporter",
    "CudaIpcImporter",
    "SocketLock",
    "StateDirLock",
    "HalfOpenGuard",
    "Keepalive",
    "tracer_for",
}
FACTORIES = {("NixlAgent", "create"), ("PeerClient", "for_config")}


def _builds(path: Path) -> list[str]:
    """Each adapter ``path`` builds, as ``file:line name``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        name = ""
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            name = node.func.id if node.func.id in CONSTRUCTORS else ""
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            pair = (node.value.id, node.attr)
            name = ".".join(pair) if pair in FACTORIES else ""
        if name:
            found.append(f"{path.relative_to(REPO)}:{node.lineno} {name}")
    return found


def test_no_module_above_the_adapters_but_bootstrap_builds_one() -> None:
    """The cli, the api and the engine build no adapter (the adapters package may build its
    own parts, and bootstrap builds them all)."""
    adapters = DAEMON / "adapters"
    found = [
        hit
        for path in sorted(DAEMON.rglob("*.py"))
        if path != ROOT and adapters not in path.parents
        for hit in _builds(path)
    ]
    assert found == [], "\n".join(found)


def test_bootstrap_builds_every_adapter_this_test_looks_for() -> None:
    """Every constructor and factory the check above looks for is one bootstrap uses: a renamed
    adapter fails here rather than slipping past the check."""
    names = {hit.split()[-1] for hit in _builds(ROOT)}
    assert names == CONSTRUCTORS - {"PeerClient"} | {".".join(f) for f in FACTORIES}
