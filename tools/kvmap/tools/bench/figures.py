"""A planner's figures (``results.PlannerResult``) from what its run
measured, cross-checked against pure planning at full scale; and the gains
of every planner over ``baseline``."""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass, replace
from typing import Any

from kvmap.core import convert
from kvmap.core import planner as planners
from kvmap.core.geometry import RegionMapModel
from kvmap.core.transfer_pieces import LayerSelection, build_piece_table
from kvmap.core.transfer_plan import GroupPairs, plan_transfer
from kvmap.tools.bench.options import Options
from kvmap.tools.bench.results import (
    RATIO_KEYS,
    PlannerResult,
    RawNixl,
    Samples,
    ratio,
)
from kvmap.tools.bench.series import PlannerRun, PullSeries, median, pct
from kvmap.tools.bench.workload import ProfilePlan, Request
from kvmap.v1 import types_pb2


def _model(b64: str) -> RegionMapModel:
    return convert.region_map_from_proto(types_pb2.RegionMap.FromString(base64.b64decode(b64)))


def full_scale_descriptors(local: RegionMapModel, remote: RegionMapModel, req: Request) -> int:
    """Descriptors ``req`` takes between two full-scale maps (pure planning)."""
    table = build_piece_table(local, remote, [LayerSelection(g) for g in req.groups])
    pairs = [
        GroupPairs(g, loc, rem)
        for g, loc, rem in zip(req.groups, req.local, req.remote, strict=True)
    ]
    return plan_transfer(table, pairs).descriptors


@dataclass(frozen=True)
class FullScale:
    """The full-scale workers' maps, and what pure planning says of them."""

    plan_seconds: float  # the planner alone, on the profile's geometry
    remote_map: RegionMapModel  # the prefill worker's, as its daemon registered it
    scattered_descriptors: int  # per transfer, between the two full-scale maps
    contiguous_descriptors: int


def _full_scale(pp: ProfilePlan, run: PlannerRun, planner: planners.Planner) -> FullScale:
    """The daemon must have registered what the planner alone plans."""
    start = time.perf_counter()
    plan = planner.plan(pp.profile.geometry())
    plan_s = time.perf_counter() - start
    remote_map = _model(run.full_prefill["region_map"])
    if remote_map.descriptor_count != plan.descriptor_count:
        raise RuntimeError(
            f"{pp.profile.name}/{planner.info.name}: the daemon registered "
            f"{remote_map.descriptor_count} descriptors, the planner alone plans "
            f"{plan.descriptor_count}"
        )
    local_map = _model(run.full_decode["region_map"])
    return FullScale(
        plan_seconds=plan_s,
        remote_map=remote_map,
        scattered_descriptors=full_scale_descriptors(local_map, remote_map, pp.scattered),
        contiguous_descriptors=full_scale_descriptors(local_map, remote_map, pp.contiguous),
    )


def _contact_steps(steps: dict[str, Any]) -> dict[str, float]:
    """The medians (and piece count) of ``bench.contact``'s answer."""
    return {k: v for k, v in steps.items() if k.endswith("_seconds") or k == "pieces"}


def _samples(run: PlannerRun) -> Samples:
    return Samples(
        ready_seconds=run.ready,
        first_contact_steps=run.contact_steps["samples"],
        bandwidth=run.series["bandwidth"].samples(),
        scattered=run.series["scattered"].samples(),
        contiguous=run.series["contiguous"].samples(),
        descriptor_cost=run.series["descriptor_cost"].samples(),
        concurrency={str(n): lat.samples() for n, lat in run.latency.items()},
        raw_bandwidth_seconds=run.raw_bandwidth,
        raw_descriptor_cost_post_seconds=run.raw_desc_post,
    )


def _gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / median(seconds) / 1e9 if seconds else 0.0


