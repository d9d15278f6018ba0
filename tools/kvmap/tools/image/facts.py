"""The image as the checks see it: its runtime configuration (from
``buildah inspect --type image``) and the owner, mode and kind of the paths
the checks read, as recorded in the facts JSON."""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvmap.tools.image import Doc


@dataclass(frozen=True)
class ImageConfig:
    user: str
    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...]
    env: Mapping[str, str]
    ports: frozenset[str]


def image_config(inspect: Doc) -> ImageConfig:
    """The runtime configuration in `buildah inspect --type image` output."""
    cfg = inspect["OCIv1"]["config"]
    env = dict(e.split("=", 1) for e in cfg.get("Env") or [])
    return ImageConfig(
        user=cfg.get("User") or "",
        entrypoint=tuple(cfg.get("Entrypoint") or ()),
        cmd=tuple(cfg.get("Cmd") or ()),
        env=env,
        # "50051" (buildah config --port) and "50051/tcp" (EXPOSE) are the same port.
        ports=frozenset(
            p.lower() if "/" in p else f"{p}/tcp" for p in cfg.get("ExposedPorts") or {}
        ),
    )


@dataclass(frozen=True)
class PathFact:
    kind: str  # dir, file, link, other, missing
    uid: int = 0
    gid: int = 0
    mode: int = 0


def path_fact(rootfs: Path, path: str) -> PathFact:
    """lstat of an absolute image path under rootfs (links are not followed:
    an absolute target would point outside the image)."""
    try:
        st = (rootfs / path.lstrip("/")).lstat()
    except (FileNotFoundError, NotADirectoryError):
        return PathFact("missing")
    kinds = {stat.S_IFDIR: "dir", stat.S_IFREG: "file", stat.S_IFLNK: "link"}
    kind = kinds.get(stat.S_IFMT(st.st_mode), "other")
    return PathFact(kind, st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode))


@dataclass(frozen=True)
class Facts:
    image: ImageConfig
    paths: Mapping[str, PathFact]
    files: Mapping[str, str]

    def path(self, path: str) -> PathFact | None:
        return self.paths.get(os.path.normpath(path))


def load_facts(doc: Doc) -> Facts:
    paths = {p: PathFact(**f) for p, f in doc["paths"].items()}
    return Facts(image_config(doc["inspect"]), paths, dict(doc["files"]))
