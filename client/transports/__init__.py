"""Transports: how the client reaches a daemon. ``GrpcTransport`` talks to a
live kvmapd over its Unix socket; tests of code above the seam can use an
in-memory transport with the same interface (``base.Transport``)."""

from kvmap.client.transports.base import AttachStream, Transport
from kvmap.client.transports.grpc import GrpcTransport

__all__ = ["AttachStream", "GrpcTransport", "Transport"]
