"""Check a built kvmapd image against what the Kubernetes manifests expect of it.

    python -m kvmap.tools.image_check facts --inspect inspect.json --rootfs DIR --out facts.json
    python -m kvmap.tools.image_check check --facts facts.json
    python -m kvmap.tools.image_check pod-script --facts facts.json --rootfs DIR --work DIR ...

Every kustomization under deploy/k8s (base, overlays, examples) is rendered
with ``kubectl kustomize``; for each Deployment the kvmapd sidecar's
expectations (user and group, entrypoint and args, ports and probes, the paths
the daemon writes, a read-only root filesystem) are compared with the image:
its configuration from ``buildah inspect --type image`` and the owner, mode and
kind of the paths in question, read from the image's mounted root filesystem.
Both are recorded in one "facts" JSON (deploy/image/build-and-check.sh writes
it), so that the comparison runs without the image, against a recorded build.

``pod-script`` prints a bash script that runs the image's entrypoint with the
sidecar's args the way the kubelet would (its user, fsGroup, env, emptyDirs and
ConfigMap at their mount paths, read-only root), to be run inside
``unshare --mount --net --pid --fork``; build-and-check.sh then probes it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import stat
import subprocess
import sys
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

SIDECAR = "kvmapd"
K8S = Path(__file__).resolve().parents[3] / "deploy" / "k8s"
# Volume kinds the kubelet always mounts read-only.
READ_ONLY_KINDS = {"configMap", "secret", "downwardAPI", "projected"}
# What the daemon writes besides its own paths: Python and NIXL/UCX temporaries.
TMP = "/tmp"

Doc = dict[str, Any]


# ---- the image


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


# ---- the manifests


def kustomizations(root: Path = K8S) -> list[Path]:
    """Every renderable kustomization (components only render inside one)."""
    found = []
    for k in sorted(root.rglob("kustomization.yaml")):
        if yaml.safe_load(k.read_text()).get("kind") != "Component":
            found.append(k.parent)
    return found


def render(path: Path, kubectl: str = "kubectl") -> list[Doc]:
    out = subprocess.run(
        [kubectl, "kustomize", str(path)], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def flag(args: Iterable[str], name: str) -> str | None:
    """Value of --name ("--name value" or "--name=value"); the last one wins."""
    value, items = None, list(args)
    for i, a in enumerate(items):
        if a == name and i + 1 < len(items):
            value = items[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


@dataclass(frozen=True)
class Mount:
    path: str
    volume: str
    kind: str  # the volume source: emptyDir, configMap, ...
    read_only: bool
    files: Mapping[str, str]  # a ConfigMap's data
    medium: str = ""


@dataclass(frozen=True)
class Probe:
    name: str
    port: int | str | None
    service: str | None  # None: not a grpc probe
    period_s: int
    failures: int


@dataclass(frozen=True)
class Sidecar:
    pod: str
    uid: int | None
    gid: int | None
    fs_group: int | None
    groups: tuple[int, ...]  # fsGroup, then supplementalGroups
    run_as_non_root: bool
    read_only_root: bool
    command: tuple[str, ...] | None
    args: tuple[str, ...] | None
    env: Mapping[str, str]  # literal values; fieldRefs as "fieldRef:<path>"
    ports: Mapping[str, int]  # "name or port" -> containerPort (TCP)
    probes: tuple[Probe, ...]
    mounts: tuple[Mount, ...]
    grace_s: int


def _container(spec: Doc) -> Doc | None:
    for field in ("initContainers", "containers"):
        for c in spec.get(field) or []:
            if c.get("name") == SIDECAR:
                return dict(c)
    return None


def _mounts(docs: list[Doc], spec: Doc, container: Doc) -> tuple[Mount, ...]:
    volumes = {v["name"]: v for v in spec.get("volumes") or []}
    maps = {d["metadata"]["name"]: d for d in docs if d.get("kind") == "ConfigMap"}
    out = []
    for m in container.get("volumeMounts") or []:
        vol = volumes.get(m["name"], {})
        kind = next((k for k in vol if k != "name"), "missing")
        files: dict[str, str] = {}
        if kind == "configMap":
            files = dict((maps.get(vol[kind]["name"]) or {}).get("data") or {})
        medium = (vol.get("emptyDir") or {}).get("medium", "") if kind == "emptyDir" else ""
        ro = bool(m.get("readOnly")) or kind in READ_ONLY_KINDS
        out.append(Mount(m["mountPath"], m["name"], kind, ro, files, medium))
    return tuple(out)


def _env(container: Doc) -> dict[str, str]:
    env = {}
    for e in container.get("env") or []:
        if "value" in e:
            env[e["name"]] = str(e["value"])
        else:
            ref = (e.get("valueFrom") or {}).get("fieldRef") or {}
            env[e["name"]] = f"fieldRef:{ref.get('fieldPath', '?')}"
    return env


def _probes(container: Doc) -> tuple[Probe, ...]:
    out = []
    for name in ("startupProbe", "livenessProbe", "readinessProbe"):
        p = container.get(name)
        if p is None:
            continue
        grpc = p.get("grpc")
        port = (grpc or p.get("httpGet") or p.get("tcpSocket") or {}).get("port")
        service = None if grpc is None else str(grpc.get("service", ""))
        out.append(
            Probe(name, port, service, p.get("periodSeconds", 10), p.get("failureThreshold", 3))
        )
    return tuple(out)


def sidecars(docs: list[Doc]) -> list[Sidecar]:
    """The kvmapd sidecar of every rendered Deployment, as the kubelet sees it."""
    out = []
    for dep in (d for d in docs if d.get("kind") == "Deployment"):
        spec = dep["spec"]["template"]["spec"]
        c = _container(spec)
        if c is None:
            continue
        pod_sc, sc = spec.get("securityContext") or {}, c.get("securityContext") or {}
        groups = [pod_sc["fsGroup"]] if pod_sc.get("fsGroup") else []
        groups += [g for g in pod_sc.get("supplementalGroups") or [] if g not in groups]
        out.append(
            Sidecar(
                pod=dep["metadata"]["name"],
                uid=sc.get("runAsUser", pod_sc.get("runAsUser")),
                gid=sc.get("runAsGroup", pod_sc.get("runAsGroup")),
                fs_group=pod_sc.get("fsGroup"),
                groups=tuple(groups),
                run_as_non_root=bool(sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))),
                read_only_root=bool(sc.get("readOnlyRootFilesystem")),
                command=tuple(c["command"]) if "command" in c else None,
                args=tuple(str(a) for a in c["args"]) if "args" in c else None,
                env=_env(c),
                ports={
                    str(p.get("name") or p["containerPort"]): int(p["containerPort"])
                    for p in c.get("ports") or []
                    if p.get("protocol", "TCP") == "TCP"
                },
                probes=_probes(c),
                mounts=_mounts(docs, spec, c),
                grace_s=int(spec.get("terminationGracePeriodSeconds", 30)),
            )
        )
    return out


# ---- what the container runs


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


# ---- checks
# Each returns a list of human-readable problems; [] means the image keeps the promise.


def _numeric_user(user: str) -> tuple[int | None, int | None]:
    uid, _, gid = user.partition(":")
    return (int(uid) if uid.isdigit() else None, int(gid) if gid.isdigit() else None)


def check_user(side: Sidecar, image: ImageConfig) -> list[str]:
    uid, gid = _numeric_user(image.user)
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
    parser = argparse.ArgumentParser(prog="kvmapd", exit_on_error=False, add_help=False)
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


def _port_of(address: str) -> int | None:
    _, _, port = address.rpartition(":")
    return int(port) if port.isdigit() else None


def check_ports(side: Sidecar, image: ImageConfig, paths: DaemonPaths) -> list[str]:
    problems = [
        f"containerPort {port} ({name}) is not EXPOSEd by the image ({sorted(image.ports)})"
        for name, port in side.ports.items()
        if f"{port}/tcp" not in image.ports
    ]
    listen, metrics = _port_of(paths.listen), _port_of(paths.metrics_listen)
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
    uid, gid = _numeric_user(facts.image.user)
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
    uid, gid = _numeric_user(image.user)
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


# ---- facts


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


def check_all(rendered: Mapping[str, list[Doc]], facts: Facts) -> list[str]:
    problems = check_image_alone(facts)
    for name, docs in rendered.items():
        sides = sidecars(docs)
        if not sides:
            problems.append(f"{name}: no Deployment with a {SIDECAR} container")
        problems += [f"{name}: {p}" for s in sides for p in check_sidecar(s, facts)]
    return problems


def render_all(kubectl: str, root: Path = K8S) -> dict[str, list[Doc]]:
    return {str(k.relative_to(root)): render(k, kubectl) for k in kustomizations(root)}


# ---- the pod, as the kubelet would start the sidecar


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion; unknown references stay as they are."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def pod_env(side: Sidecar, image: ImageConfig, pod_ip: str) -> dict[str, str]:
    fields = {"status.podIP": pod_ip, "metadata.name": side.pod, "metadata.namespace": "default"}
    env = dict(image.env)
    for name, value in side.env.items():
        if value.startswith("fieldRef:"):
            env[name] = fields.get(value.removeprefix("fieldRef:"), "")
        else:
            env[name] = expand(value, env)
    return env


def peer_ids(docs: list[Doc], pod: str) -> tuple[int, int]:
    """uid and gid of the pod's other container (vLLM), the socket's client."""
    dep = next(d for d in docs if d.get("kind") == "Deployment" and d["metadata"]["name"] == pod)
    spec = dep["spec"]["template"]["spec"]
    pod_sc = spec.get("securityContext") or {}
    for c in spec.get("containers") or []:
        if c.get("name") != SIDECAR:
            sc = c.get("securityContext") or {}
            uid = sc.get("runAsUser", pod_sc.get("runAsUser", 0))
            return int(uid), int(sc.get("runAsGroup", pod_sc.get("runAsGroup", uid)))
    raise LookupError(f"{pod}: no container besides {SIDECAR}")


def _q(value: object) -> str:
    return shlex.quote(str(value))


def _volume_lines(side: Sidecar) -> list[str]:
    """Each volume once under $VOL, then bound at its mountPath in $ROOT, deepest last."""
    lines, made = [], set()
    fs_group = side.fs_group or 0
    for m in sorted(side.mounts, key=lambda m: m.path.count("/")):
        src = f'"$VOL"/{_q(m.volume)}'
        if m.volume not in made:
            made.add(m.volume)
            lines.append(f"mkdir -p {src}")
            if m.kind == "emptyDir" and m.medium == "Memory":
                lines.append(f"mount -t tmpfs -o mode=2777,gid={fs_group} tmpfs {src}")
            elif m.kind == "emptyDir":  # the kubelet's emptyDir: 0777, fsGroup, setgid
                lines.append(f"chgrp {fs_group} {src}; chmod 2777 {src}")
            for name, text in m.files.items():
                lines.append(f"printf %s {_q(text)} >{src}/{_q(name)}; chmod 0644 {src}/{_q(name)}")
        dest = f'"$ROOT"{_q(m.path)}'
        lines.append(f"mkdir -p {dest}; mount --bind {src} {dest}")
        if m.read_only:
            lines.append(f"mount -o remount,bind,ro {dest}")
    return lines


SANDBOX = """\
mount --make-rprivate /
mkdir -p "$ROOT" "$VOL"
mount --bind "$ROOTFS" "$ROOT"
mount -t proc proc "$ROOT/proc"
mount -t tmpfs -o mode=0755,nosuid tmpfs "$ROOT/dev"
for d in null zero full random urandom tty; do
  touch "$ROOT/dev/$d"; mount --bind "/dev/$d" "$ROOT/dev/$d"
