"""``kvmapd bench`` on the tiny profile: the figures are present and agree with
each other (not timed: nothing here depends on how fast the machine is)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvmap.core import planner as planners
from kvmap.core.config import DEFAULT_NIXL_THREADS
from kvmap.tools.bench import blockpool, pair, plot, report, results, series, workload
from kvmap.tools.bench.options import MIB
from kvmap.tools.bench.profiles import DEFAULT_PROFILES, PROFILES, get_profile


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("bench")
    png = out / "bench.png"
    args = ["--profile", "tiny", "--repeats", "2", "--memcpy-mib", "16", "--json", "--quiet"]
    args += ["--concurrency-mib", "16", "--tp8-profile", "tiny"]
    args += ["--throughput-profile", "tiny", "--throughput-ranks", "2", "--throughput-pulls", "3"]
    args += ["--restart-rounds", "1"]
    return bench_json([*args, "--plot", str(png)], out), png


def bench_json(args: list[str], cwd: Path) -> dict[str, Any]:
    """``kvmapd bench ARGS`` (with ``--json``): its result, which must have
    exited 0 (every pulled byte verified)."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvmap.daemon.cli.kvmapd", "bench", *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=cwd,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


@pytest.mark.integration
def test_json_schema(tiny: tuple[dict[str, Any], Path]) -> None:
    """kvmapd bench --json on the tiny profile reports the schema version, a memcpy figure and, per
    planner (baseline first), every required key and ratios against baseline."""
    result, _ = tiny
    assert result["schema"] == results.SCHEMA
    assert result["memcpy_gbps"] > 0
    assert result["nixl_threads"] == DEFAULT_NIXL_THREADS  # the daemon's default, both sides
    assert result["check_before_read"] is True  # the daemon's default
    assert set(result["profiles"]) == {"tiny"}
    planners_run = list(result["profiles"]["tiny"])
    assert planners_run[0] == "baseline"
    assert set(planners_run) == set(planners.PLANNERS)
    for name, r in result["profiles"]["tiny"].items():
        missing = [k for k in results.REQUIRED_KEYS if k not in r]
        assert not missing, (name, missing)
        for key in (
            "nixl_registrations",
            "agent_metadata_bytes",
            "descriptors_per_transfer_contiguous",
            "post_seconds_contiguous",
            "completion_seconds_scattered",
            "completion_seconds_contiguous",
            "daemon_rss_bytes",
        ):
            assert key in r, (name, key)
        assert r["planner"]["name"] == name
        if name != "baseline":
            assert set(r["vs_baseline"]) == {k for k, _ in results.RATIO_KEYS}
    info = result["profile_info"]["tiny"]
    assert info["timing_scale"]["page_divisor"] == 1  # tiny fits at full scale


