"""``kvmapd bench --plot FILE.png``: the figures as grouped bar charts, one
group per profile, one bar per planner, each non-baseline bar labelled with
its gain over baseline (> 1 is better)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmap.tools.bench.results import BenchResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes

# (result key, panel title, log scale, scale factor for display)
PANELS: tuple[tuple[str, str, bool, float], ...] = (
    ("descriptors", "registered descriptors (full scale)", True, 1.0),
    (
        "descriptors_per_transfer_scattered",
        "descriptors per 128K-token transfer (scattered)",
        True,
        1.0,
    ),
    ("post_seconds_scattered", "post ms, scattered 128K-token request", True, 1e3),
    ("post_seconds_contiguous", "post ms, contiguous 128K-token request", True, 1e3),
    ("ready_seconds", "ready ms (RegisterWorker, full scale)", False, 1e3),
    ("pull_gbps", "pull GB/s between two daemons (full pages)", False, 1.0),
)


def plot(result: BenchResult, path: str) -> None:
    import matplotlib  # noqa: PLC0415  (only for --plot)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(4, 2, figsize=(13, 16))
    for ax, (key, title, log, factor) in zip(axes.flat, PANELS, strict=False):
        _bars(ax, result, key, factor)
        if key == "pull_gbps":
            _memcpy_line(ax, result)
        ax.set_title(title, fontsize=10)
        ax.set_xticks(range(len(result.profiles)))
        ax.set_xticklabels(list(result.profiles))
        if log:
            ax.set_yscale("log")
        ax.margins(y=0.15)
    _latencies(axes.flat[6], result, "post")
    _latencies(axes.flat[7], result, "pull")
    axes.flat[0].legend()
    m = result.machine
    fig.suptitle(
        f"kvmapd bench: {m.cpu}, {m.cpus} CPUs; loopback UCX; "
        "gains over baseline on the bars (>1 is better)",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bars(ax: Axes, result: BenchResult, key: str, factor: float) -> None:
    """One bar per planner per profile, the non-baseline ones labelled with
    their gain over baseline."""
    profiles = list(result.profiles.values())
    planners = list(profiles[0]) if profiles else []
    width = 0.8 / max(1, len(planners))
    for j, planner in enumerate(planners):
        xs = [i + (j - (len(planners) - 1) / 2) * width for i in range(len(profiles))]
        values = [p[planner].figure(key) * factor for p in profiles]
        bars = ax.bar(xs, values, width, label=planner)
        if planner == "baseline":
            continue
        for bar, p in zip(bars, profiles, strict=True):
            g = (p[planner].vs_baseline or {}).get(key)
            if g is not None:
                ax.annotate(
                    f"{g:.3g}x",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )


def _memcpy_line(ax: Axes, result: BenchResult) -> None:
    for gbps, label, style in (
        (result.memcpy_gbps, "memcpy, one thread", "--"),
        (result.memcpy_all_cores_gbps, "memcpy, all cores", ":"),
    ):
        ax.axhline(gbps, color="grey", linestyle=style, linewidth=1)
        ax.annotate(
            f"{label} {gbps:.1f} GB/s",
            (len(result.profiles) - 0.5, gbps),
            ha="right",
            va="bottom",
            fontsize=8,
            color="grey",
        )
    profiles = list(result.profiles.values())
    planners = list(profiles[0]) if profiles else []
    width = 0.8 / max(1, len(planners))
    for j, planner in enumerate(planners):
        xs = [i + (j - (len(planners) - 1) / 2) * width for i in range(len(profiles))]
        raw = [p[planner].raw_nixl.gbps for p in profiles]
        ax.scatter(xs, raw, marker="_", s=300, color="black", zorder=3)
    ax.scatter([], [], marker="_", color="black", label="raw NIXL, same lists")
    ax.legend(fontsize=7, loc="upper left")


def _latencies(ax: Axes, result: BenchResult, kind: str) -> None:
    """Box plots of every pull's post (or Pull-to-DONE) seconds at the
    highest concurrency, per profile and planner; raw NIXL posting the same
    lists next to each."""
    data: list[list[float]] = []
    labels: list[str] = []
    top = ""
    for name, results in result.profiles.items():
        for planner, r in results.items():
            top = max(r.samples.concurrency, key=int)
            lat = r.samples.concurrency[top]
            kvmap, raw = (
                (lat.post_seconds, lat.raw_post_seconds)
                if kind == "post"
                else (lat.pull_seconds, lat.raw_pull_seconds)
            )
            data += [[v * 1e3 for v in kvmap], [v * 1e3 for v in raw]]
            labels += [f"{name}\n{planner}", f"{name}\n{planner}\nraw NIXL"]
    ax.boxplot(data, whis=(5, 95), showfliers=True, flierprops={"markersize": 2})
    ax.set_xticks(range(1, len(labels) + 1))
    ax.set_xticklabels(labels, fontsize=6)
    ax.set_yscale("log")
    what = "post ms" if kind == "post" else "pull ms, Pull call to DONE"
    ax.set_title(f"{what} at concurrency {top} (every pull; whiskers p5-p95)", fontsize=10)
