"""Configuration from outside the process: the TOML file, CLI flags, the
runtime directory (``$XDG_RUNTIME_DIR``) and PEM files.

Every mistake is one ``ValueError`` whose message names the key, where its
value came from (``--flag`` or ``key = value in FILE``) and the value:
``kvmapd`` prints it as its one line before exiting 2."""

from __future__ import annotations

import json
import os
import tomllib
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from kvmap.core.config import (
    DEPRECATED_KEYS,
    INTERNAL_FIELDS,
    KEY_OF_FIELD,
    DaemonConfig,
    check_types,
    config_keys,
    field_type,
)
from kvmap.core.errors import ConfigError
from kvmap.tracing import endpoint_from


def default_runtime_dir(uid: int | None = None) -> Path:
    """A per-user runtime directory: $XDG_RUNTIME_DIR/kvmap, else /tmp/kvmap-<uid>."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "kvmap"
    return Path(f"/tmp/kvmap-{os.getuid() if uid is None else uid}")


def load_config(
    path: str | None, overrides: dict[str, Any], notes: list[str] | None = None
) -> DaemonConfig:
    """Config file values, then every override (keyed by field name) that is
    not None. Deprecation lines go to ``notes``. Raises ValueError with one
    line naming the key, its source and its value."""
    values: dict[str, Any] = {}
    if path:
        values.update(_file_values(path, notes if notes is not None else []))
        values["config_file"] = path
    known = {f.name for f in fields(DaemonConfig)} - INTERNAL_FIELDS
    flags = {k: _split(k, v) for k, v in overrides.items() if v is not None and k in known}
    values.update(flags)
    values["flag_keys"] = tuple(KEY_OF_FIELD.get(k, k) for k in flags)
    if not values.get("socket"):
        values["socket"] = str(default_runtime_dir() / "kvmapd.sock")
    # Configured like any OTel service: the standard variables stand in for
    # the key, and OTEL_SDK_DISABLED=true turns tracing off.
    values["otlp_traces_endpoint"] = endpoint_from(
        values.get("otlp_traces_endpoint") or "", os.environ
    )
    try:
        check_types(values)
        return replace(DaemonConfig(), **values).validated()
    except ValueError as err:
        raise ValueError(explain(err, path or "", values["flag_keys"])) from None


def reload_config(running: DaemonConfig) -> DaemonConfig:
    """The running daemon's config file read again (SIGHUP), with the flags
    it was started with still winning. Raises ValueError like load_config."""
    names = config_keys()
    flags = {names[k]: getattr(running, names[k]) for k in running.flag_keys}
    return load_config(running.config_file, flags)


def _split(name: str, value: Any) -> Any:
    """A repeatable flag's values, each of which may list several, comma-
    separated (one environment variable can then carry a whole list)."""
    if not isinstance(value, list) or not field_type(name).startswith("tuple"):
        return value
    return [part.strip() for v in value for part in str(v).split(",") if part.strip()]


def _file_values(path: str, notes: list[str]) -> dict[str, Any]:
    """The file's keys as field names; unknown keys and syntax errors name the file."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{path}: not valid TOML: {err}") from None
    except OSError as err:
        raise ValueError(f"--config {path}: cannot read it: {err.strerror}") from None
    keys = config_keys()
    for old, new in DEPRECATED_KEYS.items():
        if old in data:
            if new in data:
                raise ValueError(f"{path}: both {old} and {new}: keep only {new}")
            notes.append(f"{path}: the key {old} is deprecated: call it {new} (the flag's name)")
            data[new] = data.pop(old)
    unknown = set(data) - set(keys)
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)} (known: {sorted(keys)})")
    return {keys[k]: v for k, v in data.items()}


def explain(err: ValueError, path: str, flag_keys: tuple[str, ...]) -> str:
    """``err``'s message with the source of the value it is about."""
    key = err.key if isinstance(err, ConfigError) else str(err).partition(":")[0]
    if key not in config_keys():
        return f"{path}: {err}" if path else str(err)
    if not isinstance(err, ConfigError):
        # "key: problem" from a rule of its own (the peer policy's parser):
        # name the flag, or the file the key is in.
        if key in flag_keys:
            return f"--{key.replace('_', '-')}{str(err)[len(key) :]}"
        return f"{path}: {err}" if path else str(err)
    value = show_value(err.value)
    if key in flag_keys:
        return f"--{key.replace('_', '-')} {value}: {err.problem}"
    if path:
        return f"{key} = {value} in {path}: {err.problem}"
    return f"{key} = {value} (the default): {err.problem}"


def show_value(value: object) -> str:
    """A value as the file spells it (strings quoted, lists bracketed)."""
    if isinstance(value, str | list | tuple | bool):
        return json.dumps(list(value) if isinstance(value, tuple) else value)
    return repr(value)


def read_pem(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