@pytest.mark.integration
def test_figures_are_consistent(tiny: tuple[dict[str, Any], Path]) -> None:
    """The tiny bench's figures agree with the profile's geometry: baseline posts one descriptor per
    layer per block, no planner does worse, coalesce posts one run per group, every pull was
    verified byte for byte and its owner notified."""
    result, _ = tiny
    profile = get_profile("tiny")
    geometry = profile.geometry()
    layers, blocks = len(geometry.views), profile.num_blocks
    request_blocks = result["profile_info"]["tiny"]["request_blocks"]
    base = result["profiles"]["tiny"]["baseline"]
    assert base["regions"] == layers
    assert base["descriptors"] == layers * blocks == base["baseline_descriptors"]
    # Per-layer regions of a block-outermost cache are never whole rows: one
    # descriptor per layer per block, scattered or not.
    per_transfer = sum(
        n * sum(1 for v in geometry.views if v.transfer_group == g.transfer_group)
        for n, g in zip(request_blocks, profile.request_groups, strict=True)
    )
    assert base["descriptors_per_transfer_scattered"] == per_transfer
    assert base["descriptors_per_transfer_contiguous"] == per_transfer
    for name, r in result["profiles"]["tiny"].items():
        assert r["descriptors"] <= base["descriptors"], name
        assert r["regions"] <= base["regions"], name
        assert r["descriptors_per_transfer_scattered"] <= per_transfer, name
        assert (
            r["descriptors_per_transfer_scattered"]
            == r["descriptors_per_transfer_scattered_full_scale"]
        ), name
        assert (
            r["descriptors_per_transfer_contiguous"]
            == r["descriptors_per_transfer_contiguous_full_scale"]
        ), name
        # The daemon registers each allocation once, whatever the planner.
        assert r["nixl_registrations"] == len(geometry.allocations), name
        assert r["agent_metadata_bytes"] > 0 and r["region_map_bytes"] > 0, name
        # Every byte of every timed pull was checked, and it was right.
        assert r["verified"] and r["bad_blocks"] == 0, name
        assert r["bytes_verified"] == (
            r["pull_bytes"] + r["bytes_scattered"] + r["bytes_contiguous"]
            + _scaled_bytes(result["profile_info"]["tiny"])
        ), name  # fmt: skip
        assert r["bytes_scattered"] == r["bytes_contiguous"] > 0, name
        assert r["owner_notified"] == r["pulls"], name
        assert r["first_contact_handshaked"], name
        assert r["pull_gbps"] > 0 and r["ready_seconds"] > 0, name
        assert r["post_seconds_scattered"] > 0 and r["post_seconds_contiguous"] > 0, name
        assert all(n > 0 for n in r["daemon_rss_bytes"].values()), name
        assert len(r["samples"]["scattered"]["post_seconds"]) == 2, name
    coalesce = result["profiles"]["tiny"]["coalesce"]
    assert coalesce["post_us_per_descriptor"] > 0
    assert coalesce["regions"] == 2  # one full-row region per allocation
    assert coalesce["descriptors"] == 2 * blocks
    assert coalesce["descriptors_per_transfer_contiguous"] == 2  # one run per group
    assert coalesce["vs_baseline"]["descriptors"] == pytest.approx(layers / 2)


@pytest.mark.integration
def test_table_and_plot(tiny: tuple[dict[str, Any], Path]) -> None:
    """The text report renders the bench result with its labelled rows and the coalesce-vs-baseline
    comparison, and --plot writes a PNG file."""
    result, png = tiny
    text = report.render(results.BenchResult.from_json(result))
    for label in ("registered descriptors", "scattered: post ms", "pull GB/s", "bytes verified"):
        assert label in text
    assert "coalesce vs baseline" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.integration
def test_typed_result_writes_the_same_json(tiny: tuple[dict[str, Any], Path]) -> None:
    """The --json output read back as a BenchResult and written again is the same text: the typed
    result is the whole schema, keys and order included."""
    result, _ = tiny
    typed = results.BenchResult.from_json(result)
    assert json.dumps(typed.to_json(), indent=2) == json.dumps(result, indent=2)
    assert typed.verified
    assert typed.profiles["tiny"]["baseline"].vs_baseline is None


def _scaled_bytes(info: dict[str, Any]) -> int:
    """Bytes of the descriptor-cost request and of every concurrency request
    at their page scales (each verified once)."""
    profile = get_profile("tiny")
    scattered, _ = workload.requests(profile)
    desc = workload.request_bytes(profile.geometry(info["descriptor_cost_divisor"]), scattered)
    pairs, reqs = workload.concurrent_requests(profile, max(results.CONCURRENCY))
    assert pairs == info["concurrency_workers"]
    conc = profile.geometry(info["concurrency_divisor"])
    return desc + sum(workload.request_bytes(conc, req) for _, req in reqs)


