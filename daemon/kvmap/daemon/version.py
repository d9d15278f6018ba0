"""kvmap's version, as ``pyproject.toml`` gives it (tests/repo/test_version.py
keeps the two equal). A constant rather than ``importlib.metadata``: that
module costs ~25 ms to import, and every daemon's start paid it before it
was ready, and ~3 ms a look-up."""

VERSION = "0.1.0"
