"""pyproject.toml's packaging declarations match the source tree: a glob that
matches nothing ships nothing, and setuptools does not say so."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

from kvmap.tools import demo

REPO = Path(__file__).resolve().parents[2]


def _setuptools() -> Any:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"][
        "setuptools"
    ]


def _package_dirs(package: str) -> list[Path]:
    """The folders of ``package`` in the source roots (``packages.find.where``)."""
    roots = _setuptools()["packages"]["find"]["where"]
    dirs = [REPO / root / package.replace(".", "/") for root in roots]
    return [d for d in dirs if d.is_dir()]


def test_every_package_data_glob_matches_a_file() -> None:
    """Each [tool.setuptools.package-data] package lies in exactly one source
    root and each of its globs matches at least one file there."""
    package_data = _setuptools()["package-data"]
    assert package_data
    for package, globs in package_data.items():
        dirs = _package_dirs(package)
        assert len(dirs) == 1, f"{package}: found in {dirs}, expected one source root"
        for pattern in globs:
            assert list(dirs[0].glob(pattern)), f"{package}: {pattern!r} matches no file"


def test_every_top_level_package_declares_py_typed() -> None:
    """kvmap.core, kvmap.tracing, kvmap.daemon, kvmap.client, kvmap.tools
    and kvmap.v1 ship their py.typed marker, so users' type checkers read
    their annotations."""
    package_data = _setuptools()["package-data"]
    for package in (
        "kvmap.core", "kvmap.tracing", "kvmap.daemon", "kvmap.client", "kvmap.tools", "kvmap.v1",
    ):  # fmt: skip
        assert "py.typed" in package_data.get(package, []), package


def test_a_demo_without_the_bundled_example_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The demo's full-scale line comes from package data: an install that
    lacks the example prints why the line is missing, naming the file and
    the package, instead of leaving it out unexplained."""
    missing = tmp_path / "glm53-rank.json"
    monkeypatch.setattr(demo, "example_path", lambda name: missing)
    line = demo._full_scale()
    assert line.startswith("  full-scale GLM-5.3 rank: not shown, this install lacks"), line
    assert str(missing) in line and "kvmap.daemon.examples" in line
