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

    fig, axes = plt.subplots(3, 2, figsize=(13, 12))
    for ax, (key, title, log, factor) in zip(axes.flat, PANELS, strict=True):
        _bars(ax, result, key, factor)
        if key == "pull_gbps":
            _memcpy_line(ax, result)
        ax.set_title(title, fontsize=10)
        ax.set_xticks(range(len(result.profiles)))
        ax.set_xticklabels(list(result.profiles))
        if log:
            ax.set_yscale("log")
        ax.margins(y=0.15)
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
    ax.axhline(result.memcpy_gbps, color="grey", linestyle="--", linewidth=1)
    ax.annotate(
        f"memcpy {result.memcpy_gbps:.1f} GB/s",
        (len(result.profiles) - 0.5, result.memcpy_gbps),
        ha="right",
        va="bottom",
        fontsize=8,
        color="grey",
    )
