"""The model of a worker's KV-cache layout and of a planned region map.

Pure data: frozen dataclasses, no I/O, no protobuf. Everything the planners
and the transfer planner compute is expressed in these types; conversion to
and from the wire format lives in ``convert``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class CacheKind(enum.IntEnum):
    """Kind of KV cache a layer holds; values equal the proto enum's."""

    MLA = 1
    INDEXER = 2
    MHA = 3
    MAMBA = 4
    OTHER = 5

    @property
    def replicated(self) -> bool:
        """Replicated on every tensor-parallel rank, never split by heads.

        Only such kinds may be coalesced across layers, and only they transfer
        between engines of different tensor-parallel sizes.
        """
        return self in (CacheKind.MLA, CacheKind.INDEXER)


class TokenLayout(enum.IntEnum):
    """How heads and tokens lie within a block of a head-split view; values
    equal the proto enum's."""

    HEADS_OUTER = 1  # vLLM's HND: [heads, tokens, head_size]
    TOKENS_OUTER = 2  # vLLM's NHD: [tokens, heads, head_size]
    # [heads, K/V, tokens, head_size]: each head's K rows, then its V rows.
    HEADS_KV_TOKENS = 3
    # vLLM's CPU cache: a [blocks, heads, tokens, 2 x head_size] tensor whose
    # kernels keep, per head, K transposed ([head_size, tokens]) and then V
    # ([tokens, head_size]).
    HEADS_KT_V = 4


@dataclass(frozen=True)
class HeadLayout:
    """How a worker's head-split (MHA) views hold heads and tokens (the wire
    ``HeadLayout``): what a peer of another TP size or block size needs to
    plan a transfer. Its rank's heads follow from ``total_kv_heads``, the
    worker's TP size and rank (``core.reshard.rank_heads``)."""

    total_kv_heads: int
    head_size: int
    head_bytes: int
    token_layout: TokenLayout


class DeviceKind(enum.IntEnum):
    """Memory type of an allocation; values equal the proto enum's."""

    CPU = 1
    CUDA = 2


@dataclass(frozen=True, order=True)
class WorkerKey:
    """Identity of one vLLM worker (one rank of one engine)."""

    engine_id: str
    dp_rank: int = 0
    tp_rank: int = 0
    pp_rank: int = 0

    def __str__(self) -> str:
        return f"{self.engine_id}/dp{self.dp_rank}/tp{self.tp_rank}/pp{self.pp_rank}"


@dataclass(frozen=True)
class DeviceRef:
    kind: DeviceKind = DeviceKind.CPU
    index: int = 0
    uuid: str = ""


@dataclass(frozen=True)
class ShmFdHandle:
    """Shared memory handed over on the fd hand-off socket: batch ``token``'s
    fd number ``index``; the allocation starts ``offset_bytes`` into it."""

    token: str
    index: int = 0
    offset_bytes: int = 0


@dataclass(frozen=True)
class ShmPathHandle:
    """Shared memory the daemon opens by path (/dev/shm/..., a file)."""

    path: str
    offset_bytes: int = 0


@dataclass(frozen=True)
class CudaIpcHandle:
    """The CUDA IPC handle of the cudaMalloc block backing the allocation,
    the allocation's offset in that block and the block's size."""

    handle: bytes
    offset_bytes: int = 0
    block_size_bytes: int = 0


@dataclass(frozen=True)
class NoHandle:
    """Planning only: no memory is attached (kvmapd plan, PlanPreview)."""


# How the daemon reaches an allocation's memory (the wire oneof ``handle``).
AllocationHandle = ShmFdHandle | ShmPathHandle | CudaIpcHandle | NoHandle


@dataclass(frozen=True)
class AllocationSpec:
    """One backing allocation (a storage) the worker's views live in.

    ``handle`` is how the daemon reaches its memory (None: the worker named
    none). It is not part of the allocation's identity: two registrations of
    the same layout compare equal whatever their handles (a memfd's token
    is new with every hand-over), and planners never read it."""

    id: str
    size_bytes: int
    device: DeviceRef = DeviceRef()
    handle: AllocationHandle | None = field(default=None, compare=False)


