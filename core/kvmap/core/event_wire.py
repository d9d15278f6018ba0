"""The wire form of a worker's events (``core.worker_events``): the
``AttachResponse`` an Attach stream sends, and the blob the state store
keeps a pending event as (the same message, so stores written by any
version read back)."""

from __future__ import annotations

from kvmap.core.convert import planner_info_to_proto
from kvmap.core.geometry import PlannerInfo
from kvmap.core.push_offers import offer_to_proto
from kvmap.core.worker_events import (
    RegionMapChanged,
    TransferDirection,
    TransferFinished,
    WorkerEvent,
)
from kvmap.v1 import registry_pb2


def event_to_proto(event: WorkerEvent) -> registry_pb2.AttachResponse:
    if isinstance(event, TransferFinished):
        return registry_pb2.AttachResponse(
            transfer_finished=registry_pb2.TransferFinishedEvent(
                request_id=event.request_id,
                direction=registry_pb2.TransferDirection.ValueType(event.direction),
                peer_agent=event.peer_agent,
                uses=event.uses,
                max_uses=event.max_uses,
                exhausted=event.exhausted,
                released=event.released,
            )
        )
    if isinstance(event, RegionMapChanged):
        return registry_pb2.AttachResponse(
            region_map_changed=registry_pb2.RegionMapChangedEvent(
                generation=event.generation, planner=planner_info_to_proto(event.planner)
            )
        )
    return registry_pb2.AttachResponse(
        push_offered=registry_pb2.PushOfferedEvent(
            offer=offer_to_proto(event.offer), peer=event.peer
        )
    )


def event_from_proto(msg: registry_pb2.AttachResponse) -> WorkerEvent | None:
    """A stored event (the state store's pending events); None for what
    this version cannot tell a worker again: ``attached`` (never stored), a
    push offer (never stored: its checks ran when it came), or an event of
    a newer kvmapd."""
    which = msg.WhichOneof("event")
    if which == "transfer_finished":
        done = msg.transfer_finished
        return TransferFinished(
            request_id=done.request_id,
            direction=_direction(int(done.direction)),
            peer_agent=done.peer_agent,
            uses=done.uses,
            max_uses=done.max_uses,
            exhausted=done.exhausted,
            released=done.released,
        )
    if which == "region_map_changed":
        changed = msg.region_map_changed
        planner = PlannerInfo(name=changed.planner.name, version=changed.planner.version)
        return RegionMapChanged(generation=changed.generation, planner=planner)
    return None


def _direction(value: int) -> TransferDirection:
    """A stored direction; one this kvmapd does not know (a newer one's
    store) reads as UNSPECIFIED."""
    try:
        return TransferDirection(value)
    except ValueError:
        return TransferDirection.UNSPECIFIED
