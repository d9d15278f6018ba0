"""A minimal OTLP/gRPC trace receiver (the collector's ``TraceService``) on
127.0.0.1: what the tracing tests and ``kvmap.tools.trace_capture`` export
to, and read the spans back from, without a collector."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2


@dataclass(frozen=True)
class ReceivedSpan:
    """One exported span, its ids in hex."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    attributes: dict[str, Any]
    # (status code: 0 unset, 1 ok, 2 error; its description)
    status: tuple[int, str]
    events: tuple[str, ...]
    links: tuple[str, ...]  # the linked spans' ids
    start_ns: int
    end_ns: int

    @property
    def ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _value(v: common_pb2.AnyValue) -> Any:
    which = v.WhichOneof("value")
    return getattr(v, which) if which else None


def _spans_of(request: trace_service_pb2.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    out = []
    for rs in request.resource_spans:
        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    ReceivedSpan(
                        service=str(resource.get("service.name", "")),
                        name=s.name,
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(),
                        kind=s.kind,
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        status=(s.status.code, s.status.message),
                        events=tuple(e.name for e in s.events),
                        links=tuple(link.span_id.hex() for link in s.links),
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                    )
                )
    return out


@dataclass
class TraceReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Started on a free port of 127.0.0.1; ``endpoint`` is what exporters dial."""

    spans: list[ReceivedSpan] = field(default_factory=list)
    exports: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        # The generated registration function carries no annotations.
        add = trace_service_pb2_grpc.add_TraceServiceServicer_to_server
        add(self, self._server)  # type: ignore[no-untyped-call]
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def Export(  # noqa: N802 -- the generated servicer's method name
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        with self._lock:
            self.exports += 1
            self.spans.extend(_spans_of(request))
        return trace_service_pb2.ExportTraceServiceResponse()

    def received(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)

    def wait_for(
        self, done: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 10.0
    ) -> list[ReceivedSpan]:
        """The spans received once ``done`` holds of them (or the timeout passed)."""
        deadline = time.monotonic() + timeout_s
        while not done(spans := self.received()) and time.monotonic() < deadline:
            time.sleep(0.05)  # exporters send in batches, from other processes
        return spans

    def stop(self) -> None:
        self._server.stop(grace=None)
