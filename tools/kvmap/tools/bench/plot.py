"""``kvmapd bench --plot FILE.png``: the figures as grouped bar charts, one
group per profile, one bar per planner, each non-baseline bar labelled with
its gain over baseline (> 1 is better)."""

from __future__ import annotations

from typing import Any

from kvmap.tools.bench.runner import RATIO_KEYS, ratio

_HIGHER_IS_BETTER = dict(RATIO_KEYS)

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


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib  # noqa: PLC0415  (only for --plot)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    profiles = list(result["profiles"])
    planners = list(result["profiles"][profiles[0]]) if profiles else []
    width = 0.8 / max(1, len(planners))
    fig, axes = plt.subplots(3, 2, figsize=(13, 12))
    for ax, (key, title, log, factor) in zip(axes.flat, PANELS, strict=True):
        for j, planner in enumerate(planners):
            xs = [i + (j - (len(planners) - 1) / 2) * width for i in range(len(profiles))]
            values = [result["profiles"][p][planner][key] * factor for p in profiles]
            bars = ax.bar(xs, values, width, label=planner)
            if planner == "baseline":
                continue
            for bar, p in zip(bars, profiles, strict=True):
                base = result["profiles"][p]["baseline"][key]
                g = ratio(float(base), float(result["profiles"][p][planner][key]),
                          _HIGHER_IS_BETTER.get(key, False))  # fmt: skip
                if g is not None:
                    ax.annotate(
                        f"{g:.3g}x",
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center",
                        va="bottom",
                        fontsize=8,
                    )
        if key == "pull_gbps":
            ax.axhline(result["memcpy_gbps"], color="grey", linestyle="--", linewidth=1)
            ax.annotate(
                f"memcpy {result['memcpy_gbps']:.1f} GB/s",
                (len(profiles) - 0.5, result["memcpy_gbps"]),
                ha="right",
                va="bottom",
                fontsize=8,
                color="grey",
            )
        ax.set_title(title, fontsize=10)
        ax.set_xticks(range(len(profiles)))
        ax.set_xticklabels(profiles)
        if log:
            ax.set_yscale("log")
        ax.margins(y=0.15)
    axes.flat[0].legend()
    m = result["machine"]
    fig.suptitle(
        f"kvmapd bench: {m['cpu']}, {m['cpus']} CPUs; loopback UCX; "
        "gains over baseline on the bars (>1 is better)",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
