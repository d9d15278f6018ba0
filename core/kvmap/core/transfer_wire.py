"""The wire forms of ``core.transfer_requests``: a worker's TransferSpec or
ReleaseRequest checked into a request, a report into a TransferStatus, and
the owner's BeginTransferRequest both ways. Each check names the field it
refuses (hostile input: limits are checked before any id is copied)."""

from __future__ import annotations

from collections.abc import Sequence

from kvmap.core.convert import requested_worker, worker_id_to_proto, worker_key_from_proto
from kvmap.core.errors import InvalidArgument, PermissionDenied
from kvmap.core.grants import check_readers, check_replaced_agents
from kvmap.core.protowire import varint
from kvmap.core.token_plan import token_groups
from kvmap.core.transfer_pieces import LayerSelection
from kvmap.core.transfer_plan import (
    MAX_BLOCKS_PER_TRANSFER,
    GroupPairs,
    block_ids,
    check_group_count,
    check_sizes,
)
from kvmap.core.transfer_requests import (
    Announcement,
    Phase,
    ReleaseNotice,
    TransferReport,
    TransferRequest,
    UseRelease,
)
from kvmap.v1 import peer_pb2, transfers_pb2, types_pb2

# Longest request id kept (a longer one is cut, not refused).
MAX_REQUEST_ID = 256
# Longest transfer id (BeginTransferRequest.transfer_id) an owner keeps and
# logs; a longer one is cut, as a request id is.
MAX_TRANSFER_ID = 64
# Peer.BeginTransfers: calls in one request; the bytes of the calls a caller
# puts in one, below what an owner reads of a BeginTransfer (352 KiB, so
# that batching widens no limit of the TCP listener); and the largest call
# it batches (a larger one goes alone, so that its size never refuses its
# neighbours). A 128K-token pull's call is 10-40 KB.
MAX_BEGIN_CALLS = 64
MAX_BEGIN_CALLS_BYTES = 256 * 1024
MAX_BATCHED_CALL_BYTES = 64 * 1024

_STATES = {
    Phase.HANDSHAKING: transfers_pb2.TRANSFER_STATE_HANDSHAKING,
    Phase.DONE: transfers_pb2.TRANSFER_STATE_DONE,
}


def transfer_from_spec(
    spec: transfers_pb2.TransferSpec, default_timeout_s: float
) -> TransferRequest | UseRelease:
    """A Pull's or Push's spec; one with the deprecated ``release`` flag is
    the release of a use (as Transfers.Release)."""
    _check_route(spec.request_id, spec.remote_target, "spec.")
    readers = check_readers(spec.readers, "spec.readers")
    if spec.release:  # deprecated: Transfers.Release
        return _release_from_spec(spec, readers, default_timeout_s)
    if not spec.groups:
        raise InvalidArgument("spec.groups", "at least one transfer group is required")
    check_group_count(len(spec.groups))
    groups = tuple(spec.groups)
    tokens = token_groups(spec)
    if not tokens:
        # On the wire fields' lengths: refused before any id is copied.
        check_sizes([_wire_pairs(g) for g in groups])
    if not spec.capability:
        # Refused here, before any peer is dialled: a pull built from
        # params without a capability is never anyone's legitimate pull.
        raise PermissionDenied("spec.capability: a transfer needs the owner's capability")
    return TransferRequest(
        request_id=spec.request_id[:MAX_REQUEST_ID],
        local=requested_worker(spec.local_worker, "spec.local_worker"),
        target=spec.remote_target,
        remote=requested_worker(spec.remote_worker, "spec.remote_worker"),
        selections=tuple(LayerSelection(g.transfer_group, tuple(g.layer_names)) for g in groups),
        pairs=tuple(_array_pairs(g) for g in groups),
        expected_generation=spec.remote_generation,
        timeout_s=_timeout_s(spec.timeout_ms, default_timeout_s),
        capability=spec.capability,
        tokens=tokens,
        readers=readers,
        remote_blocks=tuple((g.transfer_group, g.remote_block_ids) for g in groups),
    )


