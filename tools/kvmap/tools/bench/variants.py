"""What limits one full-page pull: raw NIXL (``raw_nixl``, no daemon) pulling
the bench's full-page bandwidth request under variants of how it is posted
and of UCX's settings, next to single-thread and all-core memcpy measured in
the same run. docs/benchmarks.md records a run.

    python -m kvmap.tools.bench.variants [--profile glm53] [--repeats 5]

Variants (each: a warm-up round, then the median of ``--repeats``):

- ``as posted``: the lists the planner's daemon posts (prepared index pairs,
  which NIXL merges where they are adjacent on both sides);
- ``split K``: the same descriptors cut into K xfer handles posted back to
  back (UCX may then work on several at once);
- ``explicit``: every descriptor as an explicit row (no prepared lists);
- ``contiguous``: the contiguous request's first blocks (coalesce: one
  descriptor per group, megabytes long);
- UCX environments: ``UCX_TLS`` restricted to tcp (no CMA), to tcp and CMA,
  to shared memory (``sm``) and tcp, a zero-copy threshold, and the UCX
  backend's ``num_workers``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvmap.tools.bench import host, workload
from kvmap.tools.bench.options import MIB
from kvmap.tools.bench.profiles import get_profile
from kvmap.tools.bench.raw_nixl import RawPair
from kvmap.tools.bench.workload import Request

# (label, UCX environment, UCX backend num_workers)
ENVIRONMENTS: tuple[tuple[str, dict[str, str], int], ...] = (
    ("default UCX", {}, 0),
    ("UCX_TLS=tcp (no CMA)", {"UCX_TLS": "tcp"}, 0),
    ("UCX_TLS=tcp,cma", {"UCX_TLS": "tcp,cma"}, 0),
    ("UCX_TLS=sm,tcp", {"UCX_TLS": "sm,tcp"}, 0),
    ("UCX_ZCOPY_THRESH=0", {"UCX_ZCOPY_THRESH": "0"}, 0),
    ("num_workers=2", {}, 2),
    ("num_workers=4", {}, 4),
)
# (label, pull options) tried under the default environment.
POSTINGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("as posted", {}),
    ("split 2", {"split": 2}),
    ("split 4", {"split": 4}),
    ("split 8", {"split": 8}),
    ("explicit", {"explicit": True}),
)


def _gbps(rp: RawPair, prep: str, req: Request, repeats: int, **opt: Any) -> dict[str, Any]:
    spec = [{"prep": prep, "groups": req.spec()}]
    rp.pull(spec, 1, **opt)  # warm up: the destination pages become resident
    out = rp.pull(spec, repeats, **opt)
    seconds = statistics.median(r["pull_seconds"][0] for r in out["rounds"])
    return {
        "gbps": out["bytes"][0] / seconds / 1e9,
        "descriptors": out["descriptors"][0],
        "bytes": out["bytes"][0],
    }


def _pair(
    stack: contextlib.ExitStack, workdir: Path, profile: str, env: dict[str, str], workers: int
) -> tuple[RawPair, Request, Request]:
    prof = get_profile(profile)
    scattered, contiguous = workload.requests(prof)
    full = prof.geometry()
    budget = 256 * MIB
    bw = scattered.head(workload.bandwidth_blocks(full, scattered, budget))
    co = contiguous.head(workload.bandwidth_blocks(full, contiguous, budget))
    rp = RawPair(stack, workdir, env=env, num_workers=workers)
    rp.register("full", profile, 1)
    for req in (bw, co):
        rp.touch(
            "full", [{"group": g, "blocks": i} for g, i in zip(req.groups, req.remote, strict=True)]
        )
    rp.connect()
    for planner in ("baseline", "coalesce"):
        rp.prepare(planner, planner, "full", profile=profile, divisor=1, groups=bw.groups)
    return rp, bw, co


def run(profile: str, repeats: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []

    def add(label: str, planner: str, fig: dict[str, Any]) -> None:
        rows.append({"variant": label, "planner": planner, **fig})
        print(f"  .. {label:28s} {planner:9s} {fig['gbps']:6.2f} GB/s "
              f"({fig['descriptors']:,} descriptors)", file=sys.stderr, flush=True)  # fmt: skip

    rows.append({"variant": "memcpy, one thread", "gbps": host.memcpy_gbps(256 * MIB)})
    rows.append({"variant": "memcpy, all cores", "gbps": host.memcpy_all_cores_gbps(256 * MIB)})
    with tempfile.TemporaryDirectory(prefix="kvmap-variants-") as tmp:
        for i, (label, env, workers) in enumerate(ENVIRONMENTS):
            try:
                _environment(
                    Path(tmp) / str(i),
                    profile,
                    (label, env, workers),
                    every_posting=i == 0,
                    repeats=repeats,
                    add=add,
                )
            except (RuntimeError, TimeoutError, OSError) as err:
                rows.append({"variant": label, "error": str(err)[-300:]})
                print(f"  .. {label}: failed: {str(err)[-300:]}", file=sys.stderr, flush=True)
    return rows


def _environment(
    workdir: Path,
    profile: str,
    environment: tuple[str, dict[str, str], int],
    *,
    every_posting: bool,
    repeats: int,
    add: Callable[[str, str, dict[str, Any]], None],
) -> None:
    label, env, workers = environment
    with contextlib.ExitStack() as stack:
        rp, bw, co = _pair(stack, workdir, profile, env, workers)
        for planner in ("baseline", "coalesce"):
            for plabel, opt in POSTINGS if every_posting else POSTINGS[:1]:
                add(
                    plabel if every_posting else label,
                    planner,
                    _gbps(rp, planner, bw, repeats, **opt),
                )
            if every_posting:
                add("contiguous", planner, _gbps(rp, planner, co, repeats))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvmap.tools.bench.variants", allow_abbrev=False)
    p.add_argument("--profile", default="glm53")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    print(json.dumps(run(args.profile, args.repeats), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
