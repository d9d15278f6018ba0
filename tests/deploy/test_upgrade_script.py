"""deploy/k8s/upgrade/upgrade-sidecar.sh against a fake kubectl (fake_kubectl.py).

The fake plays kubelet and Deployment controller closely enough to catch the
mistakes that would restart vLLM in a real cluster: patching the Deployment
template without the ReplicaSet (a rollout), touching the vLLM container,
carrying on after vLLM restarted, or changing anything while the Deployment is
mid-rollout.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "k8s" / "upgrade" / "upgrade-sidecar.sh"
FAKE = Path(__file__).with_name("fake_kubectl.py")

OLD, NEW = "ghcr.io/kvmap/kvmapd:0.1.0", "ghcr.io/kvmap/kvmapd:0.2.0"
DEPLOYMENT, RS, HASH = "prefill-vllm", "prefill-vllm-7c9f", "7c9f"
LABELS = {"app.kubernetes.io/name": "vllm", "app.kubernetes.io/component": "prefill"}
MUTATING = {"patch", "rollout", "exec", "apply", "set", "delete", "edit", "replace"}


def _template() -> dict[str, Any]:
    return {
        "metadata": {"labels": dict(LABELS)},
        "spec": {
            "initContainers": [{"name": "kvmapd", "image": OLD, "restartPolicy": "Always"}],
            "containers": [{"name": "vllm", "image": "ghcr.io/kvmap/vllm-kvmap:0.1.0"}],
        },
    }


def _state(kubelet: str, pods: int = 2, split_owners: bool = False) -> dict[str, Any]:
    rs_template = _template()
    rs_template["metadata"]["labels"]["pod-template-hash"] = HASH
    state: dict[str, Any] = {
        "deployment": {
            DEPLOYMENT: {
                "metadata": {"name": DEPLOYMENT, "generation": 3, "labels": dict(LABELS)},
                "spec": {
                    "replicas": pods,
                    "selector": {"matchLabels": dict(LABELS)},
                    "template": _template(),
                },
                "status": {"observedGeneration": 3, "updatedReplicas": pods, "readyReplicas": pods},
            }
        },
        "rs": {
            RS: {
                "metadata": {
                    "name": RS,
                    "labels": rs_template["metadata"]["labels"],
                    "ownerReferences": [{"kind": "Deployment", "name": DEPLOYMENT}],
                },
                "spec": {"replicas": pods, "template": rs_template},
            }
        },
        "pod": {},
        "node": {
            "gpu-1": {
                "metadata": {"name": "gpu-1"},
                "status": {"nodeInfo": {"kubeletVersion": kubelet}},
            }
        },
    }
    for i in range(pods):
        name = f"{RS}-{i}"
        owner = "prefill-vllm-0ld" if split_owners and i else RS
        state["pod"][name] = {
            "metadata": {
                "name": name,
                "labels": rs_template["metadata"]["labels"],
                "ownerReferences": [{"kind": "ReplicaSet", "name": owner}],
            },
            "spec": copy.deepcopy(rs_template["spec"]) | {"nodeName": "gpu-1"},
            "status": {
                "initContainerStatuses": [
                    {"name": "kvmapd", "image": OLD, "ready": True, "restartCount": 0}
                ],
                "containerStatuses": [
                    {
                        "name": "vllm",
                        "ready": True,
                        "restartCount": 0,
                        "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}},
                    }
                ],
            },
        }
    return state


class Cluster:
    def __init__(self, tmp: Path, state: dict[str, Any]) -> None:
        self.state_file, self.log_file = tmp / "state.json", tmp / "calls.jsonl"
        self.state_file.write_text(json.dumps(state))
        self.log_file.write_text("")
        bindir = tmp / "bin"
        bindir.mkdir()
        kubectl = bindir / "kubectl"
        kubectl.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE} "$@"\n')
        kubectl.chmod(0o755)
        self.env = os.environ | {
            "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}",
            "FAKE_STATE": str(self.state_file),
            "FAKE_LOG": str(self.log_file),
            "KVMAP_UPGRADE_POLL_SECONDS": "0.05",
        }

    def run(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(SCRIPT), "-n", "llm", "-d", DEPLOYMENT, "-i", NEW, *args],
            env=self.env | env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    @property
    def state(self) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(self.state_file.read_text())
        return result

    @property
    def calls(self) -> list[list[str]]:
        lines = self.log_file.read_text().splitlines()
        return [[a for a in json.loads(ln) if a not in {"-n", "llm"}] for ln in lines]

    def changes(self) -> list[list[str]]:
        return [c for c in self.calls if c[0] in MUTATING]


def _image(containers: list[dict[str, Any]], name: str) -> str:
    return str(next(c for c in containers if c["name"] == name)["image"])


@pytest.mark.parametrize("kubelet", ["v1.33.2", "v1.32.0"])
def test_upgrade_restarts_only_the_sidecar_and_rolls_nothing(tmp_path: Path, kubelet: str) -> None:
    """On kubelets that restart changed sidecars, the script patches each pod's kvmapd image
    (restarted once, ready, vLLM untouched), then pauses, patches ReplicaSet and Deployment
    templates and resumes, without a rollout or any patch of the vLLM container."""
    cluster = Cluster(tmp_path, _state(kubelet))
    proc = cluster.run()
    assert proc.returncode == 0, proc.stderr
    state = cluster.state
    for pod in state["pod"].values():
        assert _image(pod["spec"]["initContainers"], "kvmapd") == NEW
        side = pod["status"]["initContainerStatuses"][0]
        assert side["restartCount"] == 1 and side["ready"] is True
        assert pod["status"]["containerStatuses"][0]["restartCount"] == 0
        assert _image(pod["spec"]["containers"], "vllm") == "ghcr.io/kvmap/vllm-kvmap:0.1.0"
    # New pods get the new sidecar too, and the Deployment did not roll.
    dep = state["deployment"][DEPLOYMENT]
    assert _image(dep["spec"]["template"]["spec"]["initContainers"], "kvmapd") == NEW
    assert _image(state["rs"][RS]["spec"]["template"]["spec"]["initContainers"], "kvmapd") == NEW
    assert list(state["rs"]) == [RS] and state["rs"][RS]["spec"]["replicas"] == 2
    assert dep["spec"]["paused"] is False
    # Order: every pod first, then pause, ReplicaSet, Deployment, resume.
    changes = cluster.changes()
    assert [c[:2] for c in changes] == [
        ["patch", "pod"],
        ["patch", "pod"],
        ["rollout", "pause"],
        ["patch", "rs"],
        ["patch", "deployment"],
        ["rollout", "resume"],
    ]
    for change in changes:
        if change[0] == "patch":
            assert '"containers"' not in change[-1], "the vLLM container must never be patched"


def test_old_kubelets_get_the_daemon_stopped(tmp_path: Path) -> None:
    """On kubelets older than 1.32 the script also execs into each pod's kvmapd container to stop
    the daemon, so the new image runs, and vLLM is not restarted."""
    # Before 1.32 the kubelet does not restart a sidecar whose image changed:
    # the script stops kvmapd, and the kubelet restarts it from the new spec.
    cluster = Cluster(tmp_path, _state("v1.30.4"))
    proc = cluster.run()
    assert proc.returncode == 0, proc.stderr
    execs = [c for c in cluster.changes() if c[0] == "exec"]
    assert len(execs) == 2
    assert all(c[c.index("-c") + 1] == "kvmapd" for c in execs)
    for pod in cluster.state["pod"].values():
        assert pod["status"]["initContainerStatuses"][0]["image"] == NEW
        assert pod["status"]["containerStatuses"][0]["restartCount"] == 0


def test_new_kubelets_are_not_kicked(tmp_path: Path) -> None:
    """On kubelet 1.34 the script never execs into a pod to stop the daemon."""
    cluster = Cluster(tmp_path, _state("v1.34.0"))
    assert cluster.run().returncode == 0
    assert not [c for c in cluster.changes() if c[0] == "exec"]


def test_stops_when_vllm_restarts(tmp_path: Path) -> None:
    """If vLLM restarts while its pod is being upgraded, the script fails with "restarted during the
    upgrade" after touching only that first pod and no template."""
    cluster = Cluster(tmp_path, _state("v1.33.2"))
    proc = cluster.run(FAKE_MAIN_RESTARTS="1")
    assert proc.returncode != 0
    assert "restarted during the upgrade" in proc.stderr
    # Only the first pod was touched; the templates were left alone.
    assert [c[:2] for c in cluster.changes()] == [["patch", "pod"]]


