"""A worker's events (``core.worker_events``) and their wire form
(``core.event_wire``): what the Attach stream sends and the state store
keeps. Each event the engine makes is written with every field and reads
back as itself; a checked push offer is written as it was checked."""

from __future__ import annotations

import pytest

from kvmap.core.event_wire import event_from_proto, event_to_proto
from kvmap.core.geometry import PlannerInfo
from kvmap.core.push_offers import offer_from_proto, offer_to_proto
from kvmap.core.worker_events import (
    PushOffered,
    RegionMapChanged,
    TransferDirection,
    TransferFinished,
    WorkerEvent,
)
from kvmap.v1 import registry_pb2, types_pb2

OFFER = types_pb2.PushOffer(
    push_id="p" * 24,
    prefill_engine_id="prefill",
    decode_worker=types_pb2.WorkerId(engine_id="decode", tp_rank=1),
    decode_target="10.0.0.2:50051",
    decode_tp_size=2,
    decode_block_size=16,
    first_token=32,
    num_tokens=100,
    groups=[
        types_pb2.BlockGrant(transfer_group=0, block_ids=[7, 3, 9]),
        types_pb2.BlockGrant(transfer_group=2, block_ids=[1]),
    ],
    capability="c" * 43,
    expires_unix_ms=1_700_000_000_000,
    request_id="req-1",
)

STORED: list[WorkerEvent] = [
    TransferFinished("r1", TransferDirection.PULLED_FROM, "kvmapd-a", 1, 2, False, False),
    TransferFinished("r2", TransferDirection.PUSHED_TO, "kvmapd-b", 3, 3, True, True),
    RegionMapChanged(7, PlannerInfo("coalesce", 2)),
]


@pytest.mark.parametrize("event", STORED, ids=lambda e: type(e).__name__)
def test_a_stored_event_reads_back_as_itself(event: WorkerEvent) -> None:
    """Each event the store keeps, written, serialised and read back, is the same event."""
    wire = registry_pb2.AttachResponse.FromString(event_to_proto(event).SerializeToString())
    assert event_from_proto(wire) == event


def test_a_finished_transfer_is_written_with_every_field() -> None:
    """TransferFinished becomes the wire's transfer_finished with each field under its name."""
    msg = event_to_proto(STORED[1])
    assert msg.transfer_finished == registry_pb2.TransferFinishedEvent(
        request_id="r2",
        direction=registry_pb2.TRANSFER_DIRECTION_PUSHED_TO,
        peer_agent="kvmapd-b",
        uses=3,
        max_uses=3,
        exhausted=True,
        released=True,
    )


def test_a_push_offer_is_relayed_as_it_was_checked() -> None:
    """A checked offer written back is the message it was read from, field for field (the
    prefill daemon relays it to its workers, the decode daemon to the prefill daemon)."""
    offer = offer_from_proto(OFFER)
    assert offer_to_proto(offer) == OFFER
    event = event_to_proto(PushOffered(offer, "ipv4:10.0.0.2:4000"))
    assert event.push_offered == registry_pb2.PushOfferedEvent(
        offer=OFFER, peer="ipv4:10.0.0.2:4000"
    )


def test_what_a_store_cannot_tell_again_reads_as_nothing() -> None:
    """An attached event, a push offer (never stored) or an event of a newer kvmapd (no kind
    this one knows) reads as None; a direction this kvmapd does not know reads as UNSPECIFIED."""
    attached = registry_pb2.AttachResponse(attached=registry_pb2.AttachedEvent(generation=1))
    offered = registry_pb2.AttachResponse(push_offered=registry_pb2.PushOfferedEvent(offer=OFFER))
    for msg in (attached, offered, registry_pb2.AttachResponse()):
        assert event_from_proto(msg) is None
    newer = registry_pb2.AttachResponse(
        transfer_finished=registry_pb2.TransferFinishedEvent(request_id="r", direction=9)  # type: ignore[arg-type]
    )
    got = event_from_proto(newer)
    assert isinstance(got, TransferFinished) and got.direction is TransferDirection.UNSPECIFIED
