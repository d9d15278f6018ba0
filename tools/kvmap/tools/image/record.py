"""The facts JSON of a built image: its inspect output, every path and file
the checks read (for the manifests' sidecars and for the image alone), and a
digest of the sources that define the image, so a stale recording shows."""

from __future__ import annotations

import hashlib
import json
import os
import tomllib
from collections.abc import Iterable
from pathlib import Path

from kvmap.tools.image import Doc
from kvmap.tools.image.checks import image_alone
from kvmap.tools.image.expectations import argv, daemon_paths, wanted_paths, written_dirs
from kvmap.tools.image.facts import Facts, image_config, path_fact
from kvmap.tools.image.manifests import K8S, Sidecar, flag


def collect_facts(inspect: Doc, rootfs: Path, sides: Iterable[Sidecar]) -> Doc:
    """The facts JSON of an image: its inspect output, and every path and file the
    checks of these sidecars (and of the image alone) read."""
    image = image_config(inspect)
    alone = image_alone(image)
    config = flag(argv(alone, image)[1:], "--config")
    files = {}
    if config:
        path = rootfs / config.lstrip("/")
        files[config] = path.read_text() if path.is_file() else ""
    wanted = set().union(*(wanted_paths(s, image) for s in [*sides, alone]))
    partial = Facts(image, {}, files)
    alone_paths = daemon_paths(argv(alone, image)[1:], partial.files)
    wanted |= {os.path.normpath(p) for p in written_dirs(alone_paths, alone, image)}
    paths = {p: vars(path_fact(rootfs, p)) for p in sorted(wanted)}
    return {"inspect": inspect, "paths": paths, "files": files, "sources": sources_digest()}


def _instructions(text: str) -> str:
    """The lines that make an image: comments and blank lines dropped."""
    return "\n".join(ln.strip() for ln in text.splitlines() if ln.strip() and ln[:1] != "#")


def sources_digest(repo: Path = K8S.parents[1]) -> str:
    """What defines the image: the Dockerfile's instructions, the build context's
    allowlist and the project's runtime dependencies (comments do not count). A
    recording made from other sources is stale."""
    project = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    h = hashlib.sha256()
    for part in (
        _instructions((repo / "Dockerfile").read_text()),
        _instructions((repo / ".dockerignore").read_text()),
        json.dumps(sorted(project["dependencies"])),
    ):
        h.update(hashlib.sha256(part.encode()).digest())
    return h.hexdigest()
