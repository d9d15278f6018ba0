"""The Kubernetes manifests (deploy/k8s) and the image (Dockerfile) keep their promises.

Every overlay, and overlays combined with the components, is rendered with
`kubectl kustomize` and validated with `kubernetes-validate --strict` against
the oldest Kubernetes version the manifests support (1.29: native sidecars) and
the newest schema bundled with the installed kubernetes-validate. Then checker
functions enforce the invariants that schemas cannot see (probe ports match
--listen, socket paths agree between daemon and connector, ...). Each checker
returns a list of problems; the negative tests feed deliberately broken copies
of a rendered overlay to the same checkers, so a checker that stops detecting
its breakage fails here too.

kubernetes-validate only knows built-in kinds, and for an unknown kind it prints
a WARN and still exits 0, so a typo in `kind:` would pass silently. The
validation here therefore fails on any WARN, and sends it only built-in kinds:
CRD kinds (the PodMonitor) must be listed in CRD_KINDS and are checked by
check_podmonitor instead.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"

SIDECAR = "kvmapd"
MAIN = "vllm"
MIN_K8S = "1.29.0"  # restartable init containers (native sidecars) are on by default from 1.29
READINESS_SERVICE = "kvmap.v1.Peer"
CRD_KINDS = {
    ("monitoring.coreos.com/v1", "PodMonitor"),
    # Checked by tests/deploy/test_alerts.py (no schema for it offline).
    ("monitoring.coreos.com/v1", "PrometheusRule"),
}
PODMONITOR_KINDS = {("monitoring.coreos.com/v1", "PodMonitor")}
GPU_RESOURCE = "nvidia.com/gpu"
TOOL_TIMEOUT_S = 120

Doc = dict[str, Any]
Docs = list[Doc]

# name -> (resources, components), all relative to deploy/k8s. A variant with
# no components and one resource is rendered straight from that directory.
VARIANTS: dict[str, tuple[list[str], list[str]]] = {
    "base": (["base"], []),
    "prefill": (["overlays/prefill"], []),
    "decode": (["overlays/decode"], []),
    "prefill+rdma": (["overlays/prefill"], ["components/rdma"]),
    "decode+rdma": (["overlays/decode"], ["components/rdma"]),
    "prefill+podmonitor": (["overlays/prefill"], ["components/podmonitor"]),
    "decode+rdma+podmonitor": (["overlays/decode"], ["components/rdma", "components/podmonitor"]),
    "example": (["examples/pd-rdma-monitoring"], []),
}


# ---- tools


def _tool(name: str) -> str:
    """A console script of the dev environment (.venv/bin), else one on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if not found:
        pytest.fail(f"{name} not found: install the dev extras (pip install -e '.[dev]')")
    return found


def _run(cmd: list[str], stdin: str | None = None, cwd: Path | None = None) -> str:
    proc = subprocess.run(
        cmd,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=TOOL_TIMEOUT_S,
        cwd=cwd,
        check=False,
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"{shlex.join(cmd)} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}"
        )
    return proc.stdout


def kustomize(path: Path) -> Docs:
    out = _run([_tool("kubectl"), "kustomize", str(path)])
    return [d for d in yaml.safe_load_all(out) if d]


def compose(where: Path, resources: list[str], components: list[str]) -> Path:
    """A throwaway kustomization referring to the repository's directories."""
    where.mkdir(parents=True, exist_ok=True)
    rel = functools.partial(os.path.relpath, start=where)
    doc = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [rel(K8S / r) for r in resources],
        "components": [rel(K8S / c) for c in components],
    }
    (where / "kustomization.yaml").write_text(yaml.safe_dump(doc))
    return where


def kubernetes_versions() -> list[str]:
    """Schema versions bundled with the installed kubernetes-validate, oldest first."""
    from kubernetes_validate import utils

    return list(utils.all_versions())


def validation_versions() -> list[str]:
    newest = kubernetes_versions()[-1]
    return [MIN_K8S] if newest == MIN_K8S else [MIN_K8S, newest]


def validate(docs: Docs, version: str) -> list[str]:
    """Problems kubernetes-validate --strict finds (errors, and WARN as errors)."""
    builtin = [d for d in docs if (d.get("apiVersion"), d.get("kind")) not in CRD_KINDS]
    proc = subprocess.run(
        [_tool("kubernetes-validate"), "--strict", "--quiet", "-k", version, "-"],
        input=yaml.safe_dump_all(builtin),
        capture_output=True,
        text=True,
        timeout=TOOL_TIMEOUT_S,
        check=False,
    )
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    problems = [ln for ln in lines if not ln.startswith("INFO")]
    if proc.returncode != 0 and not problems:
        problems.append(f"kubernetes-validate exited {proc.returncode}")
    return problems


@pytest.fixture(scope="session")
def render(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Docs]:
    """Render a variant once per session; each caller gets its own deep copy."""
    cache: dict[str, Docs] = {}

    def _render(name: str) -> Docs:
        if name not in cache:
            resources, components = VARIANTS[name]
            if components or len(resources) != 1:
                path = compose(
                    tmp_path_factory.mktemp(name.replace("+", "-")), resources, components
                )
            else:
                path = K8S / resources[0]
            cache[name] = kustomize(path)
        return copy.deepcopy(cache[name])

    return _render


# ---- rendered objects


def deployments(docs: Docs) -> list[Doc]:
    return [d for d in docs if d.get("kind") == "Deployment"]


def pod_spec(dep: Doc) -> Doc:
    spec: Doc = dep["spec"]["template"]["spec"]
    return spec


def find_container(spec: Doc, name: str, field: str) -> Doc | None:
    return next((c for c in spec.get(field) or [] if c.get("name") == name), None)


def sidecar_of(spec: Doc) -> Doc:
    c = find_container(spec, SIDECAR, "initContainers") or find_container(
        spec, SIDECAR, "containers"
    )
    if c is None:
        raise LookupError(f"no container named {SIDECAR}")
    return c


def main_of(spec: Doc) -> Doc:
    c = find_container(spec, MAIN, "containers")
    if c is None:
        raise LookupError(f"no container named {MAIN}")
    return c


