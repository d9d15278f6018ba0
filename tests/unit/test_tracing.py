"""kvmap.tracing's parts that need no receiver: which traceparents from
outside are taken, where the endpoint comes from (the standard variables,
OTEL_SDK_DISABLED), the null span that tracing off hands out, the config
key's checks, and that neither kvmapd nor the connector loads
opentelemetry when no endpoint is set."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from typing import Any

import pytest

from kvmap.core.config import DaemonConfig
from kvmap.core.errors import ConfigError, PermissionDenied
from kvmap.tracing import (
    NULL_SPAN,
    OFF,
    check_available,
    current,
    endpoint_from,
    traceparent_of,
    tracer_for,
)

GOOD = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize(
    "value",
    [
        GOOD.upper(),  # W3C: lower-case hex only
        GOOD + "-extra",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # no trace
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # no parent span
        "ff" + GOOD[2:],
        "",
        None,
        ["00", "4bf9"],
        "x" * 10_000,
    ],
)
def test_a_malformed_traceparent_is_ignored(value: object) -> None:
    """A traceparent from a request (kv_transfer_params, gRPC metadata) that
    is not a well-formed W3C one becomes "": no span joins it, nothing fails."""
    assert traceparent_of(value) == ""
    assert traceparent_of(GOOD) == GOOD


def test_the_endpoint_is_the_configured_one_else_the_standard_variables() -> None:
    """The key wins; then OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, then
    OTEL_EXPORTER_OTLP_ENDPOINT; OTEL_SDK_DISABLED=true turns all off."""
    env = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:4317",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:4317",
    }
    assert endpoint_from("http://k:4317", env) == "http://k:4317"
    assert endpoint_from("", env) == "http://t:4317"
    assert endpoint_from("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:4317"}) == "http://a:4317"
    assert endpoint_from("", {}) == ""
    assert endpoint_from("http://k:4317", {**env, "OTEL_SDK_DISABLED": "TRUE"}) == ""


def test_tracing_off_hands_out_the_null_span_and_keeps_errors() -> None:
    """Off, every span is NULL_SPAN (its children too, no traceparent), and
    a span used as a context manager never swallows the error it records."""
    assert tracer_for("", "kvmapd") is OFF and not OFF.enabled
    span = OFF.start("kvmap.pull", parent=GOOD, attributes={"request_id": "r"})
    assert span is NULL_SPAN and span.child("kvmap.plan") is NULL_SPAN
    assert span.traceparent() == "" and current() is NULL_SPAN
    with pytest.raises(PermissionDenied), span:
        raise PermissionDenied("no")


@pytest.mark.parametrize(
    ("endpoint", "ok"),
    [
        ("http://collector:4317", True),
        ("https://collector.example:4317/", True),
        ("collector:4317", True),
        ("collector", False),
        ("grpc://collector:4317", False),
        ("http://collector:port", False),
    ],
)
def test_the_config_key_takes_host_port_with_an_optional_http_scheme(
    endpoint: str, ok: bool
) -> None:
    """otlp_traces_endpoint is [http://|https://]HOST:PORT; anything else is
    refused at start-up naming the key."""
    config = DaemonConfig(socket="/tmp/x.sock", otlp_traces_endpoint=endpoint)
    if ok:
        assert config.validated().otlp_traces_endpoint == endpoint
    else:
        with pytest.raises(ValueError, match="otlp_traces_endpoint"):
            config.validated()


def test_nothing_loads_opentelemetry_while_tracing_is_off() -> None:
    """kvmapd (its CLI, server, engine, configuration) and the connector,
    imported and configured with no endpoint, have not imported
    opentelemetry: tracing off costs no import."""
    code = (
        "import sys, os\n"
        "for k in ('OTEL_EXPORTER_OTLP_ENDPOINT', 'OTEL_EXPORTER_OTLP_TRACES_ENDPOINT'):\n"
        "    os.environ.pop(k, None)\n"
        "import kvmap.daemon.cli.kvmapd, kvmap.daemon.api.server\n"
        "from kvmap.daemon.adapters.config_files import load_config\n"
        "from kvmap.client.connector import ConnectorOptions, SchedulerCore\n"
        "config = load_config(None, {'socket': '/tmp/kvmap-unit.sock'})\n"
        "from kvmap.tracing import tracer_for, OFF\n"
        "assert tracer_for(config.otlp_traces_endpoint, 'kvmapd') is OFF\n"
        "assert SchedulerCore('e', ConnectorOptions(socket='/tmp/x')).tracer is OFF\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_an_endpoint_without_the_packages_is_refused_naming_the_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the ``traces`` extra is not installed, a configured endpoint is
    refused at start-up (kvmapd serve, the connector's start) with the key
    and the fix, never at the first span; no endpoint needs nothing."""
    real = importlib.util.find_spec

    def without_sdk(name: str, *args: Any) -> Any:
        return None if name.startswith("opentelemetry.sdk") else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without_sdk)
    check_available("")
    with pytest.raises(ConfigError, match=r"otlp_traces_endpoint.*kvmap\[traces\]"):
        tracer_for("http://127.0.0.1:1", "kvmapd", "no-sdk")
