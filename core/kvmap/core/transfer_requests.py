"""What the engine's transfers take and yield, as domain types: a worker's
transfer or release of a use (the decode side), what the owner is told
(an announcement or a release notice), and a transfer's progress reports.
The wire forms of each, and their checks, are ``core.transfer_wire``."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmap.core.geometry import WorkerKey
from kvmap.core.token_plan import TokenGroup
from kvmap.core.transfer_pieces import LayerSelection
from kvmap.core.transfer_plan import GroupPairs

# The owner's block ids of one transfer group, each of which the grant must
# hold. The sequence is the wire message's own (copied to the announcement
# in C: a list of Python ints costs tens of microseconds a group).
GroupBlockIds = tuple[int, Sequence[int]]


@dataclass(frozen=True)
class TransferRequest:
    """A worker's checked pull or push."""

    request_id: str
    local: WorkerKey
    target: str
    remote: WorkerKey
    selections: tuple[LayerSelection, ...]
    pairs: tuple[GroupPairs, ...]
    expected_generation: int
    timeout_s: float
    # The owner's grant for this request (kv_transfer_params "kvmap_capability").
    capability: str
    # Token-mode groups (core.token_plan), else empty.
    tokens: tuple[TokenGroup, ...] = ()
    # Transfers in all reading the owner's grant (0: not declared).
    readers: int = 0
    # The owner's block ids per group, as the announcement carries them.
    # Left out of the request's hash (wire sequences are unhashable).
    remote_blocks: tuple[GroupBlockIds, ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class UseRelease:
    """A worker gives up its use of a remote worker's grant: nothing moves."""

    request_id: str
    local: WorkerKey
    target: str
    remote: WorkerKey
    capability: str
    readers: int
    timeout_s: float


class Phase(enum.Enum):
    """Where a transfer is (TransferState on the wire)."""

    HANDSHAKING = enum.auto()
    DONE = enum.auto()


@dataclass(frozen=True)
class TransferReport:
    """One step of a transfer, as its caller is told."""

    phase: Phase
    message: str
    descriptors: int = 0
    bytes: int = 0
    post_seconds: float = 0.0
    completion_seconds: float = 0.0
    remote_generation: int = 0
    handshaked: bool = False


@dataclass(frozen=True)
class Announcement:
    """What a puller (or pusher) tells the owner before it posts
    (Peer.BeginTransfer)."""

    request_id: str
    # Not checked by the wire parse: the owner answers nothing about workers
    # to a caller without a capability (``convert.check_requested``).
    worker: WorkerKey
    generation: int
    agent_name: str
    peer_agent: str
    write: bool
    lease_ms: int
    blocks: int
    nbytes: int
    capability: str
    groups: tuple[GroupBlockIds, ...]
    replaces_agents: tuple[str, ...]
    readers: int
    # The caller's id of the transfer, which both daemons log (peer.proto).
    transfer_id: str = ""
    # The W3C traceparent of the caller's span of the transfer (gRPC metadata
    # of a BeginTransfer, the call's own field in a BeginTransfers): the
    # owner's span of it is its child.
    traceparent: str = ""


@dataclass(frozen=True)
class ReleaseNotice:
    """What a reader that needs none of the blocks tells the owner: it gives
    up its use of the grant (Peer.BeginTransfer with ``release``)."""

    request_id: str
    worker: WorkerKey  # checked by the owner, as an announcement's
    peer_agent: str
    capability: str
    readers: int
    transfer_id: str = ""  # as an announcement's
    traceparent: str = ""  # as an announcement's
