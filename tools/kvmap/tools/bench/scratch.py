"""Small pieces the benches that start vLLM servers or engines share (``ttft``,
``sched_step``): where their processes keep their files, and how their
samples become the table's milliseconds."""

from __future__ import annotations

import contextlib
import statistics
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def scratch_dir(given: Path | None, prefix: str) -> Iterator[Path]:
    """``given`` (created, kept), or a temporary folder removed at the end."""
    if given is not None:
        given.mkdir(parents=True, exist_ok=True)
        yield given
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield Path(tmp)


def ms(values: list[float], high: int) -> dict[str, float]:
    """Samples in seconds as milliseconds: p50, p``high`` (the sample at
    that share of the sorted list), mean and max; zeros for no samples."""
    keys = ("p50", f"p{high}", "mean", "max")
    if not values:
        return dict.fromkeys(keys, 0.0)
    ordered = sorted(values)
    top = ordered[min(len(ordered) - 1, int(high / 100 * len(ordered)))]
    figures = (statistics.median(ordered), top, statistics.fmean(ordered), ordered[-1])
    return {k: round(v * 1000, 3) for k, v in zip(keys, figures, strict=True)}
