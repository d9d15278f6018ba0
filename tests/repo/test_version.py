"""The daemon's version constant (kvmap.daemon.version, which the daemon
reports instead of asking importlib.metadata at start) is pyproject.toml's,
and the installed package's where kvmap is installed."""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

import pytest

from kvmap.daemon.version import VERSION

ROOT = Path(__file__).resolve().parents[2]


def test_the_version_constant_is_pyprojects() -> None:
    """A release bumps pyproject.toml's version: the constant must follow."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["version"] == VERSION


def test_the_version_constant_is_the_installed_packages() -> None:
    """What pip installed says the same (CI installs kvmap before the tests)."""
    try:
        installed = metadata.version("kvmap")
    except metadata.PackageNotFoundError:  # a source tree without an install
        pytest.skip("kvmap is not installed here")
    assert installed == VERSION