done
mkdir -p "$ROOT/dev/shm" "$ROOT/dev/pts"
mount -t tmpfs -o mode=1777,size=64m tmpfs "$ROOT/dev/shm"  # the runtime's default
mount --rbind /sys "$ROOT/sys"; mount -o remount,bind,ro "$ROOT/sys"
"""


def pod_script(
    docs: list[Doc], side: Sidecar, facts: Facts, *, rootfs: Path, work: Path, pod_ip: str
) -> str:
    """Bash that sets up the sidecar's filesystem and network in the current (fresh)
    mount and network namespaces and defines pod_exec (which execs: call it in a
    subshell), ENTRY and the probe list."""
    env = pod_env(side, facts.image, pod_ip)
    full = [expand(a, env) for a in argv(side, facts.image)]
    paths = daemon_paths(tuple(full[1:]), config_files(side))
    uid, gid = _numeric_user(facts.image.user)
    uid = side.uid if side.uid is not None else uid
    gid = side.gid if side.gid is not None else gid
    peer_uid, peer_gid = peer_ids(docs, side.pod)
    groups = ",".join(map(str, side.groups))

    def host_path(path: str) -> str:
        m = mount_covering(side, path)
        if m is None:
            return f'"$ROOT"{_q(path)}'
        return f'"$VOL"/{_q(m.volume)}/{_q(os.path.relpath(path, m.path))}'

    lines = [
        f"# kvmapd sidecar of {side.pod}, generated by kvmap.tools.image_check pod-script",
        f"ROOTFS={_q(rootfs)}; ROOT={_q(work / 'root')}; VOL={_q(work / 'volumes')}",
        SANDBOX,
        *_volume_lines(side),
        'mount -o remount,bind,ro "$ROOT"' if side.read_only_root else "# root stays writable",
        f"ip link set lo up; ip addr add {_q(pod_ip)}/32 dev lo",
        f"POD_IP={_q(pod_ip)}; GRACE_S={side.grace_s}",
        f"LISTEN_PORT={_port_of(paths.listen)}; METRICS_PORT={_port_of(paths.metrics_listen)}",
        f"SOCKET_HOST={host_path(paths.socket)}; STATE_HOST={host_path(paths.state_dir)}",
        f"PEER_UID={peer_uid}; PEER_GID={peer_gid}; PEER_GROUPS={_q(groups)}",
        "PROBES=("
        + " ".join(
            _q(f"{p.name} {p.port} {p.period_s} {p.failures} {p.service}")
            for p in side.probes
            if p.service is not None
        )
        + ")",
        "ENTRY=(" + " ".join(_q(a) for a in full) + ")",
        "pod_exec() {",
        "  exec env -i "
        + " ".join(_q(f"{k}={v}") for k, v in sorted(env.items()))
        + f" /usr/sbin/chroot --userspec={uid}:{gid}"
        + (f" --groups={','.join(map(str, side.groups))}" if side.groups else "")
        + ' "$ROOT" "$@"',
        "}",
    ]
    return "\n".join(lines) + "\n"


# ---- command line


def _kubectl() -> str:
    beside = Path(sys.executable).parent / "kubectl"
    return str(beside) if beside.exists() else "kubectl"


def _cmd_facts(args: argparse.Namespace) -> int:
    inspect = json.loads(Path(args.inspect).read_text())
    sides = [s for docs in render_all(_kubectl()).values() for s in sidecars(docs)]
    facts = collect_facts(inspect, Path(args.rootfs), sides)
    Path(args.out).write_text(json.dumps(facts, indent=1, sort_keys=True) + "\n")
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    facts = load_facts(json.loads(Path(args.facts).read_text()))
    rendered = render_all(_kubectl())
    problems = check_all(rendered, facts)
    img = facts.image
    print(
        f"image: USER {img.user}, ENTRYPOINT {list(img.entrypoint)}, CMD {list(img.cmd)}, "
        f"EXPOSE {sorted(img.ports)}"
    )
    for name, docs in rendered.items():
        for side in sidecars(docs):
            paths = daemon_paths(argv(side, img)[1:], config_files(side))
            print(
                f"{name} {side.pod}: runAsUser {side.uid}:{side.gid} groups {list(side.groups)} "
                f"readOnlyRoot {side.read_only_root} ports {dict(side.ports)} "
                f"writes {written_dirs(paths, side, img)}"
            )
    for p in problems:
        print(f"PROBLEM {p}")
    print(f"image_check: {len(problems)} problem(s) in {len(rendered)} kustomizations")
    return 1 if problems else 0


def _cmd_pod_script(args: argparse.Namespace) -> int:
    facts = load_facts(json.loads(Path(args.facts).read_text()))
    docs = render(K8S / args.kustomization, _kubectl())
    side = sidecars(docs)[0]
    script = pod_script(
        docs, side, facts, rootfs=Path(args.rootfs), work=Path(args.work), pod_ip=args.pod_ip
    )
    print(script, end="")
    return 0


def main(argv_: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvmap.tools.image_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("facts", help="record an image's facts")
    p.add_argument("--inspect", required=True, help="`buildah inspect --type image` output")
    p.add_argument("--rootfs", required=True, help="the image's mounted root filesystem")
    p.add_argument("--out", required=True)
    p.set_defaults(run=_cmd_facts)
    p = sub.add_parser("check", help="check recorded facts against every kustomization")
    p.add_argument("--facts", required=True)
    p.set_defaults(run=_cmd_check)
    p = sub.add_parser("pod-script", help="bash that runs the sidecar as the kubelet would")
    p.add_argument("--facts", required=True)
    p.add_argument("--rootfs", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--kustomization", default="overlays/prefill", help="relative to deploy/k8s")
    p.add_argument("--pod-ip", default="10.0.7.9")
    p.set_defaults(run=_cmd_pod_script)
    args = parser.parse_args(argv_)
    status: int = args.run(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