def _release_from_spec(
    spec: transfers_pb2.TransferSpec, readers: int, default_timeout_s: float
) -> UseRelease:
    """A release: no blocks, only whose grant (a capability) it gives up."""
    if spec.groups:
        raise InvalidArgument("spec.groups", "a release names no blocks")
    return _use_release(spec, readers, default_timeout_s, "spec.")


def release_from_request(req: transfers_pb2.ReleaseRequest, default_timeout_s: float) -> UseRelease:
    """Transfers.Release: the checks of a spec with ``release``, in its order."""
    _check_route(req.request_id, req.remote_target, "")
    readers = check_readers(req.readers, "readers")
    return _use_release(req, readers, default_timeout_s, "")


def _use_release(
    msg: transfers_pb2.TransferSpec | transfers_pb2.ReleaseRequest,
    readers: int,
    default_timeout_s: float,
    prefix: str,
) -> UseRelease:
    """The release either form names (the same fields; errors name them
    with ``prefix``), once its route and readers were checked."""
    if not msg.capability:
        raise PermissionDenied(f"{prefix}capability: a release needs the owner's capability")
    return UseRelease(
        request_id=msg.request_id[:MAX_REQUEST_ID],
        local=requested_worker(msg.local_worker, f"{prefix}local_worker"),
        target=msg.remote_target,
        remote=requested_worker(msg.remote_worker, f"{prefix}remote_worker"),
        capability=msg.capability,
        readers=readers,
        timeout_s=_timeout_s(msg.timeout_ms, default_timeout_s),
    )


def _check_route(request_id: str, target: str, prefix: str) -> None:
    if not request_id:
        raise InvalidArgument(f"{prefix}request_id", "must not be empty")
    if not target or ":" not in target:
        raise InvalidArgument(f"{prefix}remote_target", "expected HOST:PORT")


def _timeout_s(timeout_ms: int, default_timeout_s: float) -> float:
    return timeout_ms / 1000 if timeout_ms else default_timeout_s


def _wire_pairs(g: transfers_pb2.GroupBlocks) -> GroupPairs:
    """A wire group's block ids as the message holds them (for their lengths)."""
    return GroupPairs(g.transfer_group, g.local_block_ids, g.remote_block_ids)


def _array_pairs(g: transfers_pb2.GroupBlocks) -> GroupPairs:
    """A wire group's block ids as int64 arrays, as planning takes them."""
    return GroupPairs(g.transfer_group, block_ids(g.local_block_ids), block_ids(g.remote_block_ids))


def report_to_proto(report: TransferReport) -> transfers_pb2.TransferStatus:
    return transfers_pb2.TransferStatus(
        state=_STATES[report.phase],
        message=report.message,
        stats=transfers_pb2.TransferStats(
            descriptors=report.descriptors,
            bytes=report.bytes,
            post_seconds=report.post_seconds,
            completion_seconds=report.completion_seconds,
            remote_generation=report.remote_generation,
            handshaked=report.handshaked,
        ),
    )


def announcement_to_proto(a: Announcement) -> peer_pb2.BeginTransferRequest:
    announced = peer_pb2.BeginTransferRequest(
        request_id=a.request_id,
        worker=worker_id_to_proto(a.worker),
        generation=a.generation,
        agent_name=a.agent_name,
        peer_agent=a.peer_agent,
        write=a.write,
        lease_ms=a.lease_ms,
        blocks=a.blocks,
        bytes=a.nbytes,
        capability=a.capability,
        replaces_agents=a.replaces_agents,
        readers=a.readers,
        transfer_id=a.transfer_id,
        traceparent=a.traceparent,
    )
    for group, ids in a.groups:
        announced.groups.add(transfer_group=group, block_ids=ids)
    return announced


