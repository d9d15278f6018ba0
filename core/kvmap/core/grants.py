"""Per-request capabilities, the pure part: what a grant is, how a grant
request is validated against a worker's geometry, and whether an announced
transfer stays inside a grant.

A prefill worker asks its daemon for a grant (Registry.GrantTransfer) when a
request's KV is kept for a decode; the daemon answers with a random secret,
the capability, and keeps only its SHA-256 digest, so the table never holds
the secret in a form a lookup could compare byte by byte (timing). A peer's
Peer.BeginTransfer presents the capability and the owner's block ids it will
touch; every check runs before anything changes and every refusal but expiry
reads the same (``DENIED``), so a stranger learns nothing about which check
failed.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import IntEnum

import numpy as np
import numpy.typing as npt

from kvmap.core.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from kvmap.core.geometry import RegionMapModel, WorkerKey

Int64Array = npt.NDArray[np.int64]
# Block ids as a request carries them (a protobuf repeated field, a list) or
# as the transfer planner holds them.
BlockIds = Sequence[int] | Int64Array

# vLLM keeps a finished prefill request's blocks for a decode for 480 s by
# default (VLLM_NIXL_ABORT_REQUEST_TIMEOUT): a grant lives as long unless the
# worker says otherwise, and never longer than an hour.
DEFAULT_TTL_MS = 480_000
MAX_TTL_MS = 3_600_000
# Completed transfers one capability allows at most (a decode that re-pulls
# the same blocks, e.g. after a preemption).
MAX_USES = 64
# ``Grant.max_uses`` of an open grant (GrantTransferRequest.open_uses): its
# first claim that declares how many readers it has fixes the count.
OPEN_USES = 0
MAX_REQUEST_ID = 256
# Stated limits on what the table holds: grants per worker and in all, block
# ids per grant and in all (16M ids are 128 MiB of int64).
MAX_GRANTS_PER_WORKER = 16_384
MAX_GRANTS = 65_536
MAX_GRANT_BLOCKS = 1 << 20
MAX_GRANTED_BLOCKS = 1 << 24
# An expired grant is kept this long before it is swept, so its holder hears
# "expired" (FAILED_PRECONDITION) instead of "unknown" (PERMISSION_DENIED).
EXPIRED_KEPT_MS = 60_000

# The one message of every refusal: it does not say which check failed.
DENIED = "capability does not allow this transfer"
# Agents of a restarted puller's daemon that one BeginTransfer may name as
# replaced (its last few incarnations), and the length of each name.
MAX_REPLACED_AGENTS = 4
MAX_AGENT_NAME = 256


class Access(IntEnum):
    """What a grant lets its holder do with the blocks; the values are
    ``registry.proto``'s ``GrantAccess``. A grant admits one direction only:
    a decode peer that may read a prefill worker's blocks must never write
    them (its prefix cache would serve the bytes to other requests), and a
    prefill peer that may write a decode worker's blocks must never read
    them (another request's KV may have been there)."""

    READ = 1
    WRITE = 2


# A capability a caller drew itself (GrantTransferRequest.capability): as
# the daemon draws them (secrets.token_urlsafe(32): 43 characters, 256 bits)
# or longer, URL-safe (it travels in kv_transfer_params).
CALLER_CAPABILITY = re.compile(r"[A-Za-z0-9_-]{43,128}")


def check_caller_capability(value: str) -> str:
    """A caller-drawn capability's form; its randomness is the caller's word
    (the one who could weaken it holds the capability anyway)."""
    if not CALLER_CAPABILITY.fullmatch(value):
        raise InvalidArgument("capability", "must be 43 to 128 URL-safe characters")
    return value


def check_access(value: int) -> Access:
    """A grant request's ``access`` (hostile: protobuf passes on unknown
    enum values); UNSPECIFIED (0) is READ, as every grant was before."""
    if value == 0:
        return Access.READ
    try:
        return Access(value)
    except ValueError:
        raise InvalidArgument("access", f"{value} is not a GrantAccess") from None


class UnreadRelease(IntEnum):
    """The granting worker's word on a release declaring no readers
    (``release_use`` with readers 0), stored with the grant; the values are
    ``registry.proto``'s ``UnreadRelease``."""

    # Said nothing (a client that predates the field): the layout decides.
    UNSPECIFIED = 0
    # Some decode engine may read this rank not at all (the layout must agree).
    ALLOWED = 1
    # Every decode engine reads this rank: never burned unread.
    REFUSED = 2


def check_unread_release(value: int, open_uses: bool) -> UnreadRelease:
    """A grant request's ``unread_release`` (hostile input: protobuf passes
    on enum values it does not know). ALLOWED needs an open grant: no other
    can be released unread, and a worker asking for it has its geometry
    wrong."""
    try:
        choice = UnreadRelease(value)
    except ValueError:
        raise InvalidArgument("unread_release", f"{value} is not an UnreadRelease") from None
    if choice is UnreadRelease.ALLOWED and not open_uses:
        raise InvalidArgument("unread_release", "ALLOWED needs open_uses")
    return choice


def digest(capability: str) -> bytes:
    """What the table stores and looks grants up by, never the capability."""
    return hashlib.sha256(capability.encode("utf-8", errors="surrogatepass")).digest()


@dataclass(frozen=True)
class Grant:
    """One capability's binding. ``blocks`` holds, per transfer group, the
    granted block ids sorted and distinct; ``uses`` counts completed
    transfers and released uses. ``max_uses`` is ``OPEN_USES`` until the
    first claim of an open grant fixes it. ``unread_release`` is the
    worker's word on a release declaring no readers; ``access`` the one
    direction (read or write) the grant admits."""

    digest: bytes
    worker: WorkerKey
    generation: int
    request_id: str
    blocks: Mapping[int, Int64Array]
    expires_unix_ms: int
    max_uses: int
    uses: int = 0
    unread_release: UnreadRelease = UnreadRelease.UNSPECIFIED
    access: Access = Access.READ

    @property
    def block_count(self) -> int:
        return sum(len(ids) for ids in self.blocks.values())

    def expired(self, now_ms: int) -> bool:
        return now_ms >= self.expires_unix_ms

    @property
    def open(self) -> bool:
        """Whether no claim fixed the grant's use count yet."""
        return self.max_uses == OPEN_USES

    @property
    def exhausted(self) -> bool:
        """Whether no use is left (never for an open grant)."""
        return not self.open and self.uses >= self.max_uses

    def allows(self, groups: Iterable[tuple[int, BlockIds]]) -> bool:
        """Whether every (group, block id) named is inside the grant. Naming
        no block at all is not allowed: the owner must know what is read."""
        named = False
        for group, ids in groups:
            granted = self.blocks.get(group)
            if granted is None:
                return False
            if not len(ids):
                continue
            named = True
            wanted = np.asarray(ids, dtype=np.int64)
            if _same_ids(wanted, granted):
                continue
            # Whether each id is inside does not depend on their order, and
            # a binary search runs about ten times faster over sorted needles
            # than over a request's own order (cache misses).
            wanted = np.sort(wanted)
            if not _same_ids(wanted, granted) and not _inside(wanted, granted):
                return False
        return named


def _same_ids(wanted: Int64Array, granted: Int64Array) -> bool:
    """Whether ``wanted`` is exactly the granted ids (sorted, distinct): the
    usual pull names all of its blocks, and one comparison then answers."""
    return len(wanted) == len(granted) and bool(np.array_equal(wanted, granted))


def _inside(wanted: Int64Array, granted: Int64Array) -> bool:
    """Whether every id of ``wanted`` is one of ``granted`` (sorted)."""
    at = np.searchsorted(granted, wanted)
    # (An id past the last granted one has ``at == len``: checked first.)
    return bool((at < len(granted)).all() and (granted[at] == wanted).all())


def group_limits(model: RegionMapModel) -> dict[int, int]:
    """Block ids valid in each transfer group of a worker: those every
    region of the group has."""
    limits: dict[int, int] = {}
    for region in model.regions:
        g = region.transfer_group
        limits[g] = min(limits.get(g, region.num_blocks), region.num_blocks)
    return limits


def granted_blocks(
    groups: Sequence[tuple[int, BlockIds]], limits: Mapping[int, int]
) -> dict[int, Int64Array]:
    """Validate the groups of a grant request against the worker's group
    limits: each group exists and appears once, block ids are distinct and in
    range, at least one block, at most ``MAX_GRANT_BLOCKS``."""
    if not groups:
        raise InvalidArgument("groups", "at least one transfer group is required")
    total = sum(len(ids) for _, ids in groups)
    if total == 0:
        raise InvalidArgument("groups", "at least one block is required")
    if total > MAX_GRANT_BLOCKS:
        raise InvalidArgument("groups", f"{total} block ids; at most {MAX_GRANT_BLOCKS}")
    out: dict[int, Int64Array] = {}
    for i, (group, ids) in enumerate(groups):
        at = f"groups[{i}]"
        if group not in limits:
            raise InvalidArgument(f"{at}.transfer_group", f"worker has no group {group}")
        if group in out:
            raise InvalidArgument(f"{at}.transfer_group", f"group {group} appears twice")
        arr = np.asarray(ids, dtype=np.int64)
        bad = np.flatnonzero((arr < 0) | (arr >= limits[group]))
        if len(bad):
            j = int(bad[0])
            raise InvalidArgument(
                f"{at}.block_ids[{j}]", f"block {arr[j]} out of range [0, {limits[group]})"
            )
        arr = np.sort(arr)
        if len(arr) > 1 and (arr[1:] == arr[:-1]).any():
            raise InvalidArgument(f"{at}.block_ids", "block ids must be distinct")
        out[group] = arr
    return out


def check_ttl(ttl_ms: int) -> int:
    """The grant's lifetime in ms: 0 means the default; more than the maximum
    is refused rather than cut, so the worker knows what it got."""
    if ttl_ms == 0:
        return DEFAULT_TTL_MS
    if ttl_ms > MAX_TTL_MS:
        raise InvalidArgument("ttl_ms", f"{ttl_ms} ms; at most {MAX_TTL_MS}")
    return ttl_ms


def check_max_uses(max_uses: int) -> int:
    if max_uses == 0:
        return 1
    if max_uses > MAX_USES:
        raise InvalidArgument("max_uses", f"{max_uses}; at most {MAX_USES}")
    return max_uses


def check_grant_uses(max_uses: int, open_uses: bool) -> int:
    """The ``max_uses`` a grant is minted with: ``OPEN_USES`` for an open
    grant, which takes no count of its own."""
    if open_uses:
        if max_uses:
            raise InvalidArgument("max_uses", f"{max_uses}; must be 0 for an open grant")
        return OPEN_USES
    return check_max_uses(max_uses)


def check_readers(readers: int, field: str = "readers") -> int:
    """A declared reader count (hostile input): 0 (none declared) to ``MAX_USES``."""
    if not 0 <= readers <= MAX_USES:
        raise InvalidArgument(field, f"{readers}; must be in [0, {MAX_USES}]")
    return readers


@dataclass(frozen=True)
class ReaderLayout:
    """What the granting worker's registration says about who can read it:
    its tensor-parallel size and rank, and its model's KV head count when its
    cache is split by heads (a head layout registered; 0 when the cache is
    replicated on every rank: MLA, indexer caches)."""

    tp_size: int = 1
    tp_rank: int = 0
    kv_heads: int = 0

    @property
    def max_readers(self) -> int:
        """Decode ranks that can read one rank: a decode engine has at most
        ``MAX_USES`` ranks, and ``reshard.source_ranks`` spreads them evenly
        over the prefill ranks (whole heads, or round-robin over replicas),
        so no rank is read by more than ``ceil(MAX_USES / tp_size)``."""
        return -(-MAX_USES // max(self.tp_size, 1))

    @property
    def may_go_unread(self) -> bool:
        """Whether some decode engine reads this rank not at all
        (``reshard.source_ranks``): never rank 0 (decode rank 0 reads it);
        another rank of a replicated cache (decode rank d reads prefill rank
        ``d % tp_size``), or of a head-split one whose ranks hold replicas of
        the heads (more ranks than heads: a decode reads one replica of
        each). Ranks holding heads of their own are always read."""
        if self.tp_rank < 1:
            return False
        return self.kv_heads == 0 or self.tp_size > self.kv_heads


def declare_readers(grant: Grant, readers: int, layout: ReaderLayout | None = None) -> Grant:
    """The grant as a claim declaring ``readers`` (0: none) sees it: an open
    grant's count fixed (1 when none is declared), a fixed one unchanged.
    A declared count other than a fixed one is refused: the other readers
    would find the grant used up, or the owner would keep the blocks for
    readers who never come. So is a count the worker's layout cannot have
    (``ReaderLayout.max_readers``): a first claim declaring 64 readers of a
    rank 4 decode ranks can read would hold the blocks for readers who do
    not exist."""
    readers = check_readers(readers)
    layout = layout or ReaderLayout()
    if grant.open and readers > layout.max_readers:
        # (A fixed count is the worker's own word, checked below.)
        raise FailedPrecondition(
            f"capability for request {grant.request_id}: its worker (tensor-parallel size "
            f"{layout.tp_size}) is read by at most {layout.max_readers} decode ranks; "
            f"the caller declared {readers}"
        )
    if grant.open:
        return replace(grant, max_uses=readers or 1)
    if readers and readers != grant.max_uses:
        raise FailedPrecondition(
            f"capability for request {grant.request_id} admits {grant.max_uses} readers; "
            f"the caller declared {readers}"
        )
    return grant


def release_use(grant: Grant, readers: int, layout: ReaderLayout | None = None) -> Grant:
    """The grant once a reader gave up its use without a transfer: one use
    spent; with ``readers`` 0 (no one reads the grant) an open grant with
    no use taken is used up at once (``max_uses`` 1, ``uses`` 1). That burns
    the grant unread, so it needs the prefill worker's own word: the grant
    must not say REFUSED (``Grant.unread_release``), and its registered
    layout must allow a rank no decode reads (``ReaderLayout.may_go_unread``);
    a decode peer's say alone is not enough."""
    if readers == 0:
        check_unread(grant, layout or ReaderLayout())
        return replace(grant, max_uses=1, uses=1)
    fixed = declare_readers(grant, readers, layout)
    return replace(fixed, uses=fixed.uses + 1)


def check_unread(grant: Grant, layout: ReaderLayout) -> None:
    """FailedPrecondition unless ``grant`` may be used up unread: open (no
    claim fixed its count), not REFUSED by its worker, and of a rank its
    layout lets go unread. ALLOWED and UNSPECIFIED both leave the last word
    to the layout: the worker's ALLOWED alone does not make a rank unread."""
    if not grant.open:
        raise FailedPrecondition(
            f"capability for request {grant.request_id} admits {grant.max_uses} readers; "
            "the caller declared none"
        )
    if grant.unread_release is UnreadRelease.REFUSED:
        raise FailedPrecondition(
            f"capability for request {grant.request_id}: its worker said every decode engine "
            "reads it; the caller declared no readers"
        )
    if not layout.may_go_unread:
        raise FailedPrecondition(
            f"capability for request {grant.request_id}: its worker (rank {layout.tp_rank} "
            f"of tensor-parallel size {layout.tp_size}) is read by every decode engine; "
            "the caller declared no readers"
        )


def check_request_id(request_id: str, field: str = "request_id") -> str:
    if not request_id:
        raise InvalidArgument(field, "must not be empty")
    if len(request_id) > MAX_REQUEST_ID:
        raise InvalidArgument(field, f"{len(request_id)} characters; at most {MAX_REQUEST_ID}")
    return request_id


def check_replaced_agents(names: Sequence[str], peer_agent: str) -> frozenset[str]:
    """The agents a BeginTransfer says its caller replaces (hostile input):
    at most ``MAX_REPLACED_AGENTS`` non-empty names of at most
    ``MAX_AGENT_NAME`` characters, never the caller itself (its own claim
    needs no taking over)."""
    if len(names) > MAX_REPLACED_AGENTS:
        raise InvalidArgument(
            "replaces_agents", f"{len(names)} names; at most {MAX_REPLACED_AGENTS}"
        )
    for i, name in enumerate(names):
        if not name:
            raise InvalidArgument(f"replaces_agents[{i}]", "must not be empty")
        if len(name) > MAX_AGENT_NAME:
            raise InvalidArgument(
                f"replaces_agents[{i}]", f"{len(name)} characters; at most {MAX_AGENT_NAME}"
            )
        if name == peer_agent:
            raise InvalidArgument(f"replaces_agents[{i}]", "names the caller's own agent")
    return frozenset(names)


def check_binding(
    grant: Grant | None,
    *,
    worker: WorkerKey,
    generation: int,
    request_id: str,
    groups: Iterable[tuple[int, BlockIds]],
) -> Grant:
    """The grant a BeginTransfer presented, if it allows exactly this: the
    worker at its current generation, this request, these blocks. Anything
    else is one generic PermissionDenied."""
    grant = check_owner(grant, worker=worker, generation=generation, request_id=request_id)
    if not grant.allows(groups):
        raise PermissionDenied(DENIED)
    return grant


def check_owner(
    grant: Grant | None, *, worker: WorkerKey, generation: int, request_id: str
) -> Grant:
    """The grant a release presented, if it is this worker's (at its current
    generation) for this request: one generic PermissionDenied otherwise."""
    if (
        grant is None
        or grant.worker != worker
        or grant.generation != generation
        or grant.request_id != request_id
    ):
        raise PermissionDenied(DENIED)
    return grant
