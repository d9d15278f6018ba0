"""What the sidecar's container runs (the kubelet's argv, the image user, the
ports it listens on) and the paths ``kvmapd serve`` then uses and writes."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from kvmap.tools.image.facts import ImageConfig
from kvmap.tools.image.manifests import Mount, Sidecar, flag

# What the daemon writes besides its own paths: Python and NIXL/UCX temporaries.
TMP = "/tmp"


def argv(side: Sidecar, image: ImageConfig) -> tuple[str, ...]:
    """The kubelet's rule: command replaces ENTRYPOINT (and drops CMD), args replace CMD."""
    if side.command is not None:
        return side.command + (side.args or ())
    return image.entrypoint + (side.args if side.args is not None else image.cmd)


def mount_covering(side: Sidecar, path: str) -> Mount | None:
    """The deepest mount that holds path."""
    best = None
    for m in side.mounts:
        mp = m.path.rstrip("/") or "/"
        inside = path == mp or path.startswith(mp.rstrip("/") + "/")
        if inside and (best is None or len(mp) > len(best.path.rstrip("/"))):
            best = m
    return best


@dataclass(frozen=True)
class DaemonPaths:
    config: str | None
    socket: str
    fd_socket: str
    state_dir: str
    listen: str
    metrics_listen: str


def daemon_paths(args: tuple[str, ...], read_file: Mapping[str, str]) -> DaemonPaths:
    """What `kvmapd serve ARGS` uses: the config file's keys, overridden by flags
    (as kvmap.daemon.adapters.config_files.load_config merges them)."""
    config = flag(args, "--config")
    values: dict[str, Any] = {}
    if config is not None and config in read_file:
        values.update(tomllib.loads(read_file[config]))
    for key in ("socket", "fd_socket", "state_dir", "listen", "metrics_listen"):
        value = flag(args, "--" + key.replace("_", "-"))
        if value is not None:
            values[key] = value
    socket = str(values.get("socket", ""))
    return DaemonPaths(
        config=config,
        socket=socket,
        fd_socket=str(values.get("fd_socket") or (socket + ".fds" if socket else "")),
        state_dir=str(values.get("state_dir", "")),
        listen=str(values.get("listen", "")),
        metrics_listen=str(values.get("metrics_listen", "")),
    )


def config_files(side: Sidecar) -> dict[str, str]:
    """Files the sidecar sees through its ConfigMap mounts, by absolute path."""
    return {
        f"{m.path.rstrip('/')}/{name}": text
        for m in side.mounts
        if m.kind == "configMap"
        for name, text in m.files.items()
    }


def home(side: Sidecar, image: ImageConfig) -> str:
    return side.env.get("HOME") or image.env.get("HOME") or "/"


def written_dirs(paths: DaemonPaths, side: Sidecar, image: ImageConfig) -> list[str]:
    """Directories the daemon creates files in."""
    dirs = [str(PurePosixPath(paths.socket).parent), str(PurePosixPath(paths.fd_socket).parent)]
    dirs += [paths.state_dir, home(side, image), side.env.get("TMPDIR") or TMP]
    return sorted({d for d in dirs if d and d != "."})


def wanted_paths(side: Sidecar, image: ImageConfig) -> set[str]:
    """Every image path whose facts the checks of this sidecar read."""
    full = argv(side, image)
    paths = daemon_paths(full[1:], config_files(side))
    wanted = {m.path for m in side.mounts} | set(written_dirs(paths, side, image))
    if paths.config:
        wanted.add(paths.config)
    if full:
        wanted |= set(executable_candidates(full[0], image))
    return {os.path.normpath(p) for p in wanted}


def executable_candidates(name: str, image: ImageConfig) -> list[str]:
    if name.startswith("/"):
        return [name]
    path = image.env.get("PATH", "/usr/local/bin:/usr/bin:/bin")
    return [f"{d.rstrip('/')}/{name}" for d in path.split(":") if d]


def numeric_user(user: str) -> tuple[int | None, int | None]:
    uid, _, gid = user.partition(":")
    return (int(uid) if uid.isdigit() else None, int(gid) if gid.isdigit() else None)


def port_of(address: str) -> int | None:
    _, _, port = address.rpartition(":")
    return int(port) if port.isdigit() else None
