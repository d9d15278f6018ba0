"""Transports: how the client reaches a daemon. ``base.Transport`` is the
seam code above it is written against; ``KvmapdTransport`` is a live kvmapd
on this machine, composed of one transport per socket it listens on:
``GrpcTransport`` (its gRPC API), ``HandoffTransport`` (the fd hand-off
socket) and ``LocalCallsTransport`` (the local calls socket). Tests serve the
real daemon in their own process (``tests/support/inproc_daemon.py``); the
client ships no daemon of its own."""

from kvmap.client.transports.base import AttachStream, Transport
from kvmap.client.transports.grpc import GrpcTransport
from kvmap.client.transports.handoff import HandoffTransport
from kvmap.client.transports.kvmapd import KvmapdTransport
from kvmap.client.transports.local_calls import LocalCallsTransport

__all__ = [
    "AttachStream",
    "GrpcTransport",
    "HandoffTransport",
    "KvmapdTransport",
    "LocalCallsTransport",
    "Transport",
]
