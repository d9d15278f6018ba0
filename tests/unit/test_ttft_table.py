"""The arithmetic of ``kvmapd bench --ttft``'s table (kvmap.tools.bench.ttft):
percentiles, token agreement with the first connector, and the goal (kvmap
push's TTFT p50 at or below NixlPushConnector's at each level), on rows made
up here: the servers are tests/vllm/test_bench_ttft.py's."""

from __future__ import annotations

from typing import Any

from kvmap.tools.bench.scratch import ms
from kvmap.tools.bench.ttft import TtftOptions, _result, render


def row(connector: str, level: int, p50_ms: float, tokens: list[list[int]]) -> dict[str, Any]:
    ms = {"p50": p50_ms, "p90": p50_ms, "mean": p50_ms}
    return {
        "connector": connector,
        "concurrency": level,
        "requests": len(tokens),
        "ok": len(tokens),
        "ttft_ms": ms,
        "e2e_ms": ms,
        "loaded": 1.0,
        "tokens": tokens,
    }


def test_percentiles_are_milliseconds_of_the_sorted_samples() -> None:
    """p50 is the median, p90 the sample at 90% of the sorted list, then the
    mean and the max; no samples give zeros rather than an error."""
    got = ms([0.003, 0.001, 0.002, 0.010], 90)
    assert got == {"p50": 2.5, "p90": 10.0, "mean": 4.0, "max": 10.0}
    assert ms([0.001] * 99 + [0.5], 99) == {"p50": 1.0, "p99": 500.0, "mean": 5.99, "max": 500.0}
    assert ms([], 99) == {"p50": 0.0, "p99": 0.0, "mean": 0.0, "max": 0.0}


def test_the_goal_compares_kvmap_push_with_nixl_push_per_level() -> None:
    """Met where kvmap push's p50 is at or below NixlPushConnector's at the
    same level, not met where above; tokens are compared with the first
    connector's at each level; the table names the outcome."""
    opts = TtftOptions(concurrency=(1, 4))
    rows = [
        row("kvmap-pull", 1, 100.0, [[1, 2], [3, 4]]),
        row("kvmap-pull", 4, 150.0, [[5, 6], [7, 8]]),
        row("kvmap-push", 1, 90.0, [[1, 2], [3, 9]]),
        row("kvmap-push", 4, 200.0, [[5, 6], [7, 8]]),
        row("nixl-push", 1, 90.0, [[1, 2], [3, 4]]),
        row("nixl-push", 4, 199.0, [[5, 6], [7, 8]]),
    ]
    result = _result(opts, rows)
    assert result["goal_kvmap_push_at_or_below_nixl_push"] == {"1": True, "4": False}
    same = {(r["connector"], r["concurrency"]): r["same_tokens"] for r in result["rows"]}
    assert same[("kvmap-push", 1)] == 1 and same[("kvmap-push", 4)] == 2
    assert all("tokens" not in r for r in result["rows"])
    assert "x1: met, x4: NOT met" in render(result)


def test_without_both_push_connectors_there_is_no_goal() -> None:
    """A run without NixlPushConnector (or without kvmap push) judges nothing."""
    rows = [row("kvmap-push", 1, 90.0, [[1]]), row("nixl-pull", 1, 80.0, [[1]])]
    result = _result(TtftOptions(concurrency=(1,)), rows)
    assert result["goal_kvmap_push_at_or_below_nixl_push"] == {}
    assert "goal:" not in render(result)
