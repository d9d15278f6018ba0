"""Transports: how the client reaches a daemon. ``GrpcTransport`` talks to a
live kvmapd over its Unix socket; ``MemoryTransport`` talks to an in-process
``MemoryDaemon`` with the same interface (``base.Transport``), for tests of
code above the seam."""

from kvmap.client.transports.base import AttachStream, Transport
from kvmap.client.transports.grpc import GrpcTransport
from kvmap.client.transports.memory import MemoryDaemon, MemoryNetwork, MemoryTransport

__all__ = [
    "AttachStream",
    "GrpcTransport",
    "MemoryDaemon",
    "MemoryNetwork",
    "MemoryTransport",
    "Transport",
]
