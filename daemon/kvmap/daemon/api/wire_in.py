"""Protobuf -> domain: every request the api hands the engine is read off
the wire here, and checked as far as its form goes (the engine checks what
needs its state). The readers themselves are the core's (``core.convert``,
``core.transfer_wire``, ``core.push_offers``), shared with the client and
the adapters; this module is the api's one door to them, so that the
servicers never build a domain type from a message themselves."""

from __future__ import annotations

from kvmap.core.convert import (
    geometry_from_proto,
    parse_and_validate,
    requested_worker,
    worker_key_from_proto,
)
from kvmap.core.geometry import WorkerGeometry, WorkerKey
from kvmap.core.push_offers import Offer, offer_from_proto
from kvmap.core.transfer_wire import (
    announcement_from_proto,
    release_from_request,
    release_notice_from_proto,
    transfer_from_spec,
)
from kvmap.v1 import registry_pb2, types_pb2

__all__ = [
    "announcement_from_proto",
    "parse_and_validate",
    "push_offer",
    "registration",
    "release_from_request",
    "release_notice_from_proto",
    "transfer_from_spec",
    "worker_key",
    "worker_key_from_proto",
]


def worker_key(msg: types_pb2.WorkerId, field: str = "worker") -> WorkerKey:
    """The worker a request names (INVALID_ARGUMENT naming ``field`` when
    its engine id is empty)."""
    return requested_worker(msg, field)


def registration(request: registry_pb2.RegisterWorkerRequest) -> WorkerGeometry:
    """A worker's registration, its allocations' handles included; the
    engine validates it (``core.validation``) when it registers it."""
    return geometry_from_proto(request)


def push_offer(msg: types_pb2.PushOffer) -> Offer:
    """A push offer, every field checked (``core.push_offers``)."""
    return offer_from_proto(msg)