def stream_request_bytes(calls: Sequence[bytes]) -> bytes:
    """The wire bytes of a ``BeginTransferStreamRequest`` whose ``calls``
    are ``calls`` (each a serialized BeginTransferRequest). A repeated
    message field is its entries one after another, each behind the field's
    tag and its length, so a call serialized once is never copied into
    another message: at glm53's scale a copy costs ~45 us a call, as much
    as serializing it, and a batch used to be copied twice (serializing
    each call once cut the decode daemon's event loop from 1.67 to 1.40 ms
    a pull at 32 pulls in flight)."""
    return b"".join(part for call in calls for part in (_CALLS_TAG, varint(len(call)), call))


# BeginTransferStreamRequest.calls: field 1, length-delimited (wire type 2).
_CALLS_TAG = bytes([1 << 3 | 2])


def announcement_from_proto(req: peer_pb2.BeginTransferRequest) -> Announcement:
    """Peer.BeginTransfer's arguments, checked: they are wrong whatever the
    owner's state, so they are refused before anything else is."""
    check_named_blocks(req.groups)
    if req.blocks < 0 or req.bytes < 0:
        raise InvalidArgument("blocks" if req.blocks < 0 else "bytes", "must not be negative")
    if not req.peer_agent:
        # The claim and the completion notification are bound to it.
        raise InvalidArgument("peer_agent", "must not be empty")
    check_replaced_agents(req.replaces_agents, req.peer_agent)
    check_readers(req.readers)
    if req.release:
        raise InvalidArgument("release", "a release is answered by release_notice_from_proto")
    return Announcement(
        request_id=req.request_id,
        worker=worker_key_from_proto(req.worker),
        generation=req.generation,
        agent_name=req.agent_name,
        peer_agent=req.peer_agent,
        write=req.write,
        lease_ms=req.lease_ms,
        blocks=req.blocks,
        nbytes=req.bytes,
        capability=req.capability,
        groups=tuple((g.transfer_group, g.block_ids) for g in req.groups),
        replaces_agents=tuple(req.replaces_agents),
        readers=req.readers,
        transfer_id=req.transfer_id[:MAX_TRANSFER_ID],
    )


def check_named_blocks(groups: Sequence[types_pb2.BlockGrant]) -> None:
    """A BeginTransfer names no more groups and owner's blocks than one
    transfer moves: checked on the counts alone, before any id is copied or
    compared with a grant (15 million copies of one granted id took seconds
    of the event loop's time)."""
    check_group_count(len(groups))
    named = sum(len(g.block_ids) for g in groups)
    if named > MAX_BLOCKS_PER_TRANSFER:
        raise InvalidArgument(
            "groups", f"{named} block ids exceed the limit of {MAX_BLOCKS_PER_TRANSFER}"
        )


def release_notice_to_proto(n: ReleaseNotice) -> peer_pb2.BeginTransferRequest:
    """A release on the peer wire: BeginTransfer with ``release``, which
    owners of this release and the previous one answer alike."""
    return peer_pb2.BeginTransferRequest(
        request_id=n.request_id,
        worker=worker_id_to_proto(n.worker),
        peer_agent=n.peer_agent,
        capability=n.capability,
        readers=n.readers,
        release=True,
        transfer_id=n.transfer_id,
    )


def release_notice_from_proto(req: peer_pb2.BeginTransferRequest) -> ReleaseNotice:
    if req.groups:
        raise InvalidArgument("groups", "a release names no blocks")
    if not req.peer_agent:
        raise InvalidArgument("peer_agent", "must not be empty")
    check_readers(req.readers)
    return ReleaseNotice(
        request_id=req.request_id,
        worker=worker_key_from_proto(req.worker),
        peer_agent=req.peer_agent,
        capability=req.capability,
        readers=req.readers,
        transfer_id=req.transfer_id[:MAX_TRANSFER_ID],
    )
