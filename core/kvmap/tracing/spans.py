"""kvmap's span API and tracing off: ``Span`` (the null span's class and
the base of ``kvmap.tracing.otel``'s), ``Tracer`` (``OFF``), the current
span of a task, and the W3C traceparent checks (``kvmap.tracing``)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from types import TracebackType

from kvmap.core.errors import status_of

# The W3C trace context header, as gRPC metadata key (lower case).
TRACEPARENT = "traceparent"
# version 00, a trace id and a span id that are not all zeros, the flags.
_TRACEPARENT = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")
ENDPOINT_ENV = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")

AttrValue = str | int | float | bool


def traceparent_of(value: object) -> str:
    """``value`` when it is a well-formed W3C traceparent, else "" (it came
    from a request: anything else is ignored, never an error)."""
    if isinstance(value, str) and len(value) == 55 and _TRACEPARENT.fullmatch(value):
        return value
    return ""


def traceparent_in(metadata: Iterable[tuple[str, object]] | None) -> str:
    """The well-formed traceparent among gRPC invocation metadata, or ""."""
    for key, value in metadata or ():
        if key == TRACEPARENT:
            return traceparent_of(value)
    return ""


def endpoint_from(configured: str, env: Mapping[str, str]) -> str:
    """The OTLP/gRPC endpoint traces go to: the configured one, else the
    standard variables'; "" (off) when none is set or the SDK is disabled."""
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return ""
    return configured or next((env[k] for k in ENDPOINT_ENV if env.get(k)), "")


def code_name(err: BaseException) -> str:
    """The gRPC status code name a failure reports (CANCELLED for a
    cancellation, DEADLINE_EXCEEDED for a timeout)."""
    if isinstance(err, asyncio.CancelledError):
        return "CANCELLED"
    if isinstance(err, TimeoutError):
        return "DEADLINE_EXCEEDED"
    return status_of(err)[0].name


class Span:
    """A span that records nothing (tracing off); ``kvmap.tracing.otel``'s
    spans record. As a context manager it ends the span, failed with the
    code of the exception that left the block."""

    __slots__ = ()

    def set(self, **attributes: AttrValue) -> None:
        """Set attributes (``kvmap.`` is prefixed to each name)."""

    def event(self, name: str, **attributes: AttrValue) -> None:
        """Add a timed event."""

    def fail(self, code: str, message: str = "") -> None:
        """Status ERROR, described by the gRPC status code name ``code``."""

    def end(self) -> None:
        """End the span (a second call does nothing)."""

    def traceparent(self) -> str:
        """This span's context as a W3C traceparent ("" when not recording)."""
        return ""

    def trace_id(self) -> str:
        """The id of this span's trace, in hex, as log lines name it ("" when
        not recording)."""
        return ""

    def child(self, name: str, **attributes: AttrValue) -> Span:
        """A span of a part of this one's work (``NULL_SPAN`` under it)."""
        return NULL_SPAN

    def __enter__(self) -> Span:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        err: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if err is not None:
            self.fail(code_name(err), str(err))
        self.end()


NULL_SPAN = Span()
# The span of the work the running task does (a transfer): what its parts'
# spans are children of, without handing it down every call.
_CURRENT: ContextVar[Span] = ContextVar("kvmap_current_span", default=NULL_SPAN)


def current() -> Span:
    """The span ``use`` made current in this task (``NULL_SPAN`` if none)."""
    return _CURRENT.get()


def use(span: Span) -> None:
    """Make ``span`` current in this task (and in tasks it starts)."""
    _CURRENT.set(span)


class Tracer:
    """Starts spans. This base is tracing off: every span is ``NULL_SPAN``."""

    enabled = False

    def start(
        self,
        name: str,
        *,
        parent: Span | str = "",
        link: str = "",
        server: bool = False,
        attributes: Mapping[str, AttrValue] | None = None,
    ) -> Span:
        """A span, child of ``parent`` (a live span, or a remote one's
        traceparent; none: a new trace), linked to the span of the
        traceparent ``link``; ``server``: it serves a remote caller.
        ``kvmap.`` is prefixed to each attribute's name."""
        return NULL_SPAN

    def flush(self, timeout_s: float = 5.0) -> None:
        """Export every ended span now."""

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Export what is left (waiting at most ``timeout_s``) and stop exporting."""


OFF = Tracer()
