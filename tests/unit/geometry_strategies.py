"""Hypothesis strategies and builders of worker geometries for the unit tests.

``geometries()`` draws geometries that are valid by construction: each
allocation is a sequence of sections laid out one after the other, either a
block-outermost *row section* (several views side by side inside one stride,
some adjacent, some separated by gaps, some aliased, some with fewer blocks)
or a layer-outermost *single view*. Small numbers keep byte-level checks cheap.
"""

from __future__ import annotations

from hypothesis import strategies as st

from kvmap.core.geometry import (
    AllocationSpec,
    CacheKind,
    DeviceKind,
    DeviceRef,
    ViewSpec,
    WorkerGeometry,
    WorkerKey,
)

# Mostly coalescible kinds, so that runs form often enough to be tested.
KINDS = [CacheKind.MLA, CacheKind.MLA, CacheKind.MLA, CacheKind.INDEXER, *CacheKind]


def view(
    name: str,
    offset: int,
    length: int,
    stride: int,
    blocks: int = 4,
    *,
    kind: CacheKind = CacheKind.MLA,
    group: int = 0,
    allocation: str = "kv",
) -> ViewSpec:
    return ViewSpec(
        layer_name=name,
        allocation_id=allocation,
        transfer_group=group,
        cache_kind=kind,
        dtype="uint8",
        offset_bytes=offset,
        block_len_bytes=length,
        block_stride_bytes=stride,
        num_blocks=blocks,
    )


def geometry(
    *views: ViewSpec, sizes: dict[str, int] | None = None, tp_size: int = 1
) -> WorkerGeometry:
    """A geometry whose allocations (default: just big enough) hold ``views``."""
    ends: dict[str, int] = dict(sizes or {})
    if sizes is None:
        for v in views:
            end = v.offset_bytes + (v.num_blocks - 1) * v.block_stride_bytes + v.block_len_bytes
            ends[v.allocation_id] = max(ends.get(v.allocation_id, 1), end)
    return WorkerGeometry(
        worker=WorkerKey("engine"),
        kv_cache_layout="BLHNC",
        block_size_tokens=16,
        allocations=tuple(AllocationSpec(a, size) for a, size in ends.items()),
        views=views,
        tp_size=tp_size,
    )


@st.composite
def _row_section(
    draw: st.DrawFn, allocation: str, start: int, names: list[str]
) -> tuple[list[ViewSpec], int]:
    """Views side by side in one stride; returns them and the section's end."""
    blocks = draw(st.integers(1, 5))
    pos = 0
    segments: list[tuple[int, int]] = []
    for _ in range(draw(st.integers(1, 5))):
        pos += draw(st.sampled_from([0, 0, 0, 1, 3]))  # mostly adjacent
        length = draw(st.integers(1, 6))
        segments.append((pos, length))
        pos += length
    stride = pos + draw(st.sampled_from([0, 0, 2]))
    views: list[ViewSpec] = []
    for offset, length in segments:
        # A sub-range of the blocks keeps the views disjoint but unmergeable.
        count = draw(st.integers(1, blocks)) if draw(st.booleans()) else blocks
        for _ in range(draw(st.sampled_from([1, 1, 1, 2]))):  # sometimes aliased
            names.append(f"layer{len(names)}")
            views.append(
                view(
                    names[-1],
                    start + offset,
                    length,
                    stride,
                    count,
                    kind=draw(st.sampled_from(KINDS)),
                    group=draw(st.sampled_from([0, 0, 0, 1])),
                    allocation=allocation,
                )
            )
    return views, start + (blocks - 1) * stride + stride


@st.composite
def _single_view(
    draw: st.DrawFn, allocation: str, start: int, names: list[str]
) -> tuple[list[ViewSpec], int]:
    length = draw(st.integers(1, 6))
    stride = length + draw(st.sampled_from([0, 0, 3]))
    blocks = draw(st.integers(1, 5))
    names.append(f"layer{len(names)}")
    kind = draw(st.sampled_from(KINDS))
    v = view(names[-1], start, length, stride, blocks, kind=kind, allocation=allocation)
    return [v], start + (blocks - 1) * stride + length


@st.composite
def geometries(draw: st.DrawFn, max_allocations: int = 3) -> WorkerGeometry:
    names: list[str] = []
    allocations: list[AllocationSpec] = []
    views: list[ViewSpec] = []
    for a in range(draw(st.integers(1, max_allocations))):
        allocation_id = f"alloc{a}"
        end = draw(st.integers(0, 3))
        for _ in range(draw(st.integers(1, 3))):
            section = draw(st.sampled_from([_row_section, _single_view]))
            new_views, end = draw(section(allocation_id, end, names))
            views += new_views
            end += draw(st.sampled_from([0, 0, 2]))
        device = DeviceRef(draw(st.sampled_from(list(DeviceKind))))
        allocations.append(AllocationSpec(allocation_id, end + draw(st.integers(0, 5)), device))
    # Registration order is the worker's business: planners must not care.
    ordered = draw(st.permutations(views))
    return WorkerGeometry(
        worker=WorkerKey("engine", tp_rank=0),
        kv_cache_layout="BLHNC",
        block_size_tokens=16,
        allocations=tuple(allocations),
        views=tuple(ordered),
    )
