"""The checks: each returns a list of human-readable problems; [] means the
image keeps the promise the manifests make for it."""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from pathlib import PurePosixPath

from kvmap.tools.image import Doc
from kvmap.tools.image.expectations import (
    DaemonPaths,
    argv,
    config_files,
    daemon_paths,
    executable_candidates,
    mount_covering,
    numeric_user,
    port_of,
    written_dirs,
)
from kvmap.tools.image.facts import Facts, ImageConfig, PathFact
from kvmap.tools.image.manifests import SIDECAR, Sidecar, sidecars


def check_user(side: Sidecar, image: ImageConfig) -> list[str]:
    uid, gid = numeric_user(image.user)
    problems = []
    if uid is None or uid == 0:
        # The kubelet can only verify runAsNonRoot against a numeric USER.
        problems.append(f"image USER {image.user!r} is not a numeric non-root uid")
    if side.uid is not None and side.uid != uid:
        problems.append(f"runAsUser {side.uid} != image uid {uid} (owner of the image's dirs)")
    if side.gid is not None and side.gid != gid:
        problems.append(f"runAsGroup {side.gid} != image gid {gid}")
    if side.uid is None and side.run_as_non_root and not uid:
        problems.append("runAsNonRoot without runAsUser needs a numeric non-root image USER")
    return problems


def _serve_args_problems(args: tuple[str, ...]) -> list[str]:
    """Parse args with kvmapd's own `serve` parser: an unknown flag is a crash loop."""
    from kvmap.daemon.cli import kvmapd as cli  # noqa: PLC0415

    if not args or args[0] != "serve":
        return [f"the sidecar runs `kvmapd {' '.join(args)}`, not `kvmapd serve`"]
    parser = argparse.ArgumentParser(
        prog="kvmapd", exit_on_error=False, add_help=False, allow_abbrev=False
    )
    cli._add_serve(parser.add_subparsers(dest="command"))
    try:
        _, unknown = parser.parse_known_args(list(args))
    except (argparse.ArgumentError, SystemExit) as err:
        return [f"kvmapd rejects the sidecar's args: {err}"]
    return [f"kvmapd does not know {unknown}"] if unknown else []


def check_command(side: Sidecar, facts: Facts) -> list[str]:
    full = argv(side, facts.image)
    if not full:
        return ["neither the manifest nor the image says what to run"]
    if PurePosixPath(full[0]).name != "kvmapd":
        return [f"the sidecar runs {full[0]}, not kvmapd"]
    found = None
    for cand in executable_candidates(full[0], facts.image):
        fact = facts.path(cand)
        if fact is None:
            return [f"{cand} is not recorded in the image facts (record them again)"]
        if fact.kind != "missing":
            found = (cand, fact)
            break
    if found is None:
        return [f"{full[0]} is not in the image (PATH {facts.image.env.get('PATH')})"]
    cand, fact = found
    if fact.kind == "file" and not fact.mode & 0o111:
        return [f"{cand} is not executable"]
    return _serve_args_problems(full[1:])


def check_ports(side: Sidecar, image: ImageConfig, paths: DaemonPaths) -> list[str]:
    problems = [
        f"containerPort {port} ({name}) is not EXPOSEd by the image ({sorted(image.ports)})"
        for name, port in side.ports.items()
        if f"{port}/tcp" not in image.ports
    ]
    listen, metrics = port_of(paths.listen), port_of(paths.metrics_listen)
    declared = set(side.ports.values())
    if listen not in declared:
        problems.append(f"the daemon listens on {paths.listen!r}: not a containerPort")
    if paths.metrics_listen and metrics not in declared:
        problems.append(f"metrics_listen {paths.metrics_listen!r} is not a containerPort")
    for probe in side.probes:
        port = side.ports.get(probe.port) if isinstance(probe.port, str) else probe.port
        if port not in declared:
            problems.append(f"{probe.name} port {probe.port!r} is not a containerPort")
        elif probe.service is not None and port != listen:
            problems.append(
                f"{probe.name} (gRPC) probes port {port}, the daemon listens on {listen}"
            )
    return problems


