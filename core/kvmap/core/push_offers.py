"""Push offers, the pure part: what a decode worker offers a prefill engine
so that the prefill side writes a request's KV into the decode worker's
blocks (``types.proto``'s ``PushOffer``), and the checks every party runs on
one before it acts: the decode daemon before it relays it, the prefill
daemon when a peer sends it, the prefill worker before it pushes.

An offer is hostile input wherever it arrives. It cannot grant anything by
itself: its capability is checked by the decode daemon that minted it when
the prefill side writes (a write grant of exactly the offered blocks), and
the prefill worker acts only on an offer whose ``push_id`` is the one its
own request was given by the router (an unguessable id), so a stranger that
learnt neither cannot make a prefill engine write anywhere.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvmap.core.config import parse_host_port
from kvmap.core.errors import InvalidArgument, KvmapError
from kvmap.core.grants import MAX_GRANT_BLOCKS, MAX_REQUEST_ID, MAX_USES
from kvmap.v1 import types_pb2

# The router's id of a request on both engines: 16 to 128 URL-safe
# characters (``secrets.token_urlsafe(18)`` is 24).
PUSH_ID = re.compile(r"[A-Za-z0-9_-]{16,128}")
# A capability as kvmapd mints it (URL-safe, bounded).
_CAPABILITY = re.compile(r"[A-Za-z0-9_-]{1,128}")
MAX_ENGINE_ID = 256
MAX_TARGET = 300
# Transfer groups of one offer (a hybrid model has a handful).
MAX_OFFER_GROUPS = 64
# Layer groups a push may be cut into (each a transfer, a use of the grant).
MAX_LAYER_GROUPS = 64
# Tokens of one request: bounded so arithmetic on them stays in int64.
MAX_TOKENS = 1 << 40


@dataclass(frozen=True)
class OfferedGroup:
    transfer_group: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class Offer:
    """A checked ``PushOffer``."""

    push_id: str
    prefill_engine_id: str
    decode_worker: types_pb2.WorkerId
    decode_target: str
    decode_tp_size: int
    decode_block_size: int
    first_token: int
    num_tokens: int
    groups: tuple[OfferedGroup, ...]
    capability: str
    expires_unix_ms: int
    request_id: str

    @property
    def blocks(self) -> int:
        return sum(len(g.block_ids) for g in self.groups)


def _text(value: str, field: str, limit: int) -> str:
    if not value:
        raise InvalidArgument(f"offer.{field}", "required")
    if len(value) > limit:
        raise InvalidArgument(f"offer.{field}", f"{len(value)} characters; at most {limit}")
    return value


def _bounded(value: int, field: str, low: int, high: int) -> int:
    if not low <= value <= high:
        raise InvalidArgument(f"offer.{field}", f"{value} not in [{low}, {high}]")
    return value


def _groups(msg: types_pb2.PushOffer) -> tuple[OfferedGroup, ...]:
    if not msg.groups:
        raise InvalidArgument("offer.groups", "at least one transfer group is required")
    if len(msg.groups) > MAX_OFFER_GROUPS:
        raise InvalidArgument("offer.groups", f"{len(msg.groups)}; at most {MAX_OFFER_GROUPS}")
    total = sum(len(g.block_ids) for g in msg.groups)
    if not 0 < total <= MAX_GRANT_BLOCKS:
        raise InvalidArgument("offer.groups", f"{total} block ids; 1 to {MAX_GRANT_BLOCKS}")
    seen: set[int] = set()
    out = []
    for i, g in enumerate(msg.groups):
        if g.transfer_group in seen:
            raise InvalidArgument(f"offer.groups[{i}]", f"group {g.transfer_group} twice")
        seen.add(g.transfer_group)
        if any(b < 0 for b in g.block_ids):
            raise InvalidArgument(f"offer.groups[{i}].block_ids", "negative block id")
        out.append(OfferedGroup(g.transfer_group, tuple(g.block_ids)))
    return tuple(out)


def check_push_id(push_id: object, field: str = "offer.push_id") -> str:
    if not isinstance(push_id, str) or not PUSH_ID.fullmatch(push_id):
        raise InvalidArgument(field, "must be 16 to 128 URL-safe characters")
    return push_id


def offer_from_proto(msg: types_pb2.PushOffer) -> Offer:
    """Every field of a received offer checked (``InvalidArgument`` naming
    the first bad one); nothing about the capability's validity, which only
    the decode daemon that minted it can tell."""
    check_push_id(msg.push_id)
    target = _text(msg.decode_target, "decode_target", MAX_TARGET)
    try:
        parse_host_port(target, "offer.decode_target")
    except KvmapError as err:
        raise InvalidArgument("offer.decode_target", str(err)) from None
    if not msg.HasField("decode_worker") or not msg.decode_worker.engine_id:
        raise InvalidArgument("offer.decode_worker", "required")
    _text(msg.decode_worker.engine_id, "decode_worker.engine_id", MAX_ENGINE_ID)
    block = _bounded(msg.decode_block_size, "decode_block_size", 1, 1 << 20)
    first = _bounded(msg.first_token, "first_token", 0, MAX_TOKENS)
    if first % block:
        raise InvalidArgument("offer.first_token", f"{first} is not a multiple of {block}")
    if not _CAPABILITY.fullmatch(msg.capability):
        raise InvalidArgument("offer.capability", "malformed")
    return Offer(
        push_id=msg.push_id,
        prefill_engine_id=_text(msg.prefill_engine_id, "prefill_engine_id", MAX_ENGINE_ID),
        decode_worker=msg.decode_worker,
        decode_target=target,
        decode_tp_size=_bounded(msg.decode_tp_size, "decode_tp_size", 1, MAX_USES),
        decode_block_size=block,
        first_token=first,
        num_tokens=_bounded(msg.num_tokens, "num_tokens", 1, MAX_TOKENS),
        groups=_groups(msg),
        capability=msg.capability,
        expires_unix_ms=msg.expires_unix_ms,
        request_id=_text(msg.request_id, "request_id", MAX_REQUEST_ID),
    )


def offer_to_proto(offer: Offer) -> types_pb2.PushOffer:
    """The wire form of a checked offer: what a daemon relays (to the
    prefill side's daemon, to its workers) is what it checked."""
    return types_pb2.PushOffer(
        push_id=offer.push_id,
        prefill_engine_id=offer.prefill_engine_id,
        decode_worker=offer.decode_worker,
        decode_target=offer.decode_target,
        decode_tp_size=offer.decode_tp_size,
        decode_block_size=offer.decode_block_size,
        first_token=offer.first_token,
        num_tokens=offer.num_tokens,
        groups=[
            types_pb2.BlockGrant(transfer_group=g.transfer_group, block_ids=g.block_ids)
            for g in offer.groups
        ],
        capability=offer.capability,
        expires_unix_ms=offer.expires_unix_ms,
        request_id=offer.request_id,
    )
