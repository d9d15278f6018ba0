"""deploy/grafana/kvmap.json queries only metrics that exist: every panel's
PromQL (and every template variable's query) names series that a real
kvmapd's /metrics endpoint exports or that the vLLM connector's stats
metrics (kvmap.client.connector.stats.PromMetrics) register; a bogus name is caught."""

from __future__ import annotations

import copy
import json
import re
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvmap.client.connector.stats import PromMetrics
from kvmap.tools.launch import start_daemon

pytestmark = pytest.mark.integration  # scrapes a real kvmapd

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvmap.json"

# Series names each metric type exposes (prometheus_client's exposition).
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "gauge": ("",),
    "info": ("_info",),
    "untyped": ("",),
}
# PromQL words that are not metric names where they stand.
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool"}
_KEYWORDS |= {"and", "or", "unless", "inf", "nan"}
_NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def exported_names(exposition: str) -> set[str]:
    """Every series name an exposition's metric families export (also for
    families without samples yet: a labelled counter nobody has used)."""
    names: set[str] = set()
    for family in text_string_to_metric_families(exposition):
        names.update(family.name + suffix for suffix in _SUFFIXES[family.type])
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: strings, label
    matchers, ranges, grouping clauses and function calls removed."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges, subqueries
    text = re.sub(r"\boffset\s+-?[0-9a-z]+", " ", text)  # offset durations
    text = re.sub(
        r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text
    )  # grouping labels
    names = set()
    for m in _NAME.finditer(text):
        word = m.group(0)
        rest = text[m.end() :].lstrip()
        if rest.startswith("(") or word.lower() in _KEYWORDS:
            continue  # a function (rate, histogram_quantile, sum, ...) or a keyword
        if re.fullmatch(r"\d+(?:\.\d+)?(?:e[+-]?\d+)?", word):
            continue
        names.add(word)
    return names


def queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every panel target and query template variable."""

    def walk(panels: list[dict[str, Any]]) -> Iterator[tuple[str, str]]:
        for p in panels:
            for t in p.get("targets", []):
                yield f"panel {p.get('title')!r} {t.get('refId')}", t["expr"]
            yield from walk(p.get("panels", []))

    yield from walk(dashboard.get("panels", []))
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            inner = re.fullmatch(r"label_values\((.*),\s*\w+\)", q)
            yield f"variable {var['name']}", inner.group(1) if inner else q


def unknown_metrics(dashboard: dict[str, Any], exported: set[str]) -> list[tuple[str, str]]:
    """(where, name) of every queried name nothing exports."""
    return sorted(
        (where, name)
        for where, expr in queries(dashboard)
        for name in metric_names(expr)
        if name not in exported
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """What a real kvmapd exports on /metrics, and the connector's series."""
    port = _free_port()
    daemon = start_daemon(
        tmp_path_factory.mktemp("kvmapd"), "--metrics-listen", f"127.0.0.1:{port}"
    )
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        daemon_text = urllib.request.urlopen(url, timeout=10).read().decode()
    finally:
        assert daemon.terminate() == 0, daemon.log()
    registry = CollectorRegistry()

    def bound(cls: type) -> Any:
        return lambda **kw: cls(registry=registry, **kw)

    PromMetrics(None, {c: bound(c) for c in (Gauge, Counter, Histogram)}, ["engine"], {0: ["0"]})
    return exported_names(daemon_text) | exported_names(generate_latest(registry).decode())


def test_every_queried_metric_is_exported(exported: set[str]) -> None:
    """Each name in each panel's PromQL is a series kvmapd or the connector
    exports (histogram _bucket/_sum/_count, counter _total)."""
    dashboard = json.loads(DASHBOARD.read_text())
    found = [name for _, expr in queries(dashboard) for name in metric_names(expr)]
    # The dashboard covers both sources and the histogram and counter suffixes.
    assert "kvmap_peer_transfer_seconds_bucket" in found
    assert "vllm:kvmap_xfer_time_seconds_bucket" in found
    assert "kvmap_peer_transfers_total" in found
    assert unknown_metrics(dashboard, exported) == []


def test_a_bogus_metric_is_caught(exported: set[str]) -> None:
    """A panel querying a name nothing exports (or a counter without its
    _total, or a gauge with _bucket) is reported with its panel."""
    dashboard = json.loads(DASHBOARD.read_text())
    for bogus in ("kvmap_no_such_metric", "kvmap_peer_transfers", "kvmap_leases_bucket"):
        broken = copy.deepcopy(dashboard)
        target = broken["panels"][1]["targets"][0]
        target["expr"] = f'sum by (peer) (rate({bogus}{{code="OK"}}[5m]))'
        assert unknown_metrics(broken, exported) == [
            (f"panel {broken['panels'][1]['title']!r} A", bogus)
        ]


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        (
            'histogram_quantile(0.9, sum by (le, peer) (rate(a_bucket{x="y",z=~"a|b"}[5m])))',
            {"a_bucket"},
        ),
        ("sum(rate(a_sum[1m])) / sum(rate(a_count[1m]))", {"a_sum", "a_count"}),
        ('vllm:x_total{code!="by(foo)"} offset 5m', {"vllm:x_total"}),
        ("sum without (instance) (g) * on (job) group_left (v) h > 0.5", {"g", "h"}),
        ("label_values_here", {"label_values_here"}),
    ],
)
def test_metric_names_of_promql(expr: str, names: set[str]) -> None:
    """The extraction handles selectors, functions, grouping, strings, numbers."""
    assert metric_names(expr) == names