@pytest.mark.integration
def test_concurrency_and_raw_nixl_figures(tiny: tuple[dict[str, Any], Path]) -> None:
    """Every planner reports each concurrency level (percentiles ordered, one sample per pull of
    every round, kvmap's and raw NIXL's, CPU and context switches per pull by place), the
    descriptor cost per descriptor from its own samples, and raw NIXL figures whose ratio to
    kvmap is the one reported."""
    result, _ = tiny
    levels = [str(n) for n in results.CONCURRENCY]
    for name, r in result["profiles"]["tiny"].items():
        assert list(r["concurrency"]) == levels, name
        for n in levels:
            c, lat = r["concurrency"][n], r["samples"]["concurrency"][n]
            assert set(c) == {f.name for f in fields(results.Concurrency)}
            assert 0 < c["post_p50_seconds"] <= c["post_p95_seconds"] <= c["post_max_seconds"]
            assert 0 < c["pull_p50_seconds"] <= c["pull_p95_seconds"]
            assert c["post_max_seconds"] == max(lat["post_seconds"])
            # CPU per pull, by place: every place counted (in clock ticks, so
            # a tiny round may count 0, never less).
            cpu = c["cpu_seconds_per_pull"]
            assert set(cpu) == {*pair.CPU_PLACES, "total"} and min(cpu.values()) >= 0, cpu
            raw_cpu = c["raw_nixl_cpu_seconds_per_pull"]
            assert set(raw_cpu) == {*series.RAW_CPU_PLACES, "total"}, raw_cpu
            assert min(raw_cpu.values()) >= 0, raw_cpu
            grant_cpu = c["cpu_seconds_per_grant"]
            assert set(grant_cpu) == {*pair.GRANT_CPU_PLACES, "total"}, grant_cpu
            assert min(grant_cpu.values()) >= 0, grant_cpu
            # Context switches per pull, by place. Every round wakes both
            # daemons (its calls reach one, its BeginTransfers the other) and
            # the worker's waiting pull threads, at least once each.
            switches = c["context_switches_per_pull"]
            assert set(switches) == {*pair.SWITCH_PLACES, "total"}, switches
            for place in ("prefill_daemon", "decode_daemon", "decode_worker"):
                assert switches[place] * int(n) >= 1, (place, switches)
            raw_switches = c["raw_nixl_context_switches_per_pull"]
            assert set(raw_switches) == {*series.RAW_CPU_PLACES, "total"}, raw_switches
            assert min(raw_switches.values()) >= 0, raw_switches
            for shares in (cpu, raw_cpu, grant_cpu, switches, raw_switches):
                parts = sum(v for k, v in shares.items() if k != "total")
                assert shares["total"] == pytest.approx(parts)
            for key in ("post_seconds", "pull_seconds", "raw_post_seconds", "raw_pull_seconds"):
                assert len(lat[key]) == 2 * int(n), (name, n, key)  # 2 rounds of N pulls
            # Raw NIXL's figures at this level are its own samples'.
            assert c["raw_nixl_post_p95_seconds"] == pytest.approx(
                np.percentile(lat["raw_post_seconds"], 95)
            )
            assert c["raw_nixl_pull_p50_seconds"] == pytest.approx(
                np.percentile(lat["raw_pull_seconds"], 50)
            )
            assert c["raw_nixl_pull_p95_seconds"] == pytest.approx(
                np.percentile(lat["raw_pull_seconds"], 95)
            )
            # A pull waits for its own post: Pull-to-DONE covers it.
            assert all(
                p >= q for p, q in zip(lat["pull_seconds"], lat["post_seconds"], strict=True)
            )
        desc = r["samples"]["descriptor_cost"]
        assert len(desc["post_seconds"]) == 2
        per = statistics.median(desc["post_seconds"]) / r["descriptors_per_transfer_scattered"]
        assert r["post_us_per_descriptor"] == pytest.approx(per * 1e6)
        raw = r["raw_nixl"]
        assert set(raw) == {"pull_seconds", "gbps", "post_seconds"}
        assert raw["pull_seconds"] > 0 and raw["gbps"] > 0 and raw["post_seconds"] > 0
        top = r["concurrency"][levels[-1]]["pull_p95_seconds"]
        assert r["pull_vs_raw_nixl"] == pytest.approx(top / raw["pull_seconds"])
        assert len(r["samples"]["raw_bandwidth_seconds"]) == 2


