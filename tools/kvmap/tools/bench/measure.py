"""One profile measured under every planner, on fresh daemons: register,
first contact, the timed pull series, raw NIXL's pulls of the same lists and
the concurrency rounds, planners interleaved ABBA."""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path

from kvmap.tools.bench.figures import planner_result
from kvmap.tools.bench.options import Options
from kvmap.tools.bench.pair import Pair, agent_metadata, start_daemons
from kvmap.tools.bench.raw_nixl import RawPair
from kvmap.tools.bench.results import PlannerResult
from kvmap.tools.bench.series import (
    RAW_CPU_PLACES,
    Latency,
    PlannerRun,
    PullSeries,
    abba,
    interleaved,
    median,
    pct,
)
from kvmap.tools.bench.workload import ProfilePlan, Request


def measure_profile(pp: ProfilePlan, opts: Options) -> dict[str, PlannerResult]:
    """One profile under every planner, on fresh daemons."""
    with tempfile.TemporaryDirectory(prefix="kvmap-bench-") as tmp:
        try:
            return _measure(pp, opts, Path(tmp))
        except (RuntimeError, TimeoutError, AssertionError, OSError) as err:
            raise RuntimeError(f"{pp.profile.name}: {err}{_log_tails(Path(tmp))}") from err


# A daemon's log lines at these levels say where a failed run went wrong;
# its tail is mostly the shutdown that followed.
_NOTABLE = ('"level": "warning"', '"level": "error"', '"level": "critical"')


def _log_tails(workdir: Path, n: int = 1500, notable: int = 30) -> str:
    """Each log's warnings and errors (the last ``notable``), then its last
    ``n`` characters: the temporary directory goes with the failure."""
    out = []
    for log in sorted(workdir.glob("*/*/*.log")):
        with contextlib.suppress(OSError):
            text = log.read_text(errors="replace")
            name = f"{log.parent.parent.name}/{log.name}"
            lines = [line for line in text.splitlines() if any(k in line for k in _NOTABLE)]
            if lines:
                out.append(f"\n--- {name} (warnings and errors, last {notable}) ---\n")
                out.append("\n".join(lines[-notable:]) + "\n")
            out.append(f"\n--- {name} (last {n} chars) ---\n")
            out.append(text[-n:])
    return "".join(out)


# Timed pulls, planners interleaved ABBA: (series, worker name, request).
def _series(pp: ProfilePlan) -> tuple[tuple[str, str, Request], ...]:
    return (
        ("bandwidth", "full", pp.bandwidth),
        ("scattered", "req", pp.scattered),
        ("contiguous", "req", pp.contiguous),
        ("descriptor_cost", "desc", pp.scattered),
    )


def _measure(pp: ProfilePlan, opts: Options, workdir: Path) -> dict[str, PlannerResult]:
    # Extra full-scale prefill workers whose registrations are the timed
    # "ready" samples; the first is also the remote of the cold first contact.
    fresh = [f"ready{i}" for i in range(opts.repeats)]
    with contextlib.ExitStack() as stack:
        runs = _start_pairs(stack, pp, opts, workdir)
        raw = RawPair(stack, workdir / "raw", nixl_threads=opts.nixl_threads)
        _register(runs, pp, fresh)
        _register_scaled(runs, pp)
        _raw_setup(raw, runs, pp)
        _first_contact(runs, pp, opts, fresh[0])
        for kind, name, req in _series(pp):
            _timed_pulls(runs, kind, name, req, opts.repeats)
            opts.progress(f"{pp.profile.name}: {kind} " + ", ".join(
                f"{r.pair.planner} {r.series[kind].descriptors:,} descriptors post "
                f"{median(r.series[kind].post) * 1e3:.1f} ms" for r in runs
            ))  # fmt: skip
        _raw_single(raw, runs, pp, opts.repeats)
        _concurrency(runs, raw, pp, opts)
        for run in runs:
            run.rss = run.pair.rss()
            run.notified = _notified(run.pair)
    return {run.pair.planner: planner_result(pp, run, opts) for run in runs}


def _start_pairs(
    stack: contextlib.ExitStack, pp: ProfilePlan, opts: Options, workdir: Path
) -> list[PlannerRun]:
    """Every planner's daemons and bench workers, in ``opts.planners`` order."""
    t0 = time.perf_counter()
    daemons = start_daemons(workdir, opts.planners, opts.daemon_flags())
    runs = [PlannerRun(Pair(stack, p, daemons[p])) for p in opts.planners]
    opts.progress(f"{pp.profile.name}: {2 * len(runs)} daemons and workers up in "
                  f"{time.perf_counter() - t0:.1f}s")  # fmt: skip
    return runs


