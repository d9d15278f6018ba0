"""A tiny stand-in for kubectl, enough for deploy/k8s/upgrade/upgrade-sidecar.sh.

State is a JSON file ($FAKE_STATE) of objects by kind and name; every call is
appended to $FAKE_LOG (one JSON argv per line). It imitates the parts of the
control plane the upgrade relies on:
  - the kubelet: a patched sidecar image restarts that container only on
    kubelets >= 1.32; older ones restart it when kvmapd is stopped (exec);
  - the Deployment controller: on any template change while not paused, a new
    ReplicaSet takes over the replicas unless an existing one has an equal
    template (ignoring pod-template-hash), as FindNewReplicaSet does.
Fault injection: FAKE_MAIN_RESTARTS=1 (vLLM restarts when its pod is patched),
FAKE_SIDECAR_NEVER_READY=1 (the new sidecar never becomes ready).
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import re
import sys
from typing import Any

KINDS = {
    "deployment": "deployment",
    "deployments": "deployment",
    "deploy": "deployment",
    "rs": "rs",
    "replicaset": "rs",
    "replicasets": "rs",
    "pod": "pod",
    "pods": "pod",
    "node": "node",
    "nodes": "node",
}
SIDECAR, MAIN = "kvmapd", "vllm"
SEGMENT = re.compile(
    r"\.(?P<key>[A-Za-z0-9_\-]+)|\[(?P<index>\d+)\]|\[(?P<all>\*)\]"
    r'|\[\?\(@\.(?P<fkey>\w+)=="(?P<fval>[^"]*)"\)\]'
)


def path_values(obj: Any, path: str) -> list[Any]:
    values = [obj]
    for m in SEGMENT.finditer(path):
        nxt: list[Any] = []
        for v in values:
            if m["key"] is not None and isinstance(v, dict) and m["key"] in v:
                nxt.append(v[m["key"]])
            elif m["index"] is not None and isinstance(v, list) and int(m["index"]) < len(v):
                nxt.append(v[int(m["index"])])
            elif m["all"] is not None and isinstance(v, list):
                nxt.extend(v)
            elif m["fkey"] is not None and isinstance(v, list):
                nxt.extend(
                    x for x in v if isinstance(x, dict) and str(x.get(m["fkey"])) == m["fval"]
                )
        values = nxt
    return values


def show(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, dict | list):
        return json.dumps(v, sort_keys=True, separators=(",", ":"))
    return str(v)


def jsonpath(obj: Any, template: str) -> str:
    tokens = re.findall(r"\{[^{}]*\}|[^{}]+", template)

    def run(tokens: list[str], ctx: Any) -> tuple[str, int]:
        out, i = "", 0
        while i < len(tokens):
            tok = tokens[i]
            i += 1
            if not tok.startswith("{"):
                out += tok
                continue
            inner = tok[1:-1].strip()
            if inner == "end":
                return out, i
            if inner.startswith("range "):
                depth, j = 1, i
                while depth:  # find the matching {end}
                    depth += tokens[j].startswith("{range ") - (tokens[j] == "{end}")
                    j += 1
                for item in path_values(ctx, inner[len("range ") :]):
                    out += run(tokens[i:j], item)[0]
                i = j
            elif inner.startswith('"'):
                out += json.loads(inner)
            else:
                out += " ".join(show(v) for v in path_values(ctx, inner))
        return out, i

    return run(tokens, obj)[0]


def merge(target: Any, patch: Any) -> Any:
    """Strategic-merge-lite: maps merge, lists of named maps merge by name."""
    if isinstance(target, dict) and isinstance(patch, dict):
        for k, v in patch.items():
            target[k] = merge(target.get(k), v)
        return target
    if isinstance(target, list) and isinstance(patch, list) and all("name" in p for p in patch):
        for p in patch:
            match = next((t for t in target if t.get("name") == p["name"]), None)
            if match is None:
                target.append(p)
            else:
                merge(match, p)
        return target
    return copy.deepcopy(patch)


def minor(kubelet: str) -> int:
    return int(kubelet.lstrip("v").split(".")[1])


def status_of(pod: dict[str, Any], field: str, name: str) -> dict[str, Any]:
    return next(s for s in pod["status"][field] if s["name"] == name)


def restart_sidecar(pod: dict[str, Any]) -> None:
    spec = next(c for c in pod["spec"]["initContainers"] if c["name"] == SIDECAR)
    st = status_of(pod, "initContainerStatuses", SIDECAR)
    st["restartCount"] += 1
    st["image"] = "docker.io/" + spec["image"] if "/" not in spec["image"] else spec["image"]
    st["ready"] = os.environ.get("FAKE_SIDECAR_NEVER_READY") != "1"


def template_key(template: dict[str, Any]) -> str:
    t = copy.deepcopy(template)
    t.get("metadata", {}).get("labels", {}).pop("pod-template-hash", None)
    return json.dumps(t, sort_keys=True)


def reconcile(state: dict[str, Any], dep: dict[str, Any]) -> None:
    dep["status"]["observedGeneration"] = dep["metadata"]["generation"]
    if dep["spec"].get("paused"):
        return
    name = dep["metadata"]["name"]
    mine = [
        rs for rs in state["rs"].values() if rs["metadata"]["ownerReferences"][0]["name"] == name
    ]
    want = template_key(dep["spec"]["template"])
    if any(template_key(rs["spec"]["template"]) == want for rs in mine):
        return
    for rs in mine:  # a rollout: the new ReplicaSet takes the replicas
        rs["spec"]["replicas"] = 0
    new = copy.deepcopy(mine[0])
    new["metadata"]["name"] = f"{name}-rolled{len(mine)}"
    new["spec"]["template"] = copy.deepcopy(dep["spec"]["template"])
    new["spec"]["replicas"] = dep["spec"]["replicas"]
    state["rs"][new["metadata"]["name"]] = new


def selected(objs: list[dict[str, Any]], selector: str | None) -> list[dict[str, Any]]:
    if not selector:
        return objs
    pairs = dict(p.split("=", 1) for p in selector.split(","))
    return [
        o
        for o in objs
        if all(o["metadata"].get("labels", {}).get(k) == v for k, v in pairs.items())
    ]


def main(argv: list[str]) -> int:
    with open(os.environ["FAKE_LOG"], "a") as f:
        f.write(json.dumps(argv) + "\n")
    with open(os.environ["FAKE_STATE"]) as f:
        state = json.load(f)
    args = list(argv)
    if args[:1] == ["-n"]:
        args = args[2:]
    verb, rest = args[0], args[1:]

    if verb == "get":
        kind = KINDS[rest[0]]
        name = rest[1] if len(rest) > 1 and not rest[1].startswith("-") else None
        opts = dict(itertools.pairwise(rest))  # each flag -> the word after it
        template = opts["-o"].split("=", 1)[1]
        if name is None:
            items = sorted(state[kind].values(), key=lambda o: o["metadata"]["name"])
            obj: Any = {"items": selected(items, opts.get("-l"))}
        elif name in state[kind]:
            obj = state[kind][name]
        else:
            print(f'Error from server (NotFound): {kind} "{name}" not found', file=sys.stderr)
            return 1
        sys.stdout.write(jsonpath(obj, template))
        return 0

    if verb == "patch":
        kind, name = KINDS[rest[0]], rest[1]
        obj = state[kind][name]
        merge(obj, json.loads(rest[rest.index("-p") + 1]))
        if kind == "pod":
            node = state["node"][obj["spec"]["nodeName"]]
            if minor(node["status"]["nodeInfo"]["kubeletVersion"]) >= 32:
                restart_sidecar(obj)
            if os.environ.get("FAKE_MAIN_RESTARTS") == "1":
                status_of(obj, "containerStatuses", MAIN)["restartCount"] += 1
        if kind == "deployment":
            obj["metadata"]["generation"] += 1
            reconcile(state, obj)
    elif verb == "rollout":
        action, target = rest[0], rest[1]
        dep = state["deployment"][target.split("/", 1)[1]]
        dep["spec"]["paused"] = action == "pause"
        dep["metadata"]["generation"] += 1
        reconcile(state, dep)
    elif verb == "exec":
        pod = state["pod"][rest[0]]
        code = rest[rest.index("-c", rest.index("--")) + 1] if "--" in rest else ""
        if rest[rest.index("-c") + 1] == SIDECAR and "SIGTERM" in code:
            restart_sidecar(pod)  # kvmapd exits; the kubelet starts the spec's image
    else:
        print(f"fake kubectl: unsupported {argv}", file=sys.stderr)
        return 2

    with open(os.environ["FAKE_STATE"], "w") as f:
        json.dump(state, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
