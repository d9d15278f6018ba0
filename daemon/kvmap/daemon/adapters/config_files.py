"""Configuration from outside the process: the TOML file, CLI flags, the
runtime directory (``$XDG_RUNTIME_DIR``) and PEM files."""

from __future__ import annotations

import os
import tomllib
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from kvmap.core.config import DaemonConfig


def default_runtime_dir(uid: int | None = None) -> Path:
    """A per-user runtime directory: $XDG_RUNTIME_DIR/kvmap, else /tmp/kvmap-<uid>."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "kvmap"
    return Path(f"/tmp/kvmap-{os.getuid() if uid is None else uid}")


def load_config(path: str | None, overrides: dict[str, Any]) -> DaemonConfig:
    """Config file values, then every override that is not None."""
    known = {f.name for f in fields(DaemonConfig)}
    values: dict[str, Any] = {}
    if path:
        with open(path, "rb") as f:
            data = tomllib.load(f)
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"{path}: unknown keys {sorted(unknown)} (known: {sorted(known)})")
        values.update(data)
        values["config_file"] = path
    values.update({k: v for k, v in overrides.items() if v is not None and k in known})
    if not values.get("socket"):
        values["socket"] = str(default_runtime_dir() / "kvmapd.sock")
    return replace(DaemonConfig(), **values).validated()


def read_pem(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