def _register(runs: list[PlannerRun], pp: ProfilePlan, fresh: list[str]) -> None:
    """Register every worker. Prefill: the full-scale worker alone first (so
    the agent metadata is one worker's), then the request worker; then the
    ``fresh`` ones, timed, planners interleaved."""
    profile = pp.profile.name
    for run in runs:
        run.full_prefill = run.pair.register("prefill", "full", profile, 1)
        run.metadata = agent_metadata(run.pair.prefill.tcp_target, "prefill-full")
        run.pair.register("prefill", "req", profile, pp.divisor)
        run.full_decode = run.pair.register("decode", "full", profile, 1)
        run.pair.register("decode", "req", profile, pp.divisor)
    for i, name in enumerate(fresh):
        for run in abba(runs, i):
            out = run.pair.register("prefill", name, profile, 1)
            run.ready.append(float(out["ready_seconds"]))
            if i:  # only the first stays (first contact); the rest would
                # add up past max_registered_bytes at full scale
                run.pair.deregister("prefill", name)
    for run in runs:
        run.pair.fill(fresh[0], pp.first_contact)
    for run in runs:
        run.rss_ready = run.pair.rss()


def _register_scaled(runs: list[PlannerRun], pp: ProfilePlan) -> None:
    """The descriptor-cost worker and the concurrency workers, both sides."""
    profile = pp.profile.name
    for run in runs:
        for side in ("prefill", "decode"):
            run.pair.register(side, "desc", profile, pp.descriptor_divisor)
            for w in range(pp.concurrency_pairs):
                run.pair.register(side, f"c{w}", profile, pp.concurrency_divisor)


def _raw_setup(raw: RawPair, runs: list[PlannerRun], pp: ProfilePlan) -> None:
    """Raw NIXL: the same geometries on both sides, resident where pulls
    read; every planner's lists prepared (as its daemon caches them)."""
    name = pp.profile.name
    keys = {"full": 1, "desc": pp.descriptor_divisor}
    keys |= {f"c{w}": pp.concurrency_divisor for w in range(pp.concurrency_pairs)}
    for key, divisor in keys.items():
        raw.register(key, name, divisor)
        if key != "full":
            raw.touch(key)
    bw = pp.bandwidth
    raw.touch(
        "full", [{"group": g, "blocks": ids} for g, ids in zip(bw.groups, bw.remote, strict=True)]
    )
    raw.connect()
    for run in runs:
        for key, divisor in keys.items():
            prep = f"{run.pair.planner}/{key}"
            raw.prepare(
                prep, run.pair.planner, key, profile=name, divisor=divisor, groups=bw.groups
            )


def _raw_rounds(
    raw: RawPair, runs: list[PlannerRun], reqs: list[tuple[str, Request]], repeats: int
) -> dict[str, list[dict[str, list[float]]]]:
    """A warm-up round, then ``repeats`` timed rounds ABBA over planners of
    raw NIXL pulling ``reqs`` ((space, request)) all at once."""
    out: dict[str, list[dict[str, list[float]]]] = {}
    for i in range(-1, repeats):
        for run in abba(runs, max(i, 0)):
            planner = run.pair.planner
            specs = [{"prep": f"{planner}/{k}", "groups": r.spec()} for k, r in reqs]
            rounds = raw.pull(specs, 1)["rounds"]
            if i >= 0:
                out.setdefault(planner, []).extend(rounds)
    return out


def _raw_single(raw: RawPair, runs: list[PlannerRun], pp: ProfilePlan, repeats: int) -> None:
    """Raw NIXL's full-page bandwidth pull and negligible-bytes scattered post."""
    bw = _raw_rounds(raw, runs, [("full", pp.bandwidth)], repeats)
    desc = _raw_rounds(raw, runs, [("desc", pp.scattered)], repeats)
    for run in runs:
        run.raw_bandwidth = [r["pull_seconds"][0] for r in bw[run.pair.planner]]
        run.raw_desc_post = [r["post_seconds"][0] for r in desc[run.pair.planner]]


def _conc_pulls(pp: ProfilePlan, n: int) -> list[tuple[str, Request, str]]:
    return [(f"c{w}", req, f"c{w}") for w, req in pp.concurrent[:n]]