def test_stops_when_the_new_sidecar_never_gets_ready(tmp_path: Path) -> None:
    """If the new sidecar does not become ready within --timeout, the script fails telling how to
    roll the pod back to the old image, having touched only that pod."""
    cluster = Cluster(tmp_path, _state("v1.33.2"))
    proc = cluster.run("--timeout", "1", FAKE_SIDECAR_NEVER_READY="1")
    assert proc.returncode != 0
    assert "Roll this pod back" in proc.stderr and OLD in proc.stderr
    assert [c[:2] for c in cluster.changes()] == [["patch", "pod"]]


def test_refuses_to_start_during_a_rollout(tmp_path: Path) -> None:
    """When the Deployment's pods belong to several ReplicaSets (mid-rollout), the script refuses to
    start and changes nothing."""
    cluster = Cluster(tmp_path, _state("v1.33.2", split_owners=True))
    proc = cluster.run()
    assert proc.returncode != 0
    assert "several ReplicaSets" in proc.stderr
    assert cluster.changes() == []


def test_dry_run_changes_nothing(tmp_path: Path) -> None:
    """--dry-run makes no mutating kubectl call and prints one DRY-RUN line per planned step (patch
    and exec per pod, then the four template steps)."""
    cluster = Cluster(tmp_path, _state("v1.30.4"))
    proc = cluster.run("--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert cluster.changes() == []
    planned = [ln for ln in proc.stderr.splitlines() if ln.startswith("DRY-RUN:")]
    assert len(planned) == 2 * 2 + 4  # (patch + exec) per pod, then the template steps


def test_skip_template_leaves_the_deployment_alone(tmp_path: Path) -> None:
    """--skip-template patches only the pods and leaves the Deployment template on the old image."""
    cluster = Cluster(tmp_path, _state("v1.33.2"))
    assert cluster.run("--skip-template").returncode == 0
    assert [c[:2] for c in cluster.changes()] == [["patch", "pod"], ["patch", "pod"]]
    tpl = cluster.state["deployment"][DEPLOYMENT]["spec"]["template"]["spec"]
    assert _image(tpl["initContainers"], "kvmapd") == OLD


def test_the_fake_controller_rolls_on_a_bare_template_change(tmp_path: Path) -> None:
    """The fake kubectl itself models a rollout: patching only the Deployment template creates a new
    ReplicaSet and scales the old one to zero."""
    # Guards the fake itself: patching only the Deployment (what
    # `kubectl set image deployment/...` does) replaces the ReplicaSet, which
    # is the vLLM restart the script exists to avoid.
    cluster = Cluster(tmp_path, _state("v1.33.2"))
    patch = json.dumps(
        {"spec": {"template": {"spec": {"initContainers": [{"name": "kvmapd", "image": NEW}]}}}}
    )
    subprocess.run(
        [
            "kubectl",
            "-n",
            "llm",
            "patch",
            "deployment",
            DEPLOYMENT,
            "--type=strategic",
            "-p",
            patch,
        ],
        env=cluster.env,
        check=True,
        timeout=30,
    )
    rs = cluster.state["rs"]
    assert rs[RS]["spec"]["replicas"] == 0 and len(rs) == 2


def test_the_kick_stops_only_the_daemon(tmp_path: Path) -> None:
    """The script's KICK program sends SIGTERM to the process running "kvmapd serve" only, leaving a
    non-serving kvmapd and a decoy with the name in its arguments alone."""
    # Run the script's KICK program against a stand-in daemon started the way
    # the image starts it (a console script: "python .../kvmapd serve ...") and
    # a decoy. The daemon's name is made unique so that no real kvmapd on this
    # machine can be hit.
    kick = re.search(r"^KICK='(.*?)'$", SCRIPT.read_text(), re.S | re.M)
    assert kick is not None
    name = f"kvmapd-test-{uuid.uuid4().hex[:8]}"
    program = kick[1].replace('b"kvmapd"', f'b"{name}"')
    assert program != kick[1]
    daemon = tmp_path / name
    daemon.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(60)\n")
    daemon.chmod(0o755)
    procs = [
        subprocess.Popen([str(daemon), "serve", "--config", "x.toml"]),
        subprocess.Popen([str(daemon), "plan"]),  # not serving: left alone
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", name, "serve"]),
    ]
    try:
        out = subprocess.run(
            [sys.executable, "-c", program], capture_output=True, text=True, timeout=30, check=True
        )
        assert out.stdout.split() == ["SIGTERM", str(procs[0].pid)]
        assert procs[0].wait(timeout=10) == -15
        assert procs[1].poll() is None and procs[2].poll() is None
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)
