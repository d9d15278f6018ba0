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
sidecar's args the way the kubelet would (its user, fsGroup, env, emptyDirs,
ConfigMap and Secrets at their mount paths, a Secret's file freshly random with
its defaultMode, read-only root), to be run inside
``unshare --mount --net --pid --fork``; build-and-check.sh then probes it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvmap.tools.image.checks import check_all, image_alone, writable_by
from kvmap.tools.image.expectations import (
    argv,
    config_files,
    daemon_paths,
    mount_covering,
    written_dirs,
)
from kvmap.tools.image.facts import PathFact, image_config, load_facts
from kvmap.tools.image.manifests import K8S, Mount, render, render_all, sidecars
from kvmap.tools.image.pod import expand, pod_script
from kvmap.tools.image.record import collect_facts, sources_digest

# What callers (tests/deploy/test_image_check.py) use through this module.
__all__ = [
    "Mount",
    "PathFact",
    "check_all",
    "expand",
    "image_alone",
    "image_config",
    "load_facts",
    "main",
    "mount_covering",
    "pod_script",
    "render_all",
    "sidecars",
    "sources_digest",
    "writable_by",
]


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
        allow_abbrev=False,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("facts", help="record an image's facts", allow_abbrev=False)
    p.add_argument("--inspect", required=True, help="`buildah inspect --type image` output")
    p.add_argument("--rootfs", required=True, help="the image's mounted root filesystem")
    p.add_argument("--out", required=True)
    p.set_defaults(run=_cmd_facts)
    p = sub.add_parser(
        "check", help="check recorded facts against every kustomization", allow_abbrev=False
    )
    p.add_argument("--facts", required=True)
    p.set_defaults(run=_cmd_check)
    p = sub.add_parser(
        "pod-script", help="bash that runs the sidecar as the kubelet would", allow_abbrev=False
    )
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