def _concurrency(runs: list[PlannerRun], raw: RawPair, pp: ProfilePlan, opts: Options) -> None:
    """Each level: N scattered pulls in flight at once, ``repeats`` rounds
    per planner (ABBA), then raw NIXL posting the same lists; finally every
    destination byte of the largest level is verified."""
    for run in runs:
        for w, req in pp.concurrent:
            run.pair.fill(f"c{w}", req)
        run.pair.pull_many(_conc_pulls(pp, len(pp.concurrent)))  # warm up
        for w, req in pp.concurrent:
            run.pair.zero(f"c{w}", req)
    for n in opts.concurrency:
        for run in interleaved(runs, opts.repeats):
            lat = run.latency.setdefault(n, Latency())
            pulls = run.pair.pull_many(
                _conc_pulls(pp, n), cpu=lat.cpu, grant_cpu=lat.grant_cpu, switches=lat.switches
            )
            for out in pulls:
                lat.post.append(float(out["stats"]["post_seconds"]))
                lat.pull.append(float(out["wall_seconds"]))
        reqs = [(f"c{w}", r) for w, r in pp.concurrent[:n]]
        for planner, rounds in _raw_rounds(raw, runs, reqs, opts.repeats).items():
            lat = next(r for r in runs if r.pair.planner == planner).latency[n]
            for r in rounds:
                lat.raw_post += r["post_seconds"]
                lat.raw_pull += r["pull_seconds"]
                for place, seconds, switches in zip(
                    RAW_CPU_PLACES, r["cpu_seconds"], r["switches"], strict=True
                ):
                    lat.raw_cpu[place] = lat.raw_cpu.get(place, 0.0) + max(0.0, seconds)
                    lat.raw_switches[place] = lat.raw_switches.get(place, 0.0) + switches
        opts.progress(f"{pp.profile.name}: concurrency {n}: " + ", ".join(
            f"{r.pair.planner} post p95 {pct(r.latency[n].post, 95) * 1e3:.1f} ms, "
            f"pull p95 {pct(r.latency[n].pull, 95) * 1e3:.1f} ms "
            f"(raw NIXL {pct(r.latency[n].raw_pull, 95) * 1e3:.1f} ms)" for r in runs
        ))  # fmt: skip
    for run in runs:
        s = run.series["concurrency"] = PullSeries()
        for w, req in pp.concurrent:
            nbytes, bad = run.pair.verify(f"c{w}", req)
            s.verified_bytes += nbytes
            s.bad_blocks += bad


def _first_contact(runs: list[PlannerRun], pp: ProfilePlan, opts: Options, remote: str) -> None:
    """First contact, end to end: the decode daemon's very first pull
    (handshake, load the remote agent, connect UCX, build the piece table,
    prepare both lists) minus the next identical one. Then the same steps one
    by one, repeated, from the decode worker's process."""
    for run in runs:
        first = run.pair.pull("full", pp.first_contact, remote=remote)
        again = run.pair.pull("full", pp.first_contact, remote=remote)
        run.cold_contact = first["wall_seconds"] - again["wall_seconds"]
        run.handshaked = bool(first["stats"]["handshaked"])
    for run in runs:
        run.contact_steps = run.pair.contact(pp.profile.name, opts.contact_repeats)
    opts.progress(f"{pp.profile.name}: first contact " + ", ".join(
        f"{r.pair.planner} {r.cold_contact * 1e3:.1f} ms cold, "
        f"{r.contact_steps['total_seconds'] * 1e3:.2f} ms in steps" for r in runs
    ))  # fmt: skip


def _timed_pulls(runs: list[PlannerRun], kind: str, name: str, req: Request, repeats: int) -> None:
    """One series: write the source, warm up once, clear the destination,
    pull, verify every byte (only the timed pulls can have written it)."""
    for run in runs:
        run.pair.fill(name, req)
        run.pair.pull(name, req)
        run.pair.zero(name, req)
        run.series[kind] = PullSeries()
    for run in interleaved(runs, repeats):
        run.series[kind].add(run.pair.pull(name, req))
    for run in runs:
        s = run.series[kind]
        s.verified_bytes, s.bad_blocks = run.pair.verify(name, req)


def _notified(pair: Pair, timeout_s: float = 10.0) -> int:
    """Wait (bounded) until the prefill worker was told of every pull."""
    deadline = time.monotonic() + timeout_s
    while True:
        n = pair.notified()
        if n >= pair.pulls or time.monotonic() > deadline:
            return n
        time.sleep(0.05)