def writable_by(fact: PathFact, uid: int, gids: Iterable[int]) -> bool:
    if fact.kind != "dir":
        return False
    if uid == 0:
        return True
    if fact.uid == uid:
        return bool(fact.mode & 0o200)
    if fact.gid in set(gids):
        return bool(fact.mode & 0o020)
    return bool(fact.mode & 0o002)


def _dir_problem(side: Sidecar, facts: Facts, path: str) -> str | None:
    mount = mount_covering(side, path)
    if mount is not None:
        if mount.read_only:
            return f"{path} is on the read-only {mount.kind} volume {mount.volume}"
        return None
    if side.read_only_root:
        return f"{path} is on the read-only root filesystem (no writable volume holds it)"
    fact = facts.path(path)
    if fact is None:
        return f"{path} is not recorded in the image facts (record them again)"
    uid, gid = numeric_user(facts.image.user)
    uid = side.uid if side.uid is not None else uid
    gids = [g for g in (side.gid if side.gid is not None else gid, *side.groups) if g is not None]
    if uid is None or not writable_by(fact, uid, gids):
        return f"{path} ({fact.kind}, {fact.uid}:{fact.gid} {fact.mode:o}) is not writable by {uid}"
    return None


def check_paths(side: Sidecar, facts: Facts, paths: DaemonPaths) -> list[str]:
    problems = []
    if not paths.socket or not paths.state_dir:
        problems.append(f"socket {paths.socket!r} / state_dir {paths.state_dir!r} unset")
    for d in written_dirs(paths, side, facts.image):
        problem = _dir_problem(side, facts, d)
        if problem:
            problems.append(problem)
    if paths.config is not None:
        mount = mount_covering(side, paths.config)
        fact = facts.path(paths.config)
        if mount is not None and mount.kind == "configMap":
            if paths.config not in config_files(side):
                problems.append(f"--config {paths.config}: the ConfigMap has no such key")
        elif fact is None or fact.kind != "file":
            problems.append(f"--config {paths.config} is not a file of the image or a volume")
    for m in side.mounts:
        fact = facts.path(m.path)
        if fact is not None and fact.kind not in ("dir", "missing"):
            problems.append(f"mountPath {m.path} is a {fact.kind} in the image, not a directory")
    return problems


def check_sidecar(side: Sidecar, facts: Facts) -> list[str]:
    full = argv(side, facts.image)
    paths = daemon_paths(full[1:], config_files(side))
    problems = check_user(side, facts.image) + check_command(side, facts)
    problems += check_ports(side, facts.image, paths) + check_paths(side, facts, paths)
    return [f"{side.pod}: {p}" for p in problems]


def image_alone(image: ImageConfig) -> Sidecar:
    """The image run with no manifest (`docker run IMAGE`): its USER and CMD, no volumes."""
    uid, gid = numeric_user(image.user)
    ports = {p.split("/")[0]: int(p.split("/")[0]) for p in image.ports}
    return Sidecar(
        "image-alone", uid, gid, None, (), True, False, None, None, {}, ports, (), (), 30
    )


def check_image_alone(facts: Facts) -> list[str]:
    """Without Kubernetes the image's own CMD must work: its config file is in the
    image and names directories the image user can write."""
    side = image_alone(facts.image)
    full = argv(side, facts.image)
    paths = daemon_paths(full[1:], facts.files)
    problems = check_command(side, facts) + check_paths(side, facts, paths)
    return [f"{side.pod}: {p}" for p in problems]


def check_all(rendered: Mapping[str, list[Doc]], facts: Facts) -> list[str]:
    problems = check_image_alone(facts)
    for name, docs in rendered.items():
        sides = sidecars(docs)
        if not sides:
            problems.append(f"{name}: no Deployment with a {SIDECAR} container")
        problems += [f"{name}: {p}" for s in sides for p in check_sidecar(s, facts)]
    return problems
