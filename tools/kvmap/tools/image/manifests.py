"""The manifests: every kustomization under deploy/k8s rendered with
``kubectl kustomize``, and the kvmapd sidecar of each Deployment as the
kubelet sees it (user, groups, command, env, ports, probes, mounts)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from kvmap.tools.image import Doc

SIDECAR = "kvmapd"
K8S = Path(__file__).resolve().parents[4] / "deploy" / "k8s"
# Volume kinds the kubelet always mounts read-only.
READ_ONLY_KINDS = {"configMap", "secret", "downwardAPI", "projected"}


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
    files: Mapping[str, str]  # a ConfigMap's data; a Secret's file names (no data)
    medium: str = ""
    mode: int = 0o644  # its files' mode (a Secret's defaultMode)


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
        mode = 0o644
        if kind == "configMap":
            files = dict((maps.get(vol[kind]["name"]) or {}).get("data") or {})
        elif kind == "secret":
            # Its data is not in the manifests (the operator creates it).
            items = vol[kind].get("items") or [{"path": "secret"}]
            files = {str(item["path"]): "" for item in items}
            mode = int(vol[kind].get("defaultMode", 0o644))
        medium = (vol.get("emptyDir") or {}).get("medium", "") if kind == "emptyDir" else ""
        ro = bool(m.get("readOnly")) or kind in READ_ONLY_KINDS
        out.append(Mount(m["mountPath"], m["name"], kind, ro, files, medium, mode))
    return tuple(out)


def _env(docs: list[Doc], container: Doc) -> dict[str, str]:
    maps = {d["metadata"]["name"]: d for d in docs if d.get("kind") == "ConfigMap"}
    env = {}
    for e in container.get("env") or []:
        source = e.get("valueFrom") or {}
        if "value" in e:
            env[e["name"]] = str(e["value"])
        elif "configMapKeyRef" in source:
            # The kubelet copies the key's value (the pod network): a missing
            # one would keep the container from starting, here it stays unset.
            ref = source["configMapKeyRef"]
            data = (maps.get(ref["name"]) or {}).get("data") or {}
            if ref["key"] in data:
                env[e["name"]] = str(data[ref["key"]])
        else:
            ref = source.get("fieldRef") or {}
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
                env=_env(docs, c),
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


def render_all(kubectl: str, root: Path = K8S) -> dict[str, list[Doc]]:
    return {str(k.relative_to(root)): render(k, kubectl) for k in kustomizations(root)}
