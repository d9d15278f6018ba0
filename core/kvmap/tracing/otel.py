"""Spans that record and an exporter over OTLP/gRPC: the one module of
kvmap that imports opentelemetry, loaded only when tracing is on
(``kvmap.tracing.tracer_for``).

The SDK reads the standard variables itself: ``OTEL_TRACES_SAMPLER`` (and
its argument) pick the sampler, ``OTEL_BSP_*`` the batching,
``OTEL_EXPORTER_OTLP_*`` the exporter's headers, TLS and timeout,
``OTEL_RESOURCE_ATTRIBUTES`` more resource attributes. An ``http://``
endpoint is plaintext, ``https://`` TLS (as every OTLP exporter reads it).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvmap.tracing.spans import TRACEPARENT, AttrValue, Span, Tracer

_PROPAGATOR = TraceContextTextMapPropagator()


def _attributes(attributes: Mapping[str, AttrValue]) -> dict[str, AttrValue]:
    return {f"kvmap.{k}": v for k, v in attributes.items()}


def _remote(traceparent: str) -> otel_context.Context:
    """The context of a remote span (an empty one for "")."""
    if not traceparent:
        return otel_context.Context()
    return _PROPAGATOR.extract({TRACEPARENT: traceparent}, context=otel_context.Context())


class OtelSpan(Span):
    """A recording span (an SDK span under kvmap's ``Span`` calls)."""

    __slots__ = ("span", "tracer")

    def __init__(self, span: trace.Span, tracer: OtelTracer) -> None:
        self.span = span
        self.tracer = tracer

    def child(self, name: str, **attributes: AttrValue) -> Span:
        return self.tracer.start(name, parent=self, attributes=attributes)

    def set(self, **attributes: AttrValue) -> None:
        self.span.set_attributes(_attributes(attributes))

    def event(self, name: str, **attributes: AttrValue) -> None:
        self.span.add_event(name, _attributes(attributes))

    def fail(self, code: str, message: str = "") -> None:
        self.span.set_attribute("kvmap.code", code)
        if message:
            self.span.set_attribute("kvmap.error", message[:1024])
        self.span.set_status(trace.Status(trace.StatusCode.ERROR, code))

    def end(self) -> None:
        # A second end (a lease ended by two paths) would log an SDK warning.
        if self.span.is_recording():
            self.span.end()

    def trace_id(self) -> str:
        return format(self.span.get_span_context().trace_id, "032x")

    def traceparent(self) -> str:
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(self.span))
        return carrier.get(TRACEPARENT, "")


class OtelTracer(Tracer):
    """Spans exported in batches (a background thread) over OTLP/gRPC."""

    enabled = True

    def __init__(self, endpoint: str, service_name: str, instance: str = "") -> None:
        resource: dict[str, str] = {
            SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME") or service_name
        }
        if instance:
            resource[SERVICE_INSTANCE_ID] = instance
        self._provider = TracerProvider(resource=Resource.create(resource))
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self._tracer = self._provider.get_tracer("kvmap")

    def start(
        self,
        name: str,
        *,
        parent: Span | str = "",
        link: str = "",
        server: bool = False,
        attributes: Mapping[str, AttrValue] | None = None,
    ) -> Span:
        if isinstance(parent, OtelSpan):
            ctx = trace.set_span_in_context(parent.span, otel_context.Context())
        else:
            ctx = _remote(parent if isinstance(parent, str) else "")
        links = []
        if link:
            linked = trace.get_current_span(_remote(link)).get_span_context()
            links.append(trace.Link(linked))
        span = self._tracer.start_span(
            name,
            context=ctx,
            kind=trace.SpanKind.SERVER if server else trace.SpanKind.INTERNAL,
            attributes=_attributes(attributes or {}),
            links=links,
            record_exception=False,
        )
        return OtelSpan(span, self)

    def flush(self, timeout_s: float = 5.0) -> None:
        self._provider.force_flush(int(timeout_s * 1000))

    def shutdown(self, timeout_s: float = 2.0) -> None:
        # On a thread of its own, waited for a bounded time: an exporter
        # retrying a collector that is gone must not hold the process.
        done = threading.Thread(target=self._provider.shutdown, name="kvmap-otel-stop", daemon=True)
        done.start()
        done.join(timeout_s)