def flag(args: list[str], name: str) -> str | None:
    """Value of --name in args ("--name value" or "--name=value"); last one wins."""
    value = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def host_port(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host, int(port)


def env_of(container: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in container.get("env") or []}


def is_pod_ip_env(container: Doc, name: str = "POD_IP") -> bool:
    e = env_of(container).get(name) or {}
    return (e.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath") == "status.podIP"


def volumes_of(spec: Doc) -> dict[str, Doc]:
    return {v["name"]: v for v in spec.get("volumes") or []}


def mount_at(container: Doc, path: str) -> Doc | None:
    return next((m for m in container.get("volumeMounts") or [] if m["mountPath"] == path), None)


def mount_covering(container: Doc, path: str) -> Doc | None:
    """The deepest mount whose mountPath contains path."""
    best = None
    for m in container.get("volumeMounts") or []:
        mp = m["mountPath"].rstrip("/")
        if (path == mp or path.startswith(mp + "/")) and (
            best is None or len(mp) > len(best["mountPath"])
        ):
            best = m
    return best


def configmap_named(docs: Docs, name: str) -> Doc | None:
    return next(
        (d for d in docs if d.get("kind") == "ConfigMap" and d["metadata"]["name"] == name), None
    )


def daemon_settings(docs: Docs, spec: Doc) -> dict[str, Any]:
    """What kvmapd will run with: its config file (from the mounted ConfigMap),
    overridden by its flags, the way `kvmapd serve` merges them."""
    args = sidecar_of(spec).get("args") or []
    settings: dict[str, Any] = {}
    config = flag(args, "--config")
    if config:
        settings.update(config_file(docs, spec, config))
    for key in (
        "socket",
        "listen",
        "planner",
        "state_dir",
        "log_format",
        "metrics_listen",
        "fd_socket",
    ):
        value = flag(args, "--" + key.replace("_", "-"))
        if value is not None:
            settings[key] = value
    for key in ("peer_accept", "peer_allow", "peer_identity"):
        # Repeatable, each value possibly comma-separated and from the env.
        values = [env_expanded(docs, spec, v) for v in flags(args, "--" + key.replace("_", "-"))]
        if values:
            settings[key] = [p.strip() for v in values for p in v.split(",") if p.strip()]
    return settings


def flags(args: list[str], name: str) -> list[str]:
    """Every value of a repeatable --name in args, in order."""
    out = []
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            out.append(args[i + 1])
        elif a.startswith(name + "="):
            out.append(a.split("=", 1)[1])
    return out


def env_source(spec: Doc, name: str) -> Doc | None:
    """The sidecar's env entry called name, or None."""
    return next((e for e in sidecar_of(spec).get("env") or [] if e.get("name") == name), None)


def env_expanded(docs: Docs, spec: Doc, value: str) -> str:
    """value with each $(VAR) replaced as the kubelet does from the sidecar's env (literal
    values and ConfigMap keys); an unresolvable reference stays as it is, as the kubelet
    leaves it."""

    def one(m: re.Match[str]) -> str:
        entry = env_source(spec, m.group(1)) or {}
        if "value" in entry:
            return str(entry["value"])
        ref = (entry.get("valueFrom") or {}).get("configMapKeyRef")
        cm = configmap_named(docs, ref["name"]) if ref else None
        if ref and cm and ref["key"] in (cm.get("data") or {}):
            return str(cm["data"][ref["key"]])
        return m.group(0)

    return re.sub(r"\$\((\w+)\)", one, value)


def settings_network(docs: Docs, spec: Doc) -> str:
    """The pod network setting (the ConfigMap key the allow-list flags take)."""
    values = flags(sidecar_of(spec).get("args") or [], "--peer-accept")
    return env_expanded(docs, spec, values[0]) if values else ""


def kvmapd_configmap(docs: Docs) -> Doc:
    """The (first) ConfigMap that holds a kvmapd.toml."""
    return next(d for d in docs if d["kind"] == "ConfigMap" and "kvmapd.toml" in d.get("data", {}))


def config_file(docs: Docs, spec: Doc, path: str) -> dict[str, Any]:
    """The parsed TOML that the sidecar sees at path; raises LookupError if it sees none."""
    mount = mount_covering(sidecar_of(spec), path)
    if mount is None:
        raise LookupError(f"--config {path} is not on a volume of the sidecar")
    volume = volumes_of(spec).get(mount["name"], {})
    if "configMap" not in volume:
        raise LookupError(f"--config {path} is on volume {mount['name']}, not a ConfigMap")
    key = path[len(mount["mountPath"].rstrip("/")) + 1 :]
    cm = configmap_named(docs, volume["configMap"]["name"])
    if cm is None or key not in (cm.get("data") or {}):
        raise LookupError(f"ConfigMap {volume['configMap']['name']} has no key {key!r}")
    return tomllib.loads(cm["data"][key])


def kv_transfer_config(container: Doc) -> dict[str, Any]:
    raw = flag(container.get("args") or [], "--kv-transfer-config")
    if raw is None:
        raise LookupError("vLLM has no --kv-transfer-config")
    cfg: dict[str, Any] = json.loads(raw)
    return cfg


def pod_labels(dep: Doc) -> dict[str, str]:
    labels: dict[str, str] = dep["spec"]["template"]["metadata"].get("labels") or {}
    return labels


def each_pod(docs: Docs) -> Iterator[tuple[str, Doc]]:
    for dep in deployments(docs):
        yield dep["metadata"]["name"], pod_spec(dep)


# ---- checkers
# Each returns a list of human-readable problems; [] means the invariant holds.


def check_has_workload(docs: Docs) -> list[str]:
    return [] if deployments(docs) else ["no Deployment rendered"]


def check_native_sidecar(docs: Docs) -> list[str]:
    problems = []
    for name, spec in each_pod(docs):
        init = find_container(spec, SIDECAR, "initContainers")
        if find_container(spec, SIDECAR, "containers") is not None:
            problems.append(f"{name}: {SIDECAR} is a regular container, not a native sidecar")
        if init is None:
            problems.append(f"{name}: no init container {SIDECAR}")
            continue
        if init.get("restartPolicy") != "Always":
            problems.append(f"{name}: {SIDECAR} restartPolicy is {init.get('restartPolicy')!r}")
        if (init.get("args") or [None])[0] != "serve":
            problems.append(f"{name}: {SIDECAR} does not run `kvmapd serve`")
        if find_container(spec, MAIN, "containers") is None:
            problems.append(f"{name}: no container {MAIN}")
    return problems


def check_probes(docs: Docs) -> list[str]:
    problems = []
    for name, spec in each_pod(docs):
        side = sidecar_of(spec)
        listen = flag(side.get("args") or [], "--listen")
        if listen is None:
            problems.append(f"{name}: {SIDECAR} has no --listen (default is 127.0.0.1)")
            continue
        host, port = host_port(listen)
        if host != "$(POD_IP)" or not is_pod_ip_env(side):
            problems.append(f"{name}: --listen {listen} is not $(POD_IP) from status.podIP")
        expected = {
            "startupProbe": "",
            "livenessProbe": "",
            "readinessProbe": READINESS_SERVICE,
        }
        for probe_name, service in expected.items():
            grpc = (side.get(probe_name) or {}).get("grpc")
            if grpc is None:
                problems.append(f"{name}: {probe_name} is not a grpc probe")
                continue
            if type(grpc.get("port")) is not int or grpc["port"] != port:
                problems.append(
                    f"{name}: {probe_name} port {grpc.get('port')!r} != --listen {port}"
                )
            if grpc.get("service", "") != service:
                problems.append(
                    f"{name}: {probe_name} service {grpc.get('service')!r} != {service!r}"
                )
        ports = {p.get("name"): p.get("containerPort") for p in side.get("ports") or []}
        if ports.get("peer") != port:
            problems.append(f"{name}: container port 'peer' {ports.get('peer')} != --listen {port}")
    return problems


def check_socket_paths(docs: Docs) -> list[str]:
    problems = []
    for name, spec in each_pod(docs):
        side, main = sidecar_of(spec), main_of(spec)
        try:
            settings = daemon_settings(docs, spec)
            extra = kv_transfer_config(main).get("kv_connector_extra_config") or {}
        except (LookupError, ValueError) as err:
            problems.append(f"{name}: {err}")
            continue
        socket = settings.get("socket")
        if not socket:
            problems.append(
                f"{name}: kvmapd socket unset (it would default to a private /tmp path)"
            )
            continue
        if extra.get("socket") != socket:
            problems.append(
                f"{name}: connector socket {extra.get('socket')!r} != daemon socket {socket!r}"
            )
        fd_socket = settings.get("fd_socket") or socket + ".fds"
        for path in (socket, fd_socket):
            directory = os.path.dirname(path)
            side_mount, main_mount = mount_at(side, directory), mount_at(main, directory)
            if side_mount is None or main_mount is None:
                problems.append(
                    f"{name}: {directory} (for {path}) is not mounted in both containers"
                )
                continue
            if side_mount["name"] != main_mount["name"]:
                problems.append(f"{name}: {directory} is different volumes in the two containers")
            if main_mount.get("readOnly"):
                problems.append(f"{name}: {directory} is read-only for vLLM (connect needs write)")
            if "emptyDir" not in volumes_of(spec).get(side_mount["name"], {}):
                problems.append(f"{name}: {directory} is not an emptyDir")
        _, port = host_port(settings.get("listen", "127.0.0.1:50051"))
        if extra.get("peer_address") != f"$(POD_IP):{port}" or not is_pod_ip_env(main):
            problems.append(
                f"{name}: connector peer_address {extra.get('peer_address')!r}"
                f" is not $(POD_IP):{port}"
            )
    return problems


def check_gpu(docs: Docs) -> list[str]:
    problems = []
    for name, spec in each_pod(docs):
        side, main = sidecar_of(spec), main_of(spec)
        res = side.get("resources") or {}
        for kind in ("requests", "limits"):
            gpus = [r for r in res.get(kind) or {} if r == GPU_RESOURCE or r.endswith("/gpu")]
            if gpus:
                problems.append(f"{name}: the sidecar {kind} {gpus} (only vLLM may)")
        main_res = main.get("resources") or {}
        if GPU_RESOURCE not in (main_res.get("limits") or {}):
            problems.append(f"{name}: vLLM has no {GPU_RESOURCE} limit")
        # The documented way the sidecar sees vLLM's GPU: NVIDIA_VISIBLE_DEVICES=all
        # with the NVIDIA runtime, or one DRA claim referenced by both containers.
        sees_all = (env_of(side).get("NVIDIA_VISIBLE_DEVICES") or {}).get("value") == "all"
        claims_side = {c["name"] for c in res.get("claims") or []}
        claims_main = {c["name"] for c in main_res.get("claims") or []}
        if not sees_all and not (claims_side & claims_main):
            problems.append(f"{name}: the sidecar cannot see vLLM's GPU")
    return problems


def check_dev_shm(docs: Docs) -> list[str]:
    problems = []
    for name, spec in each_pod(docs):
        for container in (sidecar_of(spec), main_of(spec)):
            mount = mount_at(container, "/dev/shm")
            if mount is None:
                problems.append(f"{name}: /dev/shm not mounted in {container['name']}")
                continue
            empty_dir = volumes_of(spec).get(mount["name"], {}).get("emptyDir")
            if empty_dir is None or empty_dir.get("medium") != "Memory":
                problems.append(f"{name}: /dev/shm of {container['name']} is not a Memory emptyDir")
            elif not empty_dir.get("sizeLimit"):
                problems.append(f"{name}: /dev/shm emptyDir has no sizeLimit")
        mounts = [mount_at(c, "/dev/shm") for c in (sidecar_of(spec), main_of(spec))]
        shm = {m["name"] for m in mounts if m is not None}
        if len(shm) > 1:
            problems.append(f"{name}: the two containers mount different /dev/shm volumes {shm}")
    return problems


def check_connector_importable(docs: Docs) -> list[str]:
    problems = []
    for name, spec in each_pod(docs):
        try:
            cfg = kv_transfer_config(main_of(spec))
        except (LookupError, ValueError) as err:
            problems.append(f"{name}: {err}")
            continue
        module = cfg.get("kv_connector_module_path")
        if not module:
            problems.append(f"{name}: no kv_connector_module_path")
            continue
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a parent package is missing
            found = False
        if not found:
            problems.append(f"{name}: kv_connector_module_path {module!r} is not importable")
    return problems


def check_shared_pid(docs: Docs) -> list[str]:
    return [
        f"{name}: shareProcessNamespace is not true (UCX cuda_ipc needs one PID namespace)"
        for name, spec in each_pod(docs)
        if spec.get("shareProcessNamespace") is not True
    ]


def check_security(docs: Docs) -> list[str]:
    problems = []
    for name, spec in each_pod(docs):
        pod_sc = spec.get("securityContext") or {}
        if pod_sc.get("runAsNonRoot") is not True:
            problems.append(f"{name}: pod runAsNonRoot is not true")
        if not pod_sc.get("fsGroup"):
            problems.append(f"{name}: no fsGroup: vLLM could not use the daemon's 0660 sockets")
        for container in (sidecar_of(spec), main_of(spec)):
            sc = container.get("securityContext") or {}
            who = f"{name}/{container['name']}"
            if not sc.get("runAsUser"):
                problems.append(f"{who}: runAsUser unset or 0")
            if sc.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{who}: allowPrivilegeEscalation is not false")
            if "ALL" not in ((sc.get("capabilities") or {}).get("drop") or []):
                problems.append(f"{who}: does not drop ALL capabilities")
        side = sidecar_of(spec)
        if (side.get("securityContext") or {}).get("readOnlyRootFilesystem") is not True:
            problems.append(f"{name}: sidecar root filesystem is writable")
        uids = {(c.get("securityContext") or {}).get("runAsUser") for c in (side, main_of(spec))}
        if len(uids) != 2:
            problems.append(f"{name}: sidecar and vLLM should run as different users, got {uids}")
        state_dir = daemon_settings(docs, spec).get("state_dir")
        mount = mount_at(side, state_dir) if state_dir else None
        if mount is None or mount.get("readOnly"):
            problems.append(f"{name}: state_dir {state_dir!r} is not a writable mount")
        elif "emptyDir" not in volumes_of(spec).get(mount["name"], {}):
            problems.append(f"{name}: state_dir is not an emptyDir (must outlive sidecar restarts)")
    return problems


def check_resources(docs: Docs) -> list[str]:
    problems = []
    for name, spec in each_pod(docs):
        for container in (sidecar_of(spec), main_of(spec)):
            res = container.get("resources") or {}
            for kind, key in (("requests", "cpu"), ("requests", "memory"), ("limits", "memory")):
                if key not in (res.get(kind) or {}):
                    problems.append(f"{name}/{container['name']}: no {kind}.{key}")
    return problems


def check_service(docs: Docs) -> list[str]:
    problems = []
    services = [d for d in docs if d.get("kind") == "Service"]
    for dep in deployments(docs):
        name, spec, labels = dep["metadata"]["name"], pod_spec(dep), pod_labels(dep)
        mine = [
            s
            for s in services
            if s["spec"].get("selector")
            and all(labels.get(k) == v for k, v in s["spec"]["selector"].items())
        ]
        if len(mine) != 1:
            problems.append(f"{name}: {len(mine)} Services select its pods, expected 1")
            continue
        svc = mine[0]["spec"]
        if svc.get("clusterIP") != "None":
            problems.append(f"{name}: the peer Service is not headless")
        settings = daemon_settings(docs, spec)
        _, peer = host_port(settings.get("listen", "127.0.0.1:50051"))
        wanted = {"peer": peer}
        if settings.get("metrics_listen"):
            wanted["metrics"] = host_port(settings["metrics_listen"])[1]
        else:
            problems.append(f"{name}: kvmapd has no metrics_listen")
        side_ports = {
            p.get("name"): p.get("containerPort") for p in sidecar_of(spec).get("ports") or []
        }
        svc_ports = {p.get("name"): p for p in svc.get("ports") or []}
        for port_name, number in wanted.items():
            p = svc_ports.get(port_name)
            if p is None or p.get("targetPort") != number:
                problems.append(f"{name}: Service port {port_name!r} does not target {number}")
            if side_ports.get(port_name) != number:
                problems.append(f"{name}: sidecar port {port_name!r} is not {number}")
    return problems


def check_labels(docs: Docs) -> list[str]:
    problems = []
    required = ("app.kubernetes.io/name", "app.kubernetes.io/part-of")
    for doc in docs:
        if (doc.get("apiVersion"), doc.get("kind")) in CRD_KINDS:
            continue
        labels = doc["metadata"].get("labels") or {}
        missing = [k for k in required if k not in labels]
        if missing:
            problems.append(f"{doc['kind']}/{doc['metadata']['name']}: missing labels {missing}")
    for dep in deployments(docs):
        labels = pod_labels(dep)
        missing = [k for k in required if k not in labels]
        if missing:
            problems.append(f"{dep['metadata']['name']}: pod template missing labels {missing}")
        if any("version" in k for k in labels):
            problems.append(
                f"{dep['metadata']['name']}: a version label in the pod template rolls pods"
            )
        selector = dep["spec"]["selector"].get("matchLabels") or {}
        if not selector or any(labels.get(k) != v for k, v in selector.items()):
            problems.append(f"{dep['metadata']['name']}: selector does not match the pod labels")
    return problems


def check_podmonitor(docs: Docs) -> list[str]:
    problems = []
    for pm in (d for d in docs if (d.get("apiVersion"), d.get("kind")) in PODMONITOR_KINDS):
        selector = pm["spec"].get("selector", {}).get("matchLabels") or {}
        selected = [
            dep
            for dep in deployments(docs)
            if selector and all(pod_labels(dep).get(k) == v for k, v in selector.items())
        ]
        if len(selected) != len(deployments(docs)) or not selected:
            problems.append(f"PodMonitor {pm['metadata']['name']}: does not select every kvmap pod")
        for dep in selected:
            spec = pod_spec(dep)
            names = {
                p.get("name")
                for c in (spec.get("initContainers") or []) + spec["containers"]
                for p in c.get("ports") or []
            }
            wanted = {e.get("port") for e in pm["spec"].get("podMetricsEndpoints") or []}
            if "metrics" not in wanted:
                problems.append(
                    f"PodMonitor {pm['metadata']['name']}: does not scrape port 'metrics'"
                )
            if wanted - names:
                problems.append(
                    f"PodMonitor: ports {sorted(wanted - names)} not on {dep['metadata']['name']}"
                )
    return problems


ROLES = {"prefill": "decode", "decode": "prefill"}
COMPONENT = "app.kubernetes.io/component"


def selector_values(selector: Doc, key: str) -> set[str] | None:
    """The values of label ``key`` a selector admits (matchLabels and ``In``
    expressions); None when it does not constrain ``key``."""
    allowed: set[str] | None = None
    if key in (selector.get("matchLabels") or {}):
        allowed = {selector["matchLabels"][key]}
    for expr in selector.get("matchExpressions") or []:
        if expr.get("key") == key and expr.get("operator") == "In":
            values = set(expr.get("values") or [])
            allowed = values if allowed is None else allowed & values
    return allowed


def selects(selector: Doc, labels: dict[str, str]) -> bool:
    keys = set(selector.get("matchLabels") or {}) | {
        e.get("key") for e in selector.get("matchExpressions") or []
    }
    for key in keys:
        values = selector_values(selector, key)
        if values is None or labels.get(key) not in values:
            return False  # NotIn/Exists/DoesNotExist: not used here, so not admitted
    return True


def _admits_port(rule: Doc, port: int) -> bool:
    ports = rule.get("ports")
    return not ports or any(p.get("port") in (port, "peer") for p in ports)


def check_network_policy(docs: Docs) -> list[str]:
    """Each role's pods are selected by an ingress NetworkPolicy under which only the other
    role's kvmap pods (same namespace, by pod selector) reach the kvmapd peer port."""
    problems = []
    policies = [d for d in docs if d.get("kind") == "NetworkPolicy"]
    for dep in deployments(docs):
        name, labels = dep["metadata"]["name"], pod_labels(dep)
        other = ROLES.get(labels.get(COMPONENT, ""))
        if other is None:
            continue  # the role-less base: an overlay adds the policy
        mine = [
            p
            for p in policies
            if selects(p["spec"].get("podSelector") or {}, labels)
            and "Ingress" in (p["spec"].get("policyTypes") or [])
        ]
        if not mine:
            problems.append(f"{name}: no ingress NetworkPolicy selects its pods")
        _, peer = host_port(daemon_settings(docs, pod_spec(dep)).get("listen", ":50051"))
        for policy in mine:
            for rule in policy["spec"].get("ingress") or []:
                if not _admits_port(rule, peer):
                    continue
                sources = rule.get("from") or []
                if not sources:
                    problems.append(f"{name}: the peer port {peer} is open to everyone")
                for source in sources:
                    selector = source.get("podSelector")
                    if set(source) != {"podSelector"} or selector is None:
                        problems.append(f"{name}: peer port reachable from {source}")
                    elif selector_values(selector, COMPONENT) != {other} or (
                        selector_values(selector, "app.kubernetes.io/part-of") != {"kvmap"}
                    ):
                        problems.append(f"{name}: peer port reachable from {selector}")
    return problems


def check_peer_allow_lists(docs: Docs) -> list[str]:
    """kvmapd's allow-lists are set (not the loopback default, which no peer could use), parse,
    and admit no whole address space."""
    from kvmap.core.peer_policy import PeerPolicy

    problems = []
    for name, spec in each_pod(docs):
        settings = daemon_settings(docs, spec)
        lists = {k: settings.get(k) for k in ("peer_accept", "peer_allow")}
        if any(not v for v in lists.values()):
            problems.append(f"{name}: kvmapd.toml does not set {sorted(lists)}")
            continue
        try:
            policy = PeerPolicy.parse(
                lists["peer_accept"], lists["peer_allow"], settings.get("peer_identity", [])
            )
        except ValueError as err:
            problems.append(f"{name}: {err}")
            continue
        if any(n.prefixlen == 0 for n in (*policy.accept, *policy.allow_networks)):
            problems.append(f"{name}: an allow-list admits every address")
    return problems


def check_pod_network(docs: Docs) -> list[str]:
    """Both allow-lists are the one pod-network setting: each flag given once, as the same
    $(VAR), whose value is a key of a ConfigMap of this render (a missing key would keep the
    sidecar from starting)."""
    problems = []
    for name, spec in each_pod(docs):
        args = sidecar_of(spec).get("args") or []
        raw = {f: flags(args, f) for f in ("--peer-accept", "--peer-allow")}
        if any(len(v) != 1 for v in raw.values()) or len({v[0] for v in raw.values()}) != 1:
            problems.append(f"{name}: --peer-accept and --peer-allow are not one setting: {raw}")
            continue
        var = re.fullmatch(r"\$\((\w+)\)", raw["--peer-accept"][0])
        entry = env_source(spec, var.group(1)) if var else None
        ref = ((entry or {}).get("valueFrom") or {}).get("configMapKeyRef")
        cm = configmap_named(docs, ref["name"]) if ref else None
        if not ref or ref.get("optional") or not cm or ref["key"] not in (cm.get("data") or {}):
            problems.append(f"{name}: the allow-lists' {raw} is not a ConfigMap key of this render")
    return problems


def check_failed_loads_recompute(docs: Docs) -> list[str]:
    """vLLM recomputes a prompt whose KV load failed (a refused or timed-out pull) instead of
    failing the request: kv_load_failure_policy is recompute, explicitly (vLLM's default is
    fail)."""
    problems = []
    for name, spec in each_pod(docs):
        try:
            policy = kv_transfer_config(main_of(spec)).get("kv_load_failure_policy")
        except LookupError as err:
            problems.append(f"{name}: {err}")
            continue
        if policy != "recompute":
            problems.append(f"{name}: kv_load_failure_policy is {policy!r}, not 'recompute'")
    return problems


CHECKERS: list[Callable[[Docs], list[str]]] = [
    check_has_workload,
    check_native_sidecar,
    check_probes,
    check_socket_paths,
    check_gpu,
    check_dev_shm,
    check_shared_pid,
    check_security,
    check_resources,
    check_service,
    check_labels,
    check_podmonitor,
    check_network_policy,
    check_peer_allow_lists,
    check_pod_network,
    check_failed_loads_recompute,
]


# ---- Dockerfile


def dockerfile_stages(text: str) -> list[tuple[str, list[tuple[str, str]]]]:
    """[(stage name, [(INSTRUCTION, arguments)])], continuation lines joined."""
    joined = re.sub(r"\\\n", " ", text)
    stages: list[tuple[str, list[tuple[str, str]]]] = []
    for raw in joined.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        instr, _, rest = line.partition(" ")
        instr, rest = instr.upper(), rest.strip()
        if instr == "FROM":
            words = rest.split()
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else str(len(stages))
            stages.append((name, []))
        elif stages:
            stages[-1][1].append((instr, rest))
    return stages


def _pip_installs(run: str) -> list[list[str]]:
    """The argument lists of every `pip install` in a RUN line."""
    lexer = shlex.shlex(run, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for word in lexer:
        if word in {"&&", "||", ";", "|"}:
            commands.append([])
        else:
            commands[-1].append(word)
    out = []
    for words in commands:
        for i in range(len(words) - 1):
            # "pip install", "/opt/x/bin/pip install", "python3 -m pip install"
            if words[i].endswith("pip") and words[i + 1] == "install":
                out.append(words[i + 2 :])
    return out


def check_dockerfile(text: str) -> list[str]:
    problems = []
    stages = dockerfile_stages(text)
    if not stages:
        return ["no FROM"]
    final_name, final = stages[-1]
    exec_form: dict[str, Any] = {}
    for i, a in final:
        if i in ("ENTRYPOINT", "CMD"):
            try:
                exec_form[i] = json.loads(a)
            except ValueError:
                exec_form[i] = f"shell form {a!r}"  # signals go to /bin/sh, not kvmapd
    if exec_form.get("ENTRYPOINT") != ["kvmapd"]:
        problems.append(f"ENTRYPOINT of the final stage is {exec_form.get('ENTRYPOINT')}")
    if exec_form.get("CMD") != ["serve", "--config", "/etc/kvmap/kvmapd.toml"]:
        problems.append(f"CMD of the final stage is {exec_form.get('CMD')}")
    users = [a for i, a in final if i == "USER"]
    uid = users[-1].split(":")[0] if users else ""
    if not uid.isdigit() or int(uid) == 0:
        problems.append(f"final stage USER {uid!r} is not a numeric non-root uid")

    # Some stage copies the source tree and pip-installs it with its
    # dependencies, and NIXL's wheel without them (they name torch); no torch.
    builder = None
    for name, instrs in stages:
        copies = [a.split()[-1] for i, a in instrs if i == "COPY" and a.split()[0] == "."]
        installs = [args for i, a in instrs if i == "RUN" for args in _pip_installs(a)]
        # The source tree, maybe with extras ("/src[traces]").
        project = [
            args for args in installs if any(t.split("[", 1)[0] in [*copies, "."] for t in args)
        ]
        if not project or "--no-deps" in project[0]:
            continue  # not a build of the project, or the vllm-kvmap stage (vLLM's torch)
        builder = name
        problems += _builder_problems(name, installs)
    if builder is None:
        problems.append("no stage runs `pip install` on the copied source tree")
    froms = [a.split()[0].split("=", 1)[1] for i, a in final if i == "COPY" and "--from=" in a]
    if builder is not None and builder != final_name and builder not in froms:
        problems.append(f"final stage {final_name} does not copy the install from {builder}")
    return problems


def _builder_problems(stage: str, installs: list[list[str]]) -> list[str]:
    """What is wrong with the builder stage's `pip install`s: kvmapd never imports
    torch, and every NIXL wheel declares it as a dependency."""
    problems = []
    targets = [(w.strip("\"'"), args) for args in installs for w in args if w[:1] != "-"]
    if any(t.startswith("torch") for t, _ in targets):
        problems.append(f"stage {stage}: installs torch")
    nixl = [args for t, args in targets if t.startswith("nixl")]
    if not nixl:
        problems.append(f"stage {stage}: installs no NIXL wheel")
    if any("--no-deps" not in args for args in nixl):
        problems.append(f"stage {stage}: installs NIXL with its dependencies (torch)")
    return problems


def dockerignore_included(patterns: list[str], path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents wins."""

    def regex(pattern: str) -> re.Pattern[str]:
        out, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                out, i = out + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                out, i = out + ".*", i + 2
            elif pattern[i] == "*":
                out, i = out + "[^/]*", i + 1
            elif pattern[i] == "?":
                out, i = out + "[^/]", i + 1
            else:
                out, i = out + re.escape(pattern[i]), i + 1
        return re.compile(out + r"\Z")

    parts = path.split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    included = True
    for raw in patterns:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        rx = regex(line.lstrip("!").strip("/"))
        if any(rx.match(c) for c in candidates):
            included = negate
    return included


# ---- tests: schemas


def test_bundled_schemas_cover_the_supported_versions() -> None:
    """The installed kubernetes-validate bundles the schema of the oldest supported Kubernetes
    (1.29), so validation against it is not silently done with another version, and the strict
    validation runs against that one and the numerically newest bundled schema."""
    # kubernetes-validate silently falls back to the newest schema older than the
    # requested version: make sure the oldest supported one is really bundled.
    versions = kubernetes_versions()
    assert MIN_K8S in versions, versions
    # validation_versions() takes the list's last entry as the newest: compare
    # with the largest version by number (1.100 > 1.29, unlike as strings).
    newest = max(versions, key=lambda v: tuple(int(x) for x in v.split(".")))
    used = validation_versions()
    assert used[0] == MIN_K8S and used[-1] == newest, (used, newest)


@pytest.mark.parametrize("version", validation_versions())
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_manifests_validate_strictly(
    render: Callable[[str], Docs], variant: str, version: str
) -> None:
    """Every overlay and overlay+component combination renders with kustomize and passes kubernetes-
    validate --strict, warnings included, for the oldest and newest bundled Kubernetes."""
    # validate() sends every kind except CRD_KINDS and fails on WARN (unknown
    # kind), so nothing else escapes schema validation.
    assert validate(render(variant), version) == []


@pytest.mark.parametrize(
    "breakage",
    [
        pytest.param(lambda d: pod_spec(d).update(bogusField=1), id="unknown-field"),
        pytest.param(lambda d: d.update(kind="Deploymnet"), id="unknown-kind"),
        pytest.param(
            lambda d: sidecar_of(pod_spec(d))["startupProbe"]["grpc"].update(port="peer"),
            id="grpc-port-by-name",
        ),
        pytest.param(lambda d: pod_spec(d).update(shareProcessNamespace="yes"), id="wrong-type"),
    ],
)
def test_validation_rejects_broken_manifests(
    render: Callable[[str], Docs], breakage: Callable[[Doc], None]
) -> None:
    """The strict validation step itself fails on an unknown field, an unknown kind and a wrongly
    typed probe port."""
    docs = render("prefill")
    breakage(deployments(docs)[0])
    assert validate(docs, MIN_K8S) != []


# ---- tests: invariants


@pytest.mark.parametrize("checker", CHECKERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_invariants(
    render: Callable[[str], Docs], variant: str, checker: Callable[[Docs], list[str]]
) -> None:
    """Every rendered variant satisfies each cross-object invariant checker (native sidecar, probes,
    socket paths, GPU, /dev/shm, PID namespace, security, resources, service, labels,
    PodMonitor)."""
    assert checker(render(variant)) == []


@pytest.mark.parametrize("variant", ["prefill", "decode"])
def test_connector_module_is_importable(render: Callable[[str], Docs], variant: str) -> None:
    """The kv_connector_module_path in vLLM's rendered --kv-transfer-config names a module the
    installed package really has."""
    # find_spec on the module path string taken from vLLM's rendered args: the
    # manifests name a module the package really ships.
    assert check_connector_importable(render(variant)) == []


def test_connector_check_accepts_an_importable_module(render: Callable[[str], Docs]) -> None:
    """The connector checker passes when the module path is swapped for another importable module,
    so it does not fail on everything."""
    # The checker is not always-failing: with a module the package already has,
    # it passes (the negative cases are in BREAKAGES).
    docs = render("prefill")
    _edit_connector(docs, kv_connector_module_path="kvmap.client")
    assert check_connector_importable(docs) == []


def _pod(docs: Docs) -> Doc:
    return pod_spec(deployments(docs)[0])


def _set_arg(container: Doc, name: str, value: str) -> None:
    args = container["args"]
    args[args.index(name) + 1] = value


def _edit_connector(docs: Docs, **changes: Any) -> None:
    main = main_of(_pod(docs))
    cfg = kv_transfer_config(main)
    extra = cfg["kv_connector_extra_config"]
    for key, value in changes.items():
        (extra if key in extra else cfg)[key] = value
    _set_arg(main, "--kv-transfer-config", json.dumps(cfg))


def _edit_config(docs: Docs, old: str, new: str) -> None:
    cm = kvmapd_configmap(docs)
    key = next(iter(cm["data"]))
    assert old in cm["data"][key]
    cm["data"][key] = cm["data"][key].replace(old, new)


def _sidecar_to_containers(docs: Docs) -> None:
    spec = _pod(docs)
    side = sidecar_of(spec)
    spec["initContainers"].remove(side)
    side.pop("restartPolicy")
    spec["containers"].append(side)


def _volume(docs: Docs, name: str) -> Doc:
    return volumes_of(_pod(docs))[name]


def _drop_mount(container: Doc, path: str) -> None:
    container["volumeMounts"].remove(mount_at(container, path))


BREAKAGES: list[tuple[str, Callable[[Docs], list[str]], Callable[[Docs], None]]] = [
    ("sidecar-as-regular-container", check_native_sidecar, _sidecar_to_containers),
    (
        "sidecar-restartPolicy-unset",
        check_native_sidecar,
        lambda d: sidecar_of(_pod(d)).pop("restartPolicy"),
    ),
    (
        "readiness-on-overall-service",
        check_probes,
        lambda d: sidecar_of(_pod(d))["readinessProbe"]["grpc"].update(service=""),
    ),
    (
        "liveness-on-peer-service",
        check_probes,
        lambda d: sidecar_of(_pod(d))["livenessProbe"]["grpc"].update(service=READINESS_SERVICE),
    ),
    (
        "startup-probe-other-port",
        check_probes,
        lambda d: sidecar_of(_pod(d))["startupProbe"]["grpc"].update(port=50052),
    ),
    (
        "listen-other-port",
        check_probes,
        lambda d: _set_arg(sidecar_of(_pod(d)), "--listen", "$(POD_IP):50052"),
    ),
    (
        "listen-loopback",
        check_probes,
        lambda d: _set_arg(sidecar_of(_pod(d)), "--listen", "127.0.0.1:50051"),
    ),
    (
        "probe-port-as-string",
        check_probes,
        lambda d: sidecar_of(_pod(d))["livenessProbe"]["grpc"].update(port="50051"),
    ),
    (
        "readiness-http-probe",
        check_probes,
        lambda d: sidecar_of(_pod(d)).update(readinessProbe={"httpGet": {"port": 50051}}),
    ),
    (
        "connector-other-socket",
        check_socket_paths,
        lambda d: _edit_connector(d, socket="/run/kvmap/other.sock"),
    ),
    (
        "config-other-socket",
        check_socket_paths,
        lambda d: _edit_config(
            d, 'socket = "/run/kvmap/kvmapd.sock"', 'socket = "/tmp/kvmapd.sock"'
        ),
    ),
    (
        "socket-flag-overrides-config",
        check_socket_paths,
        lambda d: sidecar_of(_pod(d))["args"].extend(["--socket", "/run/kvmap/x.sock"]),
    ),
    (
        "fd-socket-elsewhere",
        check_socket_paths,
        lambda d: sidecar_of(_pod(d))["args"].extend(["--fd-socket", "/tmp/kvmapd.fds"]),
    ),
    (
        "vllm-without-socket-dir",
        check_socket_paths,
        lambda d: _drop_mount(main_of(_pod(d)), "/run/kvmap"),
    ),
    (
        "peer-address-other-port",
        check_socket_paths,
        lambda d: _edit_connector(d, peer_address="$(POD_IP):50052"),
    ),
    (
        "sidecar-requests-gpu",
        check_gpu,
        lambda d: sidecar_of(_pod(d))["resources"]["limits"].update({GPU_RESOURCE: "1"}),
    ),
    (
        "vllm-without-gpu",
        check_gpu,
        lambda d: main_of(_pod(d))["resources"]["limits"].pop(GPU_RESOURCE),
    ),
    (
        "sidecar-cannot-see-gpu",
        check_gpu,
        lambda d: sidecar_of(_pod(d))["env"].remove(
            env_of(sidecar_of(_pod(d)))["NVIDIA_VISIBLE_DEVICES"]
        ),
    ),
    ("shm-on-disk", check_dev_shm, lambda d: _volume(d, "dshm")["emptyDir"].pop("medium")),
    ("shm-unbounded", check_dev_shm, lambda d: _volume(d, "dshm")["emptyDir"].pop("sizeLimit")),
    ("shm-only-in-vllm", check_dev_shm, lambda d: _drop_mount(sidecar_of(_pod(d)), "/dev/shm")),
    (
        "connector-module-missing",
        check_connector_importable,
        lambda d: _edit_connector(d, kv_connector_module_path="kvmap.client.no_such_connector"),
    ),
    (
        "connector-package-missing",
        check_connector_importable,
        lambda d: _edit_connector(d, kv_connector_module_path="no_such_package.connector"),
    ),
    ("no-shared-pid-namespace", check_shared_pid, lambda d: _pod(d).pop("shareProcessNamespace")),
    (
        "sidecar-writable-root",
        check_security,
        lambda d: sidecar_of(_pod(d))["securityContext"].update(readOnlyRootFilesystem=False),
    ),
    (
        "sidecar-keeps-capabilities",
        check_security,
        lambda d: sidecar_of(_pod(d))["securityContext"].pop("capabilities"),
    ),
    ("no-fsgroup", check_security, lambda d: _pod(d)["securityContext"].pop("fsGroup")),
    (
        "state-dir-not-mounted",
        check_security,
        lambda d: _drop_mount(sidecar_of(_pod(d)), "/var/lib/kvmap"),
    ),
    (
        "no-vllm-memory-limit",
        check_resources,
        lambda d: main_of(_pod(d))["resources"]["limits"].pop("memory"),
    ),
    (
        "service-not-headless",
        check_service,
        lambda d: next(x for x in d if x["kind"] == "Service")["spec"].pop("clusterIP"),
    ),
    (
        "service-metrics-wrong-port",
        check_service,
        lambda d: _edit_config(d, '"0.0.0.0:9464"', '"0.0.0.0:9465"'),
    ),
    (
        "version-label-in-template",
        check_labels,
        lambda d: deployments(d)[0]["spec"]["template"]["metadata"]["labels"].update(
            {"app.kubernetes.io/version": "0.1.0"}
        ),
    ),
    (
        "podmonitor-wrong-port",
        check_podmonitor,
        lambda d: next(x for x in d if x["kind"] == "PodMonitor")["spec"]["podMetricsEndpoints"][
            0
        ].update(port="prometheus"),
    ),
    (
        "podmonitor-selects-nothing",
        check_podmonitor,
        lambda d: next(x for x in d if x["kind"] == "PodMonitor")["spec"]["selector"][
            "matchLabels"
        ].update(app="x"),
    ),
    (
        "networkpolicy-peer-port-open",
        check_network_policy,
        lambda d: next(x for x in d if x["kind"] == "NetworkPolicy")["spec"]["ingress"][0].pop(
            "from"
        ),
    ),
    (
        "networkpolicy-from-own-role",
        check_network_policy,
        lambda d: next(x for x in d if x["kind"] == "NetworkPolicy")["spec"]["ingress"][0]["from"][
            0
        ]["podSelector"]["matchExpressions"][1].update(values=["prefill"]),
    ),
    (
        "networkpolicy-missing",
        check_network_policy,
        lambda d: d.remove(next(x for x in d if x["kind"] == "NetworkPolicy")),
    ),
    (
        "pod-network-everyone",
        check_peer_allow_lists,
        lambda d: _network_configmap(d)["data"].update(pod_network="10.0.0.0/8,0.0.0.0/0"),
    ),
    (
        "peer-allow-unset",
        check_peer_allow_lists,
        lambda d: _drop_flag(sidecar_of(_pod(d)), "--peer-allow"),
    ),
    (
        "peer-allow-a-second-setting",
        check_pod_network,
        lambda d: _set_arg(sidecar_of(_pod(d)), "--peer-allow", "10.0.0.0/8"),
    ),
    (
        "pod-network-key-missing",
        check_pod_network,
        lambda d: _network_configmap(d)["data"].pop("pod_network"),
    ),
    (
        "load-failure-fails-the-request",
        check_failed_loads_recompute,
        lambda d: _set_arg(
            main_of(_pod(d)),
            "--kv-transfer-config",
            json.dumps({**kv_transfer_config(main_of(_pod(d))), "kv_load_failure_policy": "fail"}),
        ),
    ),
]


def _network_configmap(docs: Docs) -> Doc:
    return next(d for d in docs if d["kind"] == "ConfigMap" and "pod_network" in d["data"])


def _drop_flag(container: Doc, name: str) -> None:
    args = container["args"]
    i = args.index(name)
    del args[i : i + 2]


@pytest.mark.parametrize(
    ("checker", "breakage"), [b[1:] for b in BREAKAGES], ids=[b[0] for b in BREAKAGES]
)
def test_checkers_detect_breakage(
    render: Callable[[str], Docs],
    checker: Callable[[Docs], list[str]],
    breakage: Callable[[Docs], None],
) -> None:
    """Each checker, the connector-import checker included, passes on the rendered
    prefill+podmonitor pods and reports a problem once its specific breakage is applied to a
    copy."""
    docs = render("prefill+podmonitor")
    assert checker(docs) == []
    breakage(docs)
    assert checker(docs) != []


def test_roles_differ_only_where_they_should(render: Callable[[str], Docs]) -> None:
    """Prefill and decode have distinct names, component labels, Service selectors and vLLM args,
    but the same connector config and an identical sidecar."""
    prefill, decode = render("prefill"), render("decode")
    p_dep, d_dep = deployments(prefill)[0], deployments(decode)[0]
    assert p_dep["metadata"]["name"] != d_dep["metadata"]["name"]
    assert pod_labels(p_dep)["app.kubernetes.io/component"] == "prefill"
    assert pod_labels(d_dep)["app.kubernetes.io/component"] == "decode"
    # Each role's Service selects only its own pods.
    for docs, other in ((prefill, d_dep), (decode, p_dep)):
        svc = next(d for d in docs if d["kind"] == "Service")["spec"]["selector"]
        assert not all(pod_labels(other).get(k) == v for k, v in svc.items())
    p_main, d_main = main_of(pod_spec(p_dep)), main_of(pod_spec(d_dep))
    assert p_main["args"] != d_main["args"]
    assert kv_transfer_config(p_main) == kv_transfer_config(d_main)
    # The sidecars are identical but for the role's name prefix of the
    # ConfigMap their pod network comes from.
    sidecars = [json.dumps(sidecar_of(pod_spec(dep))) for dep in (p_dep, d_dep)]
    assert sidecars[0].replace('"prefill-', '"') == sidecars[1].replace('"decode-', '"')


def test_editing_the_config_does_not_roll_the_pods(tmp_path: Path) -> None:
    """Changing kvmapd.toml changes the ConfigMap's data but not its name nor the Deployment, so a
    config edit does not restart vLLM."""
    # The kvmapd ConfigMap keeps its name when its content changes, so a config
    # change never alters the pod template (which would restart vLLM).
    shutil.copytree(K8S, tmp_path / "k8s")
    before = kustomize(tmp_path / "k8s" / "overlays" / "prefill")
    toml = tmp_path / "k8s" / "base" / "kvmapd.toml"
    toml.write_text(toml.read_text().replace('planner = "coalesce"', 'planner = "baseline"'))
    after = kustomize(tmp_path / "k8s" / "overlays" / "prefill")
    assert deployments(before) == deployments(after)
    cm = [kvmapd_configmap(docs) for docs in (before, after)]
    assert cm[0]["metadata"]["name"] == cm[1]["metadata"]["name"]
    assert cm[0]["data"] != cm[1]["data"]


def test_the_pod_network_is_one_setting(tmp_path: Path) -> None:
    """The example's one pod-network patch sets both allow-lists of both roles' daemons:
    changing it there changes what every daemon accepts and dials (a comma-separated pair
    included), and nothing else in the Deployments."""
    shutil.copytree(K8S, tmp_path / "k8s")
    example = tmp_path / "k8s" / "examples" / "pd-rdma-monitoring"
    before = kustomize(example)
    kustomization = example / "kustomization.yaml"
    text = kustomization.read_text()
    assert text.count("value: 10.0.0.0/8") == 1
    kustomization.write_text(text.replace("value: 10.0.0.0/8", "value: 192.168.0.0/16,fd00::/8"))
    after = kustomize(example)
    for docs, expected in ((before, ["10.0.0.0/8"]), (after, ["192.168.0.0/16", "fd00::/8"])):
        pods = list(each_pod(docs))
        assert len(pods) == 2
        for _, spec in pods:
            settings = daemon_settings(docs, spec)
            assert settings["peer_accept"] == settings["peer_allow"] == expected
    assert deployments(before) == deployments(after)


def test_the_daemon_accepts_the_rendered_configuration(
    render: Callable[[str], Docs], tmp_path: Path
) -> None:
    """kvmapd's own config loader accepts the rendered kvmapd.toml plus the pod's flags, and the
    socket paths it derives match the connector's."""
    # Through kvmapd's own loader: unknown keys in kvmapd.toml would make
    # `kvmapd serve` exit 2 in the pod.
    from kvmap.daemon.adapters.config_files import load_config

    docs = render("prefill")
    spec = _pod(docs)
    args = sidecar_of(spec)["args"]
    path = flag(args, "--config")
    assert path is not None
    settings = config_file(docs, spec, path)
    local = tmp_path / "kvmapd.toml"
    local.write_text(kvmapd_configmap(docs)["data"][Path(path).name])
    overrides = {
        "listen": (flag(args, "--listen") or "").replace("$(POD_IP)", "10.1.2.3"),
        # The repeatable flags as kvmapd gets them: the pod network's value.
        "peer_accept": [env_expanded(docs, spec, v) for v in flags(args, "--peer-accept")],
        "peer_allow": [env_expanded(docs, spec, v) for v in flags(args, "--peer-allow")],
    }
    config = load_config(str(local), overrides)
    connector = kv_transfer_config(main_of(spec))["kv_connector_extra_config"]
    assert config.socket_path == connector["socket"] == settings["socket"]
    assert config.fd_socket_path == connector["socket"] + ".fds"
    assert config.listen == "10.1.2.3:50051"
    assert config.log_format == "json"
    assert config.metrics_listen and config.state_dir
    network = settings_network(docs, spec)
    assert config.peer_accept == config.peer_allow == (network,)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_peer_secret_is_a_secret_only_the_sidecar_mounts(
    render: Callable[[str], Docs], role: str
) -> None:
    """kvmapd.toml's peer_secret_file lies in a volume of the Secret kvmap-peer-secret (one for
    both roles) mounted read-only into the kvmapd sidecar only, with no access for "other"
    (kvmapd refuses such a file): a neighbour on the pod's loopback lacks it."""
    docs = render(role)
    spec = _pod(docs)
    sidecar = sidecar_of(spec)
    path = flag(sidecar["args"], "--config")
    assert path is not None
    secret_file = Path(config_file(docs, spec, path)["peer_secret_file"])
    mounts = {m["name"]: m for m in sidecar["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    [name] = [n for n, m in mounts.items() if secret_file.parent == Path(m["mountPath"])]
    assert mounts[name].get("readOnly") is True
    secret = volumes[name]["secret"]
    assert secret["secretName"] == "kvmap-peer-secret"
    assert secret["defaultMode"] & 0o007 == 0
    assert secret_file.name in [item["path"] for item in secret.get("items", [])]
    assert name not in {m["name"] for m in main_of(spec).get("volumeMounts", [])}


# ---- tests: image


def test_dockerfile_builds_kvmapd_from_source() -> None:
    """The repository's Dockerfile passes the Dockerfile checker (install from source, NIXL
    without torch, non-root user, exec-form entrypoint, ...)."""
    assert check_dockerfile((REPO / "Dockerfile").read_text()) == []


DOCKERFILE_BREAKAGES = {
    "installs-from-registry": ('RUN pip install "/src[traces]"', 'RUN pip install "kvmap[traces]"'),
    "installs-torch": ("COPY . /src", 'RUN pip install "torch==2.13.0"\nCOPY . /src'),
    "nixl-with-its-dependencies": ('--no-deps "nixl-cu13', '"nixl-cu13'),
    "nixl-meta-package": ('--no-deps "nixl-cu13', '"nixl'),
    "no-nixl": ('RUN pip install --no-deps "nixl-cu13==${NIXL_VERSION}"', ""),
    "root-user": ("USER 10001:10001", "USER root"),
    "shell-entrypoint": ('ENTRYPOINT ["kvmapd"]', "ENTRYPOINT kvmapd"),
    "other-cmd": ('CMD ["serve", "--config", "/etc/kvmap/kvmapd.toml"]', 'CMD ["serve"]'),
    "final-stage-without-install": (
        "COPY --from=build /opt/kvmap",
        "COPY --from=vllm-kvmap /opt/kvmap",
    ),
}


@pytest.mark.parametrize(
    ("old", "new"), DOCKERFILE_BREAKAGES.values(), ids=DOCKERFILE_BREAKAGES.keys()
)
def test_dockerfile_checker_detects_breakage(old: str, new: str) -> None:
    """Each listed edit of the Dockerfile (install from a registry, torch or NIXL's torch in the
    image, root user, shell entrypoint, ...) makes the checker report a problem."""
    text = (REPO / "Dockerfile").read_text()
    assert old in text
    assert check_dockerfile(text.replace(old, new, 1)) != []


def test_image_matches_the_manifests(render: Callable[[str], Docs]) -> None:
    """The image's default CMD uses the same --config path as the rendered sidecar args, and its
    USER matches the sidecar's runAsUser."""
    stages = dockerfile_stages((REPO / "Dockerfile").read_text())
    final = stages[-1][1]
    cmd = json.loads(next(a for i, a in final if i == "CMD"))
    user = next(a for i, a in reversed(final) if i == "USER")
    side = sidecar_of(_pod(render("prefill")))
    assert flag(side["args"], "--config") == flag(cmd, "--config")
    assert side["securityContext"]["runAsUser"] == int(user.split(":")[0])


def test_image_nixl_is_the_projects() -> None:
    """The image's NIXL wheel has the version the project's `nixl` extra pins."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (pin,) = (d for d in project["optional-dependencies"]["nixl"] if d.startswith("nixl=="))
    build = dict(dockerfile_stages((REPO / "Dockerfile").read_text()))["build"]
    assert ("ARG", f"NIXL_VERSION={pin.removeprefix('nixl==')}") in build


def test_vllm_image_gets_the_client_dependencies() -> None:
    """The vllm-kvmap image stage pip-installs exactly the project's dependencies (none of them is
    torch or nixl)."""
    # The vllm-kvmap stage installs the project with --no-deps (vLLM keeps its
    # torch) and then the project's dependencies: keep both lists equal.
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in deps if d.startswith(("torch", "nixl", "vllm"))]
    wanted = {d.replace(" ", "") for d in deps}
    stage = dict(dockerfile_stages((REPO / "Dockerfile").read_text()))["vllm-kvmap"]
    installed = {
        w
        for i, a in stage
        if i == "RUN"
        for args in _pip_installs(a)
        for w in args
        if not w.startswith("-") and not w.startswith("/")
    }
    assert installed == wanted


def test_build_context_holds_the_sources_and_nothing_else() -> None:
    """.dockerignore lets in every package, its package data and the files the image needs, keeps
    out venvs, .git, build output, caches and tests, and every COPY source exists."""
    patterns = (REPO / ".dockerignore").read_text().splitlines()
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    needed = ["pyproject.toml", "README.md", "deploy/k8s/base/kvmapd.toml"]
    # Every package of every source root, and its package data.
    roots = setuptools["packages"]["find"]["where"]
    packages = {
        ".".join(init.parent.relative_to(REPO / root).parts): init.parent.relative_to(REPO)
        for root in roots
        for init in (REPO / root).rglob("__init__.py")
    }
    assert {"kvmap.daemon", "kvmap.client", "kvmap.tools", "kvmap.v1"} <= set(packages)
    needed += [f"{d}/__init__.py" for d in packages.values()]
    for package, globs in setuptools.get("package-data", {}).items():
        needed += [f"{packages[package]}/{g.replace('*', 'x')}" for g in globs]
    for path in needed:
        assert dockerignore_included(patterns, path), f"{path} is kept out of the build context"
    for path in (
        ".venv/bin/python",
        ".git/HEAD",
        "build/lib/x.py",
        "daemon/__pycache__/x.pyc",
        "tests/x.py",
    ):
        assert not dockerignore_included(patterns, path), f"{path} is sent to the build context"
    # ...and everything the Dockerfile COPYs from the context exists.
    for name, instrs in dockerfile_stages((REPO / "Dockerfile").read_text()):
        for i, a in instrs:
            if i == "COPY" and not a.startswith("--from"):
                for src in a.split()[:-1]:
                    assert src == "." or (REPO / src).exists(), (
                        f"stage {name}: COPY {src} is missing"
                    )
