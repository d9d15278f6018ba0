"""deploy/grafana/kvmap.json and the alert rules
(deploy/k8s/components/alerts) query only metrics that exist: every panel's
and every alert's PromQL (and every template variable's query) names series
that a real kvmapd's /metrics endpoint exports or that the vLLM connector's
stats metrics (kvmap.client.connector.stats.PromMetrics) register; a bogus
name is caught. The one name allowed beside them is Prometheus' own ``up``."""

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
import yaml
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvmap.client.connector.stats import PromMetrics
from kvmap.tools.launch import start_daemon

pytestmark = pytest.mark.integration  # scrapes a real kvmapd

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "kvmap.json"
ALERTS = REPO / "deploy" / "k8s" / "components" / "alerts" / "prometheusrule.yaml"
# Series Prometheus makes itself for every target (not exported by anyone).
PROMETHEUS_SERIES = {"up"}

# Series names each metric type exposes (prometheus_client's exposition;
# kvmapd exports no _created series, so a query of one is caught too).
_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
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


def alert_queries(rule: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every alerting and recording rule of a PrometheusRule."""
    for group in rule["spec"]["groups"]:
        for r in group["rules"]:
            yield f"alert {r.get('alert') or r.get('record')!r}", r["expr"]


def unknown_metrics(
    dashboard: dict[str, Any], exported: set[str], rule: dict[str, Any] | None = None
) -> list[tuple[str, str]]:
    """(where, name) of every name a panel or alert queries that nothing exports."""
    everything = [*queries(dashboard), *(alert_queries(rule) if rule else ())]
    return sorted(
        (where, name)
        for where, expr in everything
        for name in metric_names(expr)
        if name not in exported | PROMETHEUS_SERIES
    )


def load_alerts() -> dict[str, Any]:
    rule: dict[str, Any] = yaml.safe_load(ALERTS.read_text())
    return rule


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
    assert "_created" not in daemon_text  # prometheus_client's are turned off
    # A ready daemon says so (the KvmapDaemonNotReady alert reads it).
    assert re.search(r"^kvmap_ready 1\.0$", daemon_text, re.M), daemon_text
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
    # The series issue 26 added: in-flight, per-peer served, RPC codes, builds.
    assert {"kvmap_transfers_in_flight", "kvmap_served_transfers_total"} <= set(found)
    assert {"kvmap_rpcs_total", "kvmap_build_info", "kvmap_served_bytes_total"} <= set(found)
    assert unknown_metrics(dashboard, exported) == []


def test_every_alert_metric_is_exported(exported: set[str]) -> None:
    """Each name in each alert rule's PromQL, checked by the same function
    as the dashboard's, is a series kvmapd or the connector exports (or
    Prometheus' own ``up``); the rules cover what the runbook promises."""
    rule = load_alerts()
    found = {name for _, expr in alert_queries(rule) for name in metric_names(expr)}
    assert {"kvmap_transfers_total", "kvmap_ready", "kvmap_generations_total"} <= found
    assert "kvmap_registered_bytes_limit" in found and "kvmap_rpcs_total" in found
    assert unknown_metrics(json.loads(DASHBOARD.read_text()), exported, rule) == []


def test_a_bogus_alert_metric_is_caught(exported: set[str]) -> None:
    """An alert querying a name nothing exports (a renamed label's old
    series, a _created series) is reported with the alert's name."""
    dashboard = json.loads(DASHBOARD.read_text())
    for bogus in ("kvmap_no_such_metric", "kvmap_transfers_created", "kvmap_ready_total"):
        rule = load_alerts()
        first = rule["spec"]["groups"][0]["rules"][0]
        first["expr"] = f'sum(rate({bogus}{{code!="OK"}}[5m])) > 0'
        assert unknown_metrics(dashboard, exported, rule) == [(f"alert {first['alert']!r}", bogus)]


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