@dataclass(frozen=True)
class ViewSpec:
    """One layer's view: ``num_blocks`` blocks of ``block_len_bytes``; block i
    starts at ``offset_bytes + i * block_stride_bytes`` in its allocation."""

    layer_name: str
    allocation_id: str
    transfer_group: int
    cache_kind: CacheKind
    dtype: str
    offset_bytes: int
    block_len_bytes: int
    block_stride_bytes: int
    num_blocks: int

    @property
    def end_of_block(self) -> int:
        """Offset just past the view's block 0."""
        return self.offset_bytes + self.block_len_bytes


@dataclass(frozen=True)
class ModelIdentity:
    """What a worker's KV cache means (the wire ``ModelIdentity``); an empty
    field is unknown and matches anything (``core.compat``)."""

    name: str = ""
    revision: str = ""
    dtype: str = ""
    kv_cache_dtype: str = ""
    config_digest: str = ""


@dataclass(frozen=True)
class WorkerGeometry:
    """Everything a worker tells the daemon about its KV cache."""

    worker: WorkerKey
    kv_cache_layout: str
    block_size_tokens: int
    allocations: tuple[AllocationSpec, ...]
    views: tuple[ViewSpec, ...]
    tp_size: int = 1
    model: ModelIdentity = ModelIdentity()
    heads: HeadLayout | None = None

    def allocation(self, allocation_id: str) -> AllocationSpec:
        for a in self.allocations:
            if a.id == allocation_id:
                return a
        raise KeyError(allocation_id)


@dataclass(frozen=True)
class LayerPlacement:
    """Where one layer's block lives inside its region's block."""

    layer_name: str
    offset_in_region: int
    len_bytes: int
    cache_kind: CacheKind
    # The view's dtype; "" when the map's publisher did not say.
    dtype: str = ""


@dataclass(frozen=True)
class Region:
    """A registered span: ``num_blocks`` blocks of ``block_len_bytes`` at
    ``offset_bytes + i * block_stride_bytes`` of one allocation."""

    id: int
    allocation_id: str
    transfer_group: int
    offset_bytes: int
    block_len_bytes: int
    block_stride_bytes: int
    num_blocks: int
    layers: tuple[LayerPlacement, ...]
    # Why the region was not merged with neighbours; "" when it was eligible.
    fallback_reason: str = ""

    @property
    def full_row(self) -> bool:
        """Consecutive blocks are contiguous: a run of block ids is one span."""
        return self.block_len_bytes == self.block_stride_bytes

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(p.layer_name for p in self.layers)

    @property
    def descriptor_count(self) -> int:
        return self.num_blocks


@dataclass(frozen=True)
class PlannerInfo:
    name: str
    version: int


@dataclass(frozen=True)
class Plan:
    """A planner's output for one worker geometry."""

    planner: PlannerInfo
    regions: tuple[Region, ...]
    baseline_descriptor_count: int = 0

    @property
    def descriptor_count(self) -> int:
        return sum(r.descriptor_count for r in self.regions)


@dataclass(frozen=True)
class PlacedAllocation:
    """An allocation as its owning daemon mapped it."""

    id: str
    size_bytes: int
    device: DeviceRef
    # Virtual address in the owning daemon's process (what NIXL registered);
    # 0 in plan previews.
    base_address: int = 0


@dataclass(frozen=True)
class RegionMapModel:
    """The core model of a published region map (the wire ``RegionMap``):
    what a transfer planner needs of either side."""

    worker: WorkerKey
    generation: int
    planner: PlannerInfo
    regions: tuple[Region, ...]
    allocations: tuple[PlacedAllocation, ...]
    kv_cache_layout: str = ""
    block_size_tokens: int = 0
    tp_size: int = 1
    baseline_descriptor_count: int = 0
    view_count: int = 0
    model: ModelIdentity = ModelIdentity()
    heads: HeadLayout | None = None

    @property
    def descriptor_count(self) -> int:
        return sum(r.descriptor_count for r in self.regions)

    def allocation(self, allocation_id: str) -> PlacedAllocation:
        for a in self.allocations:
            if a.id == allocation_id:
                return a
        raise KeyError(allocation_id)
