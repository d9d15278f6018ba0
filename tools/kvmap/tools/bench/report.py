"""Plain-text tables of a ``kvmapd bench`` result (the ``results.BenchResult``
that ``runner.run_bench`` returns): one table per profile, planners side by
side, and each planner's gain over ``baseline`` (> 1 is better, whatever the
direction of the figure)."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvmap.tools.bench.results import (
    BenchResult,
    PlannerResult,
    ProfileInfo,
    Restart,
    Throughput,
    Tp8,
)


def _int(v: Any) -> str:
    return f"{int(v):,}"


def _ms(v: Any) -> str:
    ms = float(v) * 1e3
    return f"{ms:.3f}" if ms < 1 else f"{ms:.1f}" if ms >= 100 else f"{ms:.2f}"


def _us(v: Any) -> str:
    return f"{float(v):.2f}"


def _gbps(v: Any) -> str:
    return f"{float(v):.2f}"


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB" if n < 1e9 else f"{n / 1e9:,.2f} GB"


@dataclass(frozen=True)
class Row:
    label: str
    key: str
    fmt: Callable[[Any], str]


ROWS = (
    Row("regions", "regions", _int),
    Row("registered descriptors", "descriptors", _int),
    Row("NIXL registrations", "nixl_registrations", _int),
    Row("agent metadata bytes", "agent_metadata_bytes", _int),
    Row("region map bytes", "region_map_bytes", _int),
    Row("ready ms (RegisterWorker)", "ready_seconds", _ms),
    Row("first contact ms (cold, end to end)", "first_contact_seconds", _ms),
    Row("first contact ms (steps, median)", "first_contact_steps_seconds", _ms),
    Row("scattered: descriptors/transfer", "descriptors_per_transfer_scattered", _int),
    Row("scattered: post ms", "post_seconds_scattered", _ms),
    Row("scattered: completion ms", "completion_seconds_scattered", _ms),
    Row("contiguous: descriptors/transfer", "descriptors_per_transfer_contiguous", _int),
    Row("contiguous: post ms", "post_seconds_contiguous", _ms),
    Row("contiguous: completion ms", "completion_seconds_contiguous", _ms),
    Row("pull GB/s (full pages)", "pull_gbps", _gbps),
    Row("descriptor cost: post us per descriptor", "post_us_per_descriptor", _us),
)

# Upstream's gain in post p95 at concurrency 32 (vLLM PR 60851, GLM-5.3).
UPSTREAM_POST_P95_GAIN = 74.0


def _level_rows(results: dict[str, PlannerResult]) -> list[list[str]]:
    """Concurrency and raw NIXL figures (nested in the result), planners side by side."""
    first = next(iter(results.values()))
    rows = []
    for n in first.concurrency:
        for label, key in (
            ("post p50 / p95 / max ms", "post"),
            ("pull p50 / p95 ms (Pull to DONE)", "pull"),
        ):
            cells = []
            for r in results.values():
                c = r.concurrency[n]
                cells.append(
                    f"{_ms(c.post_p50_seconds)} / {_ms(c.post_p95_seconds)} / "
                    f"{_ms(c.post_max_seconds)}"
                    if key == "post"
                    else f"{_ms(c.pull_p50_seconds)} / {_ms(c.pull_p95_seconds)}"
                )
            rows.append([f"N={n}: {label}", *cells])
    top = max(first.concurrency, key=int)
    rs = list(results.values())
    rows += [
        [f"raw NIXL: pull p95 ms at N={top}", *(_ms(r.raw_nixl.pull_seconds) for r in rs)],
        [f"kvmap / raw NIXL pull p95 at N={top}", *(f"{r.pull_vs_raw_nixl:.2f}x" for r in rs)],
        ["raw NIXL: GB/s (full pages)", *(_gbps(r.raw_nixl.gbps) for r in rs)],
        ["kvmap / raw NIXL GB/s", *(_share(r.pull_gbps, r.raw_nixl.gbps) for r in rs)],
        ["descriptor cost: post ms (kvmap / raw NIXL)", *(_desc_posts(r) for r in rs)],
    ]
    return rows


def _share(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else "-"


def _desc_posts(r: PlannerResult) -> str:
    kvmap = statistics.median(r.samples.descriptor_cost.post_seconds or [0.0])
    return f"{_ms(kvmap)} / {_ms(r.raw_nixl.post_seconds)}"


def post_p95_gain(results: dict[str, PlannerResult], planner: str = "coalesce") -> str:
    """Baseline's post p95 over ``planner``'s at the highest concurrency."""
    if "baseline" not in results or planner not in results:
        return ""
    base, other = results["baseline"], results[planner]
    top = max(base.concurrency, key=int)
    b, o = base.concurrency[top].post_p95_seconds, other.concurrency[top].post_p95_seconds
    gain = b / o if o > 0 else float("inf")
    return (
        f"  post p95 at N={top}: baseline {_ms(b)} ms, {planner} {_ms(o)} ms: {gain:,.1f}x "
        f"(upstream, GLM-5.3 on GB200: {UPSTREAM_POST_P95_GAIN:.0f}x)"
    )


def _gain(r: PlannerResult, key: str) -> str:
    if r.vs_baseline is None or key not in r.vs_baseline:
        return ""
    g = r.vs_baseline[key]
    return "-" if g is None else f"{g:,.2f}x"


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    out = []
    for r in [headers, *rows]:
        cells = [r[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)
        ]
        out.append("  " + "  ".join(cells).rstrip())
    return out


def _header(name: str, info: ProfileInfo, repeats: int) -> list[str]:
    ts, bw, frag = info.timing_scale, info.bandwidth_request, info.fragmentation
    blocks = "+".join(f"{n:,}" for n in info.request_blocks)
    return [
        f"{name}: {info.title}",
        f"  source: {info.source}",
        f"  full scale: {info.views} views in {info.allocations} allocations, "
        f"{info.blocks:,} blocks of {info.block_tokens} tokens "
        f"({_mb(info.allocated_bytes)} mapped sparse)",
        f"  {info.request_tokens:,}-token requests: {blocks} blocks, "
        f"{_mb(info.request_bytes_full_scale)} at full scale; timed at 1/{ts.page_divisor} "
        f"page bytes ({', '.join(f'{p:,}' for p in ts.page_bytes)} B pages, "
        f"{_mb(ts.request_bytes)}); descriptor counts as at full scale",
        f"  scattered ids: consecutive neighbours {frag.ascending_pairs_local:.1%} decode, "
        f"{frag.ascending_pairs_remote:.1%} prefill, {frag.ascending_pairs_both:.1%} both",
        f"  bandwidth: {'+'.join(str(n) for n in bw.blocks)} scattered blocks at full page "
        f"size ({_mb(bw.bytes)}); memcpy {info.memcpy_gbps:.2f} GB/s; times are medians "
        f"of {repeats}",
        "",
    ]


def _rows(results: dict[str, PlannerResult], others: list[str]) -> list[list[str]]:
    """The figures, one row each: planners side by side, then gains."""
    rows = [
        [row.label, *(row.fmt(r.figure(row.key)) for r in results.values())]
        + [_gain(results[p], row.key) for p in others]
        for row in ROWS
    ]
    rss = [
        f"{r.daemon_rss_bytes.prefill / 1e6:,.0f} / {r.daemon_rss_bytes.decode / 1e6:,.0f}"
        for r in results.values()
    ]
    rows.append(["daemon RSS MB (prefill / decode)", *rss, *([""] * len(others))])
    checks = [
        ("yes" if r.verified else f"NO ({r.bad_blocks} blocks)") + f", {_mb(r.bytes_verified)}"
        for r in results.values()
    ]
    rows.append(["bytes verified", *checks, *([""] * len(others))])
    rows += [row + [""] * len(others) for row in _level_rows(results)]
    return rows


def render_profile(name: str, results: dict[str, PlannerResult], info: ProfileInfo) -> str:
    planners = list(results)
    others = [p for p in planners if p != "baseline"] if "baseline" in results else []
    lines = _header(name, info, results[planners[0]].repeats)
    headers = ["", *planners, *(f"{p} vs baseline" for p in others)]
    lines += _table(headers, _rows(results, others))
    mismatch = [
        p
        for p, r in results.items()
        if r.descriptors_per_transfer_scattered != r.descriptors_per_transfer_scattered_full_scale
    ]
    gain = post_p95_gain(results)
    if gain:
        lines.append(gain)
    if mismatch:
        lines.append(f"  WARNING: scaled descriptor counts differ from full scale for {mismatch}")
    return "\n".join(lines) + "\n"


def render(result: BenchResult) -> str:
    m = result.machine
    out = [
        f"kvmapd bench: {m.cpu}, {m.cpus} CPUs, {m.memory_bytes / 2**30:.0f} GiB; {m.transport}",
        f"memcpy {result.memcpy_gbps:.2f} GB/s (single thread, {_mb(result.memcpy_bytes)}, "
        f"median over the run), {result.memcpy_all_cores_gbps:.2f} GB/s on all cores: "
        "the physical limit of a pull on this machine",
        "",
    ]
    for name, results in result.profiles.items():
        out.append(render_profile(name, results, result.profile_info[name]))
    if result.tp8 is not None:
        out.append(render_tp8(result.tp8))
    if result.throughput is not None:
        out.append(render_throughput(result.throughput))
    if result.restart is not None:
        out.append(render_restart(result.restart))
    out.append(f"run took {result.seconds:.0f}s")
    return "\n".join(out) + "\n"


def render_throughput(by_cores: dict[str, Throughput]) -> str:
    lines = []
    for t in by_cores.values():
        ratio = t.kvmap_pulls_per_second / t.raw_nixl_pulls_per_second
        lines.append(
            f"pod throughput, {t.ranks} ranks pulling at once on {t.cores} core(s): kvmap "
            f"{t.kvmap_pulls_per_second:,.0f} pulls/s, {t.ranks} raw NIXL agent pairs "
            f"{t.raw_nixl_pulls_per_second:,.0f} pulls/s ({ratio:.2f}x)"
        )
    return "\n".join(lines) + "\n"


def render_restart(r: Restart) -> str:
    return (
        f"restart: kvmapd serve ready in {_ms(r.ready_seconds)} ms; a SIGTERM upgrade of the "
        f"prefill daemon: unreachable {_ms(r.unreachable_seconds)} ms, pull latency added "
        f"{_ms(r.added_pull_seconds)} ms\n"
    )


def render_tp8(t: Tp8) -> str:
    return (
        f"TP pod: {t.workers} full-scale {t.profile} workers on one daemon ({t.planner}): "
        f"all ready in {_ms(t.ready_seconds_total)} ms (slowest {_ms(t.ready_seconds_max)} ms), "
        f"daemon RSS {t.daemon_rss_bytes / 1e6:,.0f} MB, region maps {t.region_map_bytes:,} B, "
        f"agent metadata {t.agent_metadata_bytes:,} B, first contact of a peer pulling from "
        f"all {t.workers}: {_ms(t.first_contact_seconds)} ms\n"
    )
