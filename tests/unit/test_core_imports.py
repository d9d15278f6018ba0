"""The core stays pure: importing every module of kvmap.core loads no
grpc, nixl or torch (checked in a fresh interpreter, whose sys.modules holds
only what these imports pulled in)."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import kvmap.core

FORBIDDEN = ("grpc", "nixl", "torch")

# Imports the modules named on its command line, then prints the top-level
# packages that are loaded.
_PROBE = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
"""


def _forbidden_after_importing(modules: list[str]) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, *modules],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    loaded: list[str] = json.loads(out.stdout)
    return [name for name in loaded if name in FORBIDDEN]


def _core_modules() -> list[str]:
    return [info.name for info in pkgutil.walk_packages(kvmap.core.__path__, "kvmap.core.")]


def test_core_imports_no_grpc_nixl_or_torch() -> None:
    """Importing every module of kvmap.core in a fresh interpreter loads no grpc, nixl or
    torch module."""
    modules = _core_modules()
    assert "kvmap.core.errors" in modules
    assert _forbidden_after_importing(["kvmap.core", *modules]) == []


def test_the_probe_sees_a_grpc_import() -> None:
    """The import probe reports grpc for a module that does import it, so the purity check cannot
    pass by seeing nothing."""
    # The same probe on a module that does import grpc must report it, or the
    # check above could pass by seeing nothing.
    assert _forbidden_after_importing(["kvmap.daemon.adapters.grpc_codes"]) == ["grpc"]
