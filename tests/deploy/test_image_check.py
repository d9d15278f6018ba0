"""kvmap.tools.image_check: the built image against the manifests' expectations.

deploy/image/build-and-check.sh builds the image with buildah and records its
facts (`buildah inspect` plus the owner and mode of the paths the manifests
use) in deploy/image/recorded/image-facts.json. Here the checker runs on that
recording against every freshly rendered kustomization: a manifest change
that the image does not keep (another uid, port, path, a read-only root
without a writable volume for what the daemon writes) fails here without a
build. Each breakage below is fed to the same checker, so a check that stops
detecting its breakage fails too. The recording must also agree with the
Dockerfile, or it is stale and must be recorded again. The last test builds a
tiny image with the installed buildah and reads its inspect output back, so
that a buildah whose inspect format changed cannot pass silently.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmap.tools import image_check as ic

REPO = Path(__file__).resolve().parents[2]
RECORDED = REPO / "deploy" / "image" / "recorded" / "image-facts.json"
KUBECTL = str(Path(sys.executable).parent / "kubectl")

Doc = dict[str, Any]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Doc]]:
    """Every kustomization under deploy/k8s, rendered once for this module."""
    return ic.render_all(KUBECTL if Path(KUBECTL).exists() else "kubectl")


@pytest.fixture
def facts_doc() -> Doc:
    """The recorded facts of the last image build (a fresh copy per test)."""
    doc: Doc = json.loads(RECORDED.read_text())
    return doc


def _problems(rendered: dict[str, list[Doc]], facts_doc: Doc) -> list[str]:
    return ic.check_all(rendered, ic.load_facts(facts_doc))


def test_every_kustomization_is_checked(rendered: dict[str, list[Doc]]) -> None:
    """The checker renders base, both overlays and the example, and finds a kvmapd
    sidecar in each."""
    assert {"base", "overlays/prefill", "overlays/decode"} <= set(rendered)
    assert any(name.startswith("examples/") for name in rendered)
    for name, docs in rendered.items():
        assert ic.sidecars(docs), name


def test_recorded_image_keeps_the_manifests_promises(
    rendered: dict[str, list[Doc]], facts_doc: Doc
) -> None:
    """The recorded image matches every rendered sidecar: user, entrypoint and args,
    ports and probes, writable paths under a read-only root, and works on its own."""
    assert _problems(rendered, facts_doc) == []


def _dockerfile_final_stage() -> dict[str, list[str]]:
    """Instructions of the Dockerfile's last stage, continuation lines joined."""
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    final: dict[str, list[str]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        instr, _, rest = line.partition(" ")
        if instr.upper() == "FROM":
            final = {}
        final.setdefault(instr.upper(), []).append(rest.strip())
    return final


def test_recording_is_of_the_current_dockerfile(facts_doc: Doc) -> None:
    """USER, ENTRYPOINT, CMD, EXPOSE and ENV of the recorded image are the Dockerfile's: a
    Dockerfile edit without a new recording (build-and-check.sh) fails here."""
    final, image = _dockerfile_final_stage(), ic.load_facts(facts_doc).image
    assert final["USER"][-1] == image.user
    assert tuple(json.loads(final["ENTRYPOINT"][-1])) == image.entrypoint
    assert tuple(json.loads(final["CMD"][-1])) == image.cmd
    exposed = {f"{p}/tcp" for line in final["EXPOSE"] for p in line.split()}
    assert exposed == image.ports
    for line in final["ENV"]:
        for pair in line.split():
            name, _, value = pair.partition("=")
            expected = value.replace("$PATH", "").rstrip(":")
            assert image.env[name].startswith(expected), name


def test_recording_is_of_the_current_image_sources(facts_doc: Doc) -> None:
    """The recording was made from this Dockerfile, .dockerignore and set of runtime
    dependencies: after a change to any of them the image must be built and checked
    again (sudo deploy/image/build-and-check.sh --record), or this fails."""
    assert facts_doc["sources"] == ic.sources_digest(), (
        "the image sources changed since deploy/image/recorded/ was made: "
        "run `sudo deploy/image/build-and-check.sh --record` (docs/image.md)"
    )


# ---- breakages: each one edits the facts or the rendered manifests


def _sidecar(docs: list[Doc]) -> Doc:
    spec = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    container: Doc = next(c for c in spec["initContainers"] if c["name"] == "kvmapd")
    return container


def _pod(docs: list[Doc]) -> Doc:
    spec: Doc = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    return spec


def _config(facts: Doc) -> Doc:
    cfg: Doc = facts["inspect"]["OCIv1"]["config"]
    return cfg


# name -> (edit of the recorded facts, a fragment of the problem it must cause)
FACT_BREAKAGES: dict[str, tuple[Callable[[Doc], None], str]] = {
    "root-user": (lambda f: _config(f).update(User="0:0"), "not a numeric non-root uid"),
    "named-user": (lambda f: _config(f).update(User="kvmap"), "not a numeric non-root uid"),
    "other-uid": (lambda f: _config(f).update(User="10002:10001"), "!= image uid 10002"),
    "port-not-exposed": (
        lambda f: _config(f)["ExposedPorts"].pop("9464/tcp"),
        "containerPort 9464 (metrics) is not EXPOSEd",
    ),
    "other-entrypoint": (
        lambda f: _config(f).update(Entrypoint=["python3"]),
        "runs python3, not kvmapd",
    ),
    "no-entrypoint": (lambda f: _config(f).update(Entrypoint=None), "runs serve, not kvmapd"),
    "kvmapd-missing": (
        lambda f: f["paths"]["/opt/kvmap/bin/kvmapd"].update(kind="missing"),
        "kvmapd is not in the image",
    ),
    "kvmapd-not-executable": (
        lambda f: f["paths"]["/opt/kvmap/bin/kvmapd"].update(mode=0o644),
        "/opt/kvmap/bin/kvmapd is not executable",
    ),
    "state-dir-root-owned": (
        lambda f: f["paths"]["/var/lib/kvmap"].update(uid=0, gid=0),
        "image-alone: /var/lib/kvmap (dir, 0:0 755) is not writable by 10001",
    ),
    "default-config-missing": (
        lambda f: f["paths"]["/etc/kvmap/kvmapd.toml"].update(kind="missing"),
        "image-alone: --config /etc/kvmap/kvmapd.toml is not a file",
    ),
    "mount-path-is-a-file": (
        lambda f: f["paths"]["/run/kvmap"].update(kind="file"),
        "prefill-vllm: mountPath /run/kvmap is a file in the image",
    ),
    "path-not-recorded": (
        lambda f: f["paths"].pop("/var/lib/kvmap"),
        "/var/lib/kvmap is not recorded in the image facts",
    ),
}


@pytest.mark.parametrize("name", FACT_BREAKAGES)
def test_image_breakages_are_detected(
    rendered: dict[str, list[Doc]], facts_doc: Doc, name: str
) -> None:
    """Each listed defect of the image (root or named user, another uid, a port not
    exposed, no or another entrypoint, kvmapd missing or not executable, a state dir the
    user cannot write, ...) makes the checker report the problem it names."""
    edit, fragment = FACT_BREAKAGES[name]
    edit(facts_doc)
    problems = _problems(rendered, facts_doc)
    assert any(fragment in p for p in problems), problems


def _drop_mount(docs: list[Doc], path: str) -> None:
    side = _sidecar(docs)
    side["volumeMounts"] = [m for m in side["volumeMounts"] if m["mountPath"] != path]


def _mount(docs: list[Doc], path: str) -> Doc:
    mount: Doc = next(m for m in _sidecar(docs)["volumeMounts"] if m["mountPath"] == path)
    return mount


# name -> (edit of the rendered prefill overlay, a fragment of the problem it must cause)
MANIFEST_BREAKAGES: dict[str, tuple[Callable[[list[Doc]], None], str]] = {
    "other-run-as-user": (
        lambda d: _sidecar(d)["securityContext"].update(runAsUser=1234),
        "runAsUser 1234 != image uid 10001",
    ),
    "other-run-as-group": (
        lambda d: _sidecar(d)["securityContext"].update(runAsGroup=1234),
        "runAsGroup 1234 != image gid 10001",
    ),
    "no-tmp-volume": (lambda d: _drop_mount(d, "/tmp"), "/tmp is on the read-only root"),
    "no-socket-volume": (
        lambda d: _drop_mount(d, "/run/kvmap"),
        "/run/kvmap is on the read-only root",
    ),
    "state-volume-read-only": (
        lambda d: _mount(d, "/var/lib/kvmap").update(readOnly=True),
        "/var/lib/kvmap is on the read-only emptyDir volume",
    ),
    "socket-dir-on-the-config-map": (
        lambda d: _sidecar(d)["args"].extend(["--socket", "/etc/kvmap/kvmapd.sock"]),
        "/etc/kvmap is on the read-only configMap volume",
    ),
    "unknown-flag": (
        lambda d: _sidecar(d)["args"].append("--no-such-flag"),
        "kvmapd does not know ['--no-such-flag']",
    ),
    "not-serve": (lambda d: _sidecar(d)["args"].__setitem__(0, "plan"), "not `kvmapd serve`"),
    "command-overrides-entrypoint": (
        lambda d: _sidecar(d).update(command=["python3"]),
        "runs python3, not kvmapd",
    ),
    "undeclared-port": (
        lambda d: _sidecar(d)["ports"].pop(),
        "metrics_listen '0.0.0.0:9464' is not a containerPort",
    ),
    "probe-on-another-port": (
        lambda d: _sidecar(d)["startupProbe"]["grpc"].update(port=50052),
        "startupProbe port 50052 is not a containerPort",
    ),
    "grpc-probe-off-the-listen-port": (
        lambda d: _sidecar(d)["livenessProbe"]["grpc"].update(port=9464),
        "livenessProbe (gRPC) probes port 9464, the daemon listens on 50051",
    ),
    "config-key-missing": (
        lambda d: _sidecar(d)["args"].extend(["--config", "/etc/kvmap/other.toml"]),
        "--config /etc/kvmap/other.toml: the ConfigMap has no such key",
    ),
}


@pytest.mark.parametrize("name", MANIFEST_BREAKAGES)
def test_manifest_breakages_are_detected(
    rendered: dict[str, list[Doc]], facts_doc: Doc, name: str
) -> None:
    """Each listed manifest edit the image cannot keep (another uid or gid, no writable
    volume for /tmp or the socket under the read-only root, a read-only state volume, an
    unknown flag, another subcommand or command, an undeclared port, a probe on another
    port, a config key the ConfigMap lacks) makes the checker report the problem it names."""
    docs = copy.deepcopy(rendered["overlays/prefill"])
    edit, fragment = MANIFEST_BREAKAGES[name]
    edit(docs)
    problems = ic.check_all({"broken": docs}, ic.load_facts(facts_doc))
    assert any(fragment in p for p in problems), problems


def test_writable_root_needs_image_dirs_the_user_owns(
    rendered: dict[str, list[Doc]], facts_doc: Doc
) -> None:
    """Without readOnlyRootFilesystem and without a state volume, the daemon writes the
    image's own state dir: fine while the image user owns it, a problem once root does."""
    docs = copy.deepcopy(rendered["overlays/prefill"])
    _sidecar(docs)["securityContext"]["readOnlyRootFilesystem"] = False
    _drop_mount(docs, "/var/lib/kvmap")
    assert ic.check_all({"rw": docs}, ic.load_facts(facts_doc)) == []
    facts_doc["paths"]["/var/lib/kvmap"].update(uid=0, gid=0, mode=0o755)
    problems = ic.check_all({"rw": docs}, ic.load_facts(facts_doc))
    assert any("/var/lib/kvmap" in p and "rw:" in p for p in problems), problems


# ---- pure parts


def test_pod_script_runs_the_sidecar_as_the_kubelet_would(
    rendered: dict[str, list[Doc]], facts_doc: Doc
) -> None:
    """The sandbox script runs the image's entrypoint with the sidecar's args ($(POD_IP) and the
    pod network from its ConfigMap expanded), as its uid with the fsGroup, every volume at its
    mountPath (the ConfigMap read-only) and the root read-only; the socket's client is vLLM's
    uid."""
    docs = rendered["overlays/prefill"]
    side = ic.sidecars(docs)[0]
    facts = ic.load_facts(facts_doc)
    script = ic.pod_script(docs, side, facts, rootfs=Path("/r"), work=Path("/w"), pod_ip="10.9.8.7")
    assert (
        "ENTRY=(kvmapd serve --config /etc/kvmap/kvmapd.toml --listen 10.9.8.7:50051 "
        "--peer-accept 10.0.0.0/8 --peer-allow 10.0.0.0/8)"  # the pod network's ConfigMap key
    ) in script
    assert "--userspec=10001:10001 --groups=2000" in script
    assert 'mount -o remount,bind,ro "$ROOT"\n' in script
    for mount in side.mounts:
        assert f'mount --bind "$VOL"/{mount.volume} "$ROOT"{mount.path}' in script
    assert 'mount -o remount,bind,ro "$ROOT"/etc/kvmap' in script
    assert "PEER_UID=1000; PEER_GID=1000; PEER_GROUPS=2000" in script
    assert " POD_IP=10.9.8.7 " in script and " HOME=/tmp " in script


def test_expand_follows_kubernetes() -> None:
    """$(VAR) is replaced from the environment; an unknown reference stays as written."""
    env = {"POD_IP": "10.1.1.1"}
    assert ic.expand("$(POD_IP):50051", env) == "10.1.1.1:50051"
    assert ic.expand("$(NOPE):1", env) == "$(NOPE):1"


MINIMAL_INSPECT: Doc = {"OCIv1": {"config": {"User": "1:1"}}}
segments = st.lists(st.sampled_from(["a", "b", "ab", "run", "kvmap"]), min_size=1, max_size=4)


@given(st.lists(segments, max_size=6), segments)
def test_mount_covering_picks_the_deepest_enclosing_mount(
    mounts: list[list[str]], path: list[str]
) -> None:
    """mount_covering returns the deepest mountPath that is the path or one of its
    parent directories (never a mere string prefix such as /ab for /a), else None."""
    volumes = tuple(
        ic.Mount("/" + "/".join(m), f"v{i}", "emptyDir", False, {}) for i, m in enumerate(mounts)
    )
    side = dataclasses.replace(ic.image_alone(ic.image_config(MINIMAL_INSPECT)), mounts=volumes)
    target = PurePosixPath("/" + "/".join(path))
    enclosing = [m for m in side.mounts if target.is_relative_to(m.path)]
    found = ic.mount_covering(side, str(target))
    if not enclosing:
        assert found is None
    else:
        assert found is not None
        assert len(PurePosixPath(found.path).parts) == max(
            len(PurePosixPath(m.path).parts) for m in enclosing
        )
        assert target.is_relative_to(found.path)


@given(
    st.builds(
        ic.PathFact,
        st.sampled_from(["dir", "file", "missing"]),
        st.integers(0, 3),
        st.integers(0, 3),
        st.integers(0, 0o777),
    ),
    st.integers(1, 3),
    st.sets(st.integers(0, 3), max_size=3),
)
def test_writable_by_follows_the_permission_bits(
    fact: ic.PathFact, uid: int, gids: set[int]
) -> None:
    """A directory is writable through exactly one class of its mode: the owner's bits
    for its owner, else the group's for a member, else the others' (never a non-dir)."""
    if fact.uid == uid:
        bit = 0o200
    elif fact.gid in gids:
        bit = 0o020
    else:
        bit = 0o002
    assert ic.writable_by(fact, uid, gids) == (fact.kind == "dir" and bool(fact.mode & bit))


# ---- the installed buildah


@pytest.mark.skipif(shutil.which("buildah") is None, reason="buildah is not installed")
def test_checker_reads_what_buildah_inspect_writes(tmp_path: Path) -> None:
    """A scratch image configured with buildah (user, entrypoint, cmd, ports, env) reads
    back through image_config exactly as configured: the recorded format is buildah's."""
    buildah = [
        "buildah",
        "--root", str(tmp_path / "storage"),
        "--runroot", str(tmp_path / "run"),
        "--storage-driver", "vfs",
    ]  # fmt: skip

    def run(*args: str) -> str:
        proc = subprocess.run(
            [*buildah, *args], capture_output=True, text=True, timeout=120, check=False
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    ctr = run("from", "scratch")
    run(
        "config",
        "--user", "4242:4343",
        "--entrypoint", '["kvmapd"]',
        "--cmd", '["serve", "--config", "/etc/x.toml"]',
        "--port", "50051", "--port", "9464",
        "--env", "HOME=/tmp",
        ctr,
    )  # fmt: skip
    run("commit", "--rm", "--quiet", ctr, "localhost/kvmap-inspect-probe:1")
    image = ic.image_config(
        json.loads(run("inspect", "--type", "image", "localhost/kvmap-inspect-probe:1"))
    )
    run("rmi", "--all", "--force")
    assert image.user == "4242:4343"
    assert image.entrypoint == ("kvmapd",)
    assert image.cmd == ("serve", "--config", "/etc/x.toml")
    assert image.ports == {"50051/tcp", "9464/tcp"}
    assert image.env["HOME"] == "/tmp"