@pytest.mark.integration
def test_memcpy_and_tp_pod(tiny: tuple[dict[str, Any], Path]) -> None:
    """The run reports single-thread and all-core memcpy, and a TP pod of 8 tiny workers on one
    daemon: all ready, the slowest within the total, one agent for the pod, every region map."""
    result, _ = tiny
    assert result["memcpy_gbps"] > 0 and result["memcpy_all_cores_gbps"] > 0
    tp8 = result["tp8"]
    assert {"workers", "ready_seconds_total", "ready_seconds_max", "daemon_rss_bytes",
            "agent_metadata_bytes", "first_contact_seconds"} <= set(tp8)  # fmt: skip
    assert tp8["workers"] == 8 and tp8["profile"] == "tiny"
    assert 0 < tp8["ready_seconds_max"] <= tp8["ready_seconds_total"]
    assert tp8["daemon_rss_bytes"] > 0 and tp8["first_contact_seconds"] >= 0
    single = result["profiles"]["tiny"][tp8["planner"]]
    # One agent holds every worker's memory: more than one worker's metadata...
    assert tp8["agent_metadata_bytes"] > single["agent_metadata_bytes"]
    # ...and eight region maps of the same geometry (names differ by a digit).
    assert tp8["region_map_bytes"] == pytest.approx(8 * single["region_map_bytes"], rel=0.05)


# Pure parts: no processes. ------------------------------------------------------


def test_profiles_at_full_scale() -> None:
    """At full scale the glm53 profile plans to 3,234,222 baseline and 64,044 coalesced descriptors,
    llama-mha gains nothing, and scaling pages down keeps every view and block."""
    glm = get_profile("glm53").geometry()
    assert planners.BASELINE.plan(glm).descriptor_count == 3_234_222  # upstream's "before"
    assert planners.COALESCE.plan(glm).descriptor_count == 64_044
    llama = get_profile("llama-mha").geometry()
    assert (
        planners.COALESCE.plan(llama).descriptor_count
        == planners.BASELINE.plan(llama).descriptor_count
    )
    assert set(DEFAULT_PROFILES) == {"glm53", "dsv3", "llama-mha", "hybrid"}
    for profile in PROFILES.values():
        for divisor in (1, 64):
            g = profile.geometry(divisor)
            plan = planners.BASELINE.plan(g)
            # Scaling pages keeps every view and block: same descriptor count.
            assert plan.descriptor_count == len(g.views) * profile.num_blocks


def test_timing_scale_keeps_requests_within_budget() -> None:
    """Request block lists have the documented sizes, the timing divisor scales glm53 pages by 64 so
    a request fits in 128 MiB, and the hybrid profile's groups draw distinct blocks from one
    pool."""
    glm = get_profile("glm53")
    scattered, contiguous = workload.requests(glm)
    assert [len(ids) for ids in scattered.local] == [2048, 2048]  # 128K tokens / 64
    assert contiguous.local[0] == list(range(1, 2049))
    divisor = workload.timing_divisor(glm, scattered, 128 * MIB)
    assert divisor == 64  # 656 B and 132 B pages: one token's bytes per layer
    assert workload.request_bytes(glm.geometry(divisor), scattered) <= 128 * MIB
    hybrid = get_profile("hybrid")
    sc, _ = workload.requests(hybrid)
    assert [len(ids) for ids in sc.local] == [8192, 9]  # full group, sliding window
    assert not set(sc.local[0]) & set(sc.local[1])  # one pool: distinct rows


def test_table_plot_and_ratio_figures_are_numeric_fields() -> None:
    """Every figure the table, the plot and the ratios read by name (PlannerResult.figure) is a
    numeric field of PlannerResult."""
    numeric = {f.name for f in fields(results.PlannerResult) if f.type in ("int", "float")}
    named = {k for k, _ in results.RATIO_KEYS} | {row.key for row in report.ROWS}
    assert named | {panel[0] for panel in plot.PANELS} <= numeric
    assert "verified" not in numeric and "samples" not in numeric


def test_block_pool_model() -> None:
    """The block pool model gives distinct, non-null, churned (not ascending) ids reproducibly per
    seed for scattered requests, and consecutive ids from 1 for fresh ones."""
    ids = blockpool.scattered(4096, 16, [512, 0], seed=3)
    assert len(ids[0]) == 512 and ids[1] == []
    assert len(set(ids[0])) == 512 and 0 not in ids[0]
    assert blockpool.ascending_pairs(ids[0]) < 0.99  # churned, not a fresh range
    assert blockpool.scattered(4096, 16, [512], seed=3) == ids[:1]  # deterministic
    fresh = blockpool.contiguous(4096, [10, 3])
    assert fresh == [list(range(1, 11)), [11, 12, 13]]
    assert blockpool.ascending_pairs(fresh[0]) == 1.0


