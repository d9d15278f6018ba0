"""The connector's spans, and how they join vLLM's trace of a request.

A prefill request's grant span is a child of vLLM's span of the request
(its ``trace_headers``, where vLLM traces) and travels to the decode engine
in ``kv_transfer_params`` (``TRACEPARENT_KEY``). The decode request's load
span is a child of vLLM's span of the decode request, linked to the grant;
where vLLM does not trace the decode request, a child of the grant, so the
request's KV is one trace either way. The daemons' spans are children of
these: each call to kvmapd carries the current span as ``traceparent``
metadata (``kvmap.client.transports``).

Tracing is on where ``kv_connector_extra_config.otlp_traces_endpoint`` or
the standard ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (vLLM's ``--otlp-traces-endpoint``
sets the first for its processes); off, every span is ``NULL_SPAN``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from kvmap.client.connector.metadata import RecvTask
from kvmap.client.connector.options import ConnectorOptions
from kvmap.tracing import (
    NULL_SPAN,
    TRACEPARENT,
    Span,
    Tracer,
    endpoint_from,
    traceparent_of,
    tracer_for,
)

# The service name the connector's spans are exported under (OTEL_SERVICE_NAME wins).
SERVICE_NAME = "kvmap-connector"


def connector_tracer(options: ConnectorOptions) -> Tracer:
    """This process's tracer for ``options`` (``OFF`` without an endpoint)."""
    return tracer_for(endpoint_from(options.otlp_traces_endpoint, os.environ), SERVICE_NAME)


def vllm_parent(trace_headers: Mapping[str, str] | None) -> str:
    """The traceparent vLLM keeps with a request (its ``trace_headers``,
    present where vLLM traces requests), or ""."""
    return traceparent_of((trace_headers or {}).get(TRACEPARENT))


def grant_span(tracer: Tracer, request_id: str, trace_headers: Mapping[str, str] | None) -> Span:
    """The prefill side's span of granting a finished request's blocks."""
    if not tracer.enabled:
        return NULL_SPAN
    return tracer.start(
        "kvmap.connector.grant",
        parent=vllm_parent(trace_headers),
        attributes={"request_id": request_id},
    )


def load_parent(grant: str, trace_headers: Mapping[str, str] | None) -> tuple[str, str]:
    """(parent, link) of a decode request's load: vLLM's span of the request
    linked to the prefill's ``grant`` span, else the grant span itself."""
    own = vllm_parent(trace_headers)
    return (own, grant) if own else (grant, "")


def load_span(tracer: Tracer, task: RecvTask, kind: str = "load") -> Span:
    """The decode side's span of loading (or releasing) one request's KV."""
    if not tracer.enabled:
        return NULL_SPAN
    source = task.source
    return tracer.start(
        f"kvmap.connector.{kind}",
        parent=task.traceparent,
        link=task.trace_link,
        attributes={
            "request_id": source.request_id,
            "local_request_id": task.request_id,
            "peer": source.target,
            "blocks": sum(len(g) for g in task.local_block_ids),
        },
    )


def freed(tracer: Tracer, request_id: str, grant: str, code: str = "") -> None:
    """The prefill side freed a request's kept blocks (pulled, or ``code``:
    the lease ran out): a span under the grant's."""
    if not tracer.enabled or not grant:
        return
    span = tracer.start("kvmap.connector.free", parent=grant, attributes={"request_id": request_id})
    if code:
        span.fail(code, "no pull within the lease")
    span.end()
