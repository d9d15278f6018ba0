"""Transports: how the client reaches a daemon. ``GrpcTransport`` talks to a
live kvmapd over its Unix socket; ``base.Transport`` is the seam code above
it is written against. Tests serve the real daemon in their own process
(``tests/support/inproc_daemon.py``); the client ships no daemon of its own."""

from kvmap.client.transports.base import AttachStream, Transport
from kvmap.client.transports.grpc import GrpcTransport

__all__ = ["AttachStream", "GrpcTransport", "Transport"]
