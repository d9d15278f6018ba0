"""What a worker hears on its Attach stream after ``attached``, as domain
types: a transfer of its blocks finished (or a use of its grant was
released), its region map changed, a decode daemon offered blocks for a
push. The engine makes them; their wire form (``registry.proto``'s
``AttachResponse``) is ``core.event_wire``, which the Attach stream and the
state store (pending events) convert with."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvmap.core.geometry import PlannerInfo
from kvmap.core.push_offers import Offer


class TransferDirection(enum.IntEnum):
    """Which way a finished transfer moved a worker's blocks; values equal
    the proto enum's."""

    UNSPECIFIED = 0
    PULLED_FROM = 1  # a peer read them (this worker was prefill)
    PUSHED_TO = 2  # a peer wrote them


@dataclass(frozen=True)
class TransferFinished:
    """A request's blocks were read (or written) by a peer, or a reader
    released its use without a transfer (``released``)."""

    request_id: str
    direction: TransferDirection
    peer_agent: str
    # The grant's completed uses and how many it admits (0 and 0: the grant
    # was gone), and whether none is left (the blocks may be freed).
    uses: int = 0
    max_uses: int = 0
    exhausted: bool = False
    released: bool = False


@dataclass(frozen=True)
class RegionMapChanged:
    """The worker was re-planned (or registered): its new generation."""

    generation: int
    planner: PlannerInfo


@dataclass(frozen=True)
class PushOffered:
    """A decode daemon's checked offer, from the authenticated ``peer``."""

    offer: Offer
    peer: str


WorkerEvent = TransferFinished | RegionMapChanged | PushOffered
