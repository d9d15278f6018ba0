"""A TP pod on one daemon: ``--tp8-workers`` full-scale workers of one
profile (sparse memfds, as vLLM's TP ranks would hand over their KV caches)
registered with one prefill daemon all at once, and a decode peer's first
pulls from every one of them.

Measured: the wall time from the first RegisterWorker call to the last
worker ready (``ready_seconds_total``) and the slowest worker's own round
trip (``ready_seconds_max``); the daemon's own resident memory afterwards
(shared KV pages left out, as ``pair.daemon_rss``); the region maps' bytes
(all workers) and the agent metadata a peer downloads (one agent for the
whole pod); and the first contact of a decode daemon that pulls one block
per group from every worker at once (handshakes with every worker, the
remote agent, UCX connection, piece tables and lists), minus the same pulls
again. The ranks register from threads of one bench worker process (the
daemon sees the same concurrent RegisterWorker calls either way).
"""

from __future__ import annotations

import base64
import contextlib
import tempfile
from pathlib import Path

from kvmap.tools.bench.options import Options
from kvmap.tools.bench.pair import Pair, agent_metadata, call, daemon_rss, start_daemons
from kvmap.tools.bench.profiles import Profile, get_profile
from kvmap.tools.bench.results import Tp8
from kvmap.tools.bench.workload import Request


def measure_pod(opts: Options) -> Tp8:
    assert opts.tp8_profile is not None
    with tempfile.TemporaryDirectory(prefix="kvmap-bench-tp8-") as tmp:
        try:
            return _measure(opts, opts.tp8_profile, Path(tmp))
        except (RuntimeError, TimeoutError, AssertionError, OSError) as err:
            raise RuntimeError(f"tp8: {err}") from err


def _measure(opts: Options, profile_name: str, workdir: Path) -> Tp8:
    profile = get_profile(profile_name)
    planner = opts.single_planner()
    names = [f"tp{i}" for i in range(opts.tp8_workers)]
    with contextlib.ExitStack() as stack:
        daemons = start_daemons(workdir, [planner], opts.daemon_flags())
        pair = Pair(stack, planner, daemons[planner])
        cmds = [
            {
                "cmd": "register",
                "name": n,
                "engine_id": f"prefill-{n}",
                "profile": profile_name,
                "divisor": 1,
            }
            for n in names
        ]
        out = call(pair.pw, {"cmd": "register_many", "workers": cmds})
        ready = [float(w["ready_seconds"]) for w in out["workers"]]
        rss = daemon_rss(pair.prefill.proc.pid)
        region_maps = sum(len(base64.b64decode(w["region_map"])) for w in out["workers"])
        metadata = agent_metadata(pair.prefill.tcp_target, f"prefill-{names[0]}")
        pair.register("decode", "full", profile_name, 1)
        first = _first_contact(pair, profile, names)
        opts.progress(
            f"tp8: {len(names)} x {profile_name} ({planner}) ready in "
            f"{out['wall_seconds'] * 1e3:.1f} ms, daemon RSS {rss / 1e6:.0f} MB, "
            f"first contact {first * 1e3:.1f} ms"
        )
        return Tp8(
            planner=planner,
            profile=profile_name,
            workers=len(names),
            ready_seconds_total=float(out["wall_seconds"]),
            ready_seconds_max=max(ready),
            daemon_rss_bytes=rss,
            region_map_bytes=region_maps,
            agent_metadata_bytes=len(metadata.agent_metadata),
            first_contact_seconds=first,
        )


def _first_contact(pair: Pair, profile: Profile, names: list[str]) -> float:
    """One block per group from every worker at once (distinct local
    blocks), cold, minus the same again."""
    groups = tuple(g.transfer_group for g in profile.request_groups)
    reqs = [
        Request(groups, [[i + 1] for _ in groups], [[1] for _ in groups]) for i in range(len(names))
    ]
    for n, req in zip(names, reqs, strict=True):
        pair.fill(n, req)
    walls = []
    for _ in range(2):
        outs = pair.pull_many([("full", req, n) for n, req in zip(names, reqs, strict=True)])
        walls.append(max(float(o["wall_seconds"]) for o in outs))
    return max(0.0, walls[0] - walls[1])