def planner_result(pp: ProfilePlan, run: PlannerRun, opts: Options) -> PlannerResult:
    planner = planners.get_planner(run.pair.planner)
    full = _full_scale(pp, run, planner)
    remote_map = full.remote_map
    assert run.metadata is not None
    bw, sc, co = (run.series[k] for k in ("bandwidth", "scattered", "contiguous"))
    bad = sum(s.bad_blocks for s in run.series.values())
    return PlannerResult(
        planner=planner.info,
        regions=len(remote_map.regions),
        descriptors=remote_map.descriptor_count,
        baseline_descriptors=remote_map.baseline_descriptor_count,
        # The daemon registers each allocation with NIXL exactly once
        # (registration.py), whatever the planner.
        nixl_registrations=len(remote_map.allocations),
        agent_metadata_bytes=len(run.metadata.agent_metadata),
        region_map_bytes=run.metadata.region_map.ByteSize(),
        registration_request_bytes=int(run.full_prefill["request_bytes"]),
        plan_seconds=full.plan_seconds,
        ready_seconds=median(run.ready),
        first_contact_seconds=max(0.0, run.cold_contact),
        first_contact_steps_seconds=run.contact_steps["total_seconds"],
        first_contact_steps=_contact_steps(run.contact_steps),
        first_contact_handshaked=run.handshaked,
        descriptors_per_transfer_scattered=sc.descriptors,
        descriptors_per_transfer_scattered_full_scale=full.scattered_descriptors,
        post_seconds_scattered=median(sc.post),
        completion_seconds_scattered=median(sc.completion),
        transfer_seconds_scattered=median(sc.transfer),
        bytes_scattered=sc.bytes,
        descriptors_per_transfer_contiguous=co.descriptors,
        descriptors_per_transfer_contiguous_full_scale=full.contiguous_descriptors,
        post_seconds_contiguous=median(co.post),
        completion_seconds_contiguous=median(co.completion),
        transfer_seconds_contiguous=median(co.transfer),
        bytes_contiguous=co.bytes,
        pull_gbps=_gbps(bw.bytes, bw.transfer),
        pull_gbps_wall=_gbps(bw.bytes, bw.wall),
        pull_bytes=bw.bytes,
        pull_descriptors=bw.descriptors,
        daemon_rss_bytes=run.rss,
        daemon_rss_ready_bytes=run.rss_ready,
        bytes_verified=sum(s.verified_bytes for s in run.series.values()),
        bad_blocks=bad,
        verified=bad == 0,
        pulls=run.pair.pulls,
        owner_notified=run.notified,
        repeats=opts.repeats,
        samples=_samples(run),
        **_new_figures(run, bw),
    )


def _new_figures(run: PlannerRun, bw: PullSeries) -> dict[str, Any]:
    """Concurrency, descriptor cost and raw NIXL figures of ``run``."""
    desc = run.series["descriptor_cost"]
    top = run.latency[max(run.latency)]
    raw_p95 = pct(top.raw_pull, 95)
    return {
        "concurrency": {str(n): lat.figures() for n, lat in run.latency.items()},
        "post_us_per_descriptor": median(desc.post) / max(1, desc.descriptors) * 1e6,
        "raw_nixl": RawNixl(
            pull_seconds=raw_p95,
            gbps=_gbps(bw.bytes, run.raw_bandwidth),
            post_seconds=median(run.raw_desc_post),
        ),
        "pull_vs_raw_nixl": pct(top.pull, 95) / raw_p95 if raw_p95 > 0 else 0.0,
    }


# Ratios ----------------------------------------------------------------------


def add_ratios(results: dict[str, PlannerResult]) -> dict[str, PlannerResult]:
    """``results`` with every planner's gains over ``baseline`` (if it ran)."""
    base = results.get("baseline")
    if base is None:
        return results
    return {
        name: r
        if name == "baseline"
        else replace(
            r,
            vs_baseline={
                key: ratio(base.figure(key), r.figure(key), higher) for key, higher in RATIO_KEYS
            },
        )
        for name, r in results.items()
    }