def test_concurrent_requests_have_distinct_blocks() -> None:
    """Requests in flight at once never share a block on either side of the same worker pair,
    each has the profile's block counts, and the pairs are as few as the pool allows."""
    for name in ("glm53", "tiny", "hybrid"):
        profile = get_profile(name)
        pairs, reqs = workload.concurrent_requests(profile, 32)
        counts, _ = workload.own_counts(profile)
        assert pairs == -(-32 // blockpool.per_pool(profile.num_blocks, counts)), name
        assert len(reqs) == 32 and {w for w, _ in reqs} == set(range(pairs))
        for w in range(pairs):
            for side in ("local", "remote"):
                ids = [
                    b for pw, r in reqs if pw == w for b in getattr(r, side)[0] + (
                        getattr(r, side)[1] if profile.request_groups[-1].own_blocks else []
                    )
                ]  # fmt: skip
                assert len(ids) == len(set(ids)), (name, w, side)
        first = reqs[0][1]
        assert [len(ids) for ids in first.local] == [
            profile.group_blocks(g) for g in profile.request_groups
        ]


@pytest.mark.integration
def test_throughput_and_restart_figures(tiny: tuple[dict[str, Any], Path]) -> None:
    """The pod throughput series reports, per core count this machine has (1, then 2), kvmap's
    and raw NIXL's pulls per second as the medians of their own samples (one per round, ABBA);
    the restart figures are the medians of theirs, a daemon ready in a positive time and an
    upgrade whose gap covers the latency it added."""
    result, _ = tiny
    throughput = result["throughput"]
    assert list(throughput) == [str(n) for n in (1, 2) if n <= len(os.sched_getaffinity(0))]
    for cores, t in throughput.items():
        assert set(t) == {f.name for f in fields(results.Throughput)}
        assert t["cores"] == int(cores) and t["ranks"] == 2 and t["pulls_per_rank"] == 3
        for kind in ("kvmap", "raw_nixl"):
            assert len(t["samples"][kind]) == 2 and min(t["samples"][kind]) > 0, t
            assert t[f"{kind}_pulls_per_second"] == statistics.median(t["samples"][kind])
    restart = result["restart"]
    assert set(restart) == {f.name for f in fields(results.Restart)}
    for key in ("ready", "unreachable", "added_pull"):
        assert restart[f"{key}_seconds"] == statistics.median(restart["samples"][key]), key
    assert 0 < restart["ready_seconds"] < 60
    # The slowest pull across the gap waited for the daemon to come back.
    assert 0 < restart["added_pull_seconds"] <= restart["unreachable_seconds"] + 1.0
    # The text report shows both.
    rendered = report.render(results.BenchResult.from_json(result))
    assert "pod throughput, 2 ranks" in rendered and "restart: kvmapd serve ready" in rendered


@pytest.mark.integration
def test_pulls_that_read_while_the_owner_checks_verify(tmp_path: Path) -> None:
    """``--no-check-before-read`` starts the daemons with reads that do not
    wait for the owner: every pulled byte of every series still verifies
    (the exit status), and the JSON says which order was measured."""
    args = ["--profile", "tiny", "--planner", "coalesce", "--repeats", "2", "--json", "--quiet"]
    args += ["--memcpy-mib", "16", "--concurrency", "1,4", "--concurrency-mib", "16"]
    args += ["--tp8-profile", "none", "--throughput-profile", "none", "--restart-rounds", "0"]
    result = bench_json([*args, "--no-check-before-read"], tmp_path)
    assert result["check_before_read"] is False
    coalesce = result["profiles"]["tiny"]["coalesce"]
    assert coalesce["verified"] and coalesce["bytes_verified"] > 0
    assert set(coalesce["concurrency"]) == {"1", "4"}
