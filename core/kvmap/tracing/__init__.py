"""OpenTelemetry traces of a request's KV, shared by kvmapd and the connector.

Tracing is off unless an OTLP endpoint is configured (``endpoint_from``: a
flag or config key, else ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_ENDPOINT``). Off, ``OFF`` hands out ``NULL_SPAN``,
whose every method does nothing: a span on the hot path then costs one
branch and no import. On, ``kvmap.tracing.otel`` (the one module that
imports opentelemetry) is loaded and spans are exported over OTLP/gRPC.

Spans cross processes as W3C ``traceparent`` strings: in gRPC metadata
(``TRACEPARENT``) and, from the prefill to the decode engine, in
``kv_transfer_params``. Such a string comes from outside: ``traceparent_of``
keeps only a well-formed one.
"""

from __future__ import annotations

import importlib.util

from kvmap.core.errors import ConfigError
from kvmap.tracing.spans import (
    ENDPOINT_ENV,
    NULL_SPAN,
    OFF,
    TRACEPARENT,
    AttrValue,
    Span,
    Tracer,
    code_name,
    current,
    endpoint_from,
    traceparent_in,
    traceparent_of,
    use,
)

__all__ = [
    "ENDPOINT_ENV",
    "NULL_SPAN",
    "OFF",
    "TRACEPARENT",
    "AttrValue",
    "Span",
    "Tracer",
    "check_available",
    "code_name",
    "current",
    "endpoint_from",
    "traceparent_in",
    "traceparent_of",
    "tracer_for",
    "use",
]

_tracers: dict[tuple[str, str, str], Tracer] = {}
# What exporting traces needs (the ``traces`` extra).
_PACKAGES = ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.grpc")


def check_available(endpoint: str, key: str = "otlp_traces_endpoint") -> None:
    """ConfigError naming ``key`` when ``endpoint`` is set but the
    OpenTelemetry packages are not installed (checked at start-up, not at
    the first span)."""
    if endpoint and any(importlib.util.find_spec(p) is None for p in _PACKAGES):
        raise ConfigError(
            key, endpoint, "exporting traces needs the OpenTelemetry packages: "
            "pip install 'kvmap[traces]'"
        )  # fmt: skip


def tracer_for(endpoint: str, service_name: str, instance: str = "") -> Tracer:
    """``OFF`` without an endpoint; else this process's tracer exporting to
    ``endpoint`` as ``service_name`` (``OTEL_SERVICE_NAME`` wins) and
    ``instance`` (``service.instance.id``), one per endpoint, name and
    instance, made on first use."""
    if not endpoint:
        return OFF
    check_available(endpoint)
    key = (endpoint, service_name, instance)
    if key not in _tracers:
        # Imported here: opentelemetry loads only when traces are exported.
        from kvmap.tracing.otel import OtelTracer  # noqa: PLC0415 -- see above

        _tracers[key] = OtelTracer(endpoint, service_name, instance)
    return _tracers[key]
