"""Planners: a worker's views -> the regions the daemon registers with NIXL.

Pure functions of a ``WorkerGeometry`` (already checked by
``validation.validate_geometry``); no I/O. Every planner is named and
versioned so that a region map says which rules produced it, and bumping a
planner's version is how a behaviour change becomes visible to peers.

- ``baseline`` is what vLLM does today: one region per layer view, except
  that views describing exactly the same bytes (aliased layers) share one.
- ``coalesce`` applies the coalescing rules (docs/architecture.md): adjacent views of
  replicated cache kinds that agree on group, allocation, device, stride and
  block count become one wider region, so one descriptor per block covers
  many layers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from kvmap.core.errors import InvalidArgument
from kvmap.core.geometry import (
    CacheKind,
    DeviceRef,
    LayerPlacement,
    Plan,
    PlannerInfo,
    Region,
    ViewSpec,
    WorkerGeometry,
)


class Planner(Protocol):
    @property
    def info(self) -> PlannerInfo: ...

    def plan(self, geometry: WorkerGeometry) -> Plan: ...


@dataclass(frozen=True)
class _AliasClass:
    """Views that describe exactly the same bytes; they always share a region."""

    transfer_group: int
    allocation_id: str
    offset_bytes: int
    block_len_bytes: int
    block_stride_bytes: int
    num_blocks: int
    views: tuple[ViewSpec, ...]

    @property
    def end_of_block(self) -> int:
        return self.offset_bytes + self.block_len_bytes


def _alias_classes(views: Iterable[ViewSpec]) -> list[_AliasClass]:
    """Group identical views, keeping the order of first appearance."""
    members: dict[tuple[int, str, int, int, int, int], list[ViewSpec]] = {}
    for v in views:
        # The transfer group is part of the key: a region belongs to one group,
        # and peers match regions group by group.
        key = (
            v.transfer_group,
            v.allocation_id,
            v.offset_bytes,
            v.block_len_bytes,
            v.block_stride_bytes,
            v.num_blocks,
        )
        members.setdefault(key, []).append(v)
    return [_AliasClass(*key, views=tuple(vs)) for key, vs in members.items()]


def _region(run: Sequence[_AliasClass], fallback_reason: str) -> Region:
    """One region (id assigned later) covering a run of adjacent alias classes."""
    first = run[0]
    placements = tuple(
        LayerPlacement(
            layer_name=v.layer_name,
            offset_in_region=cls.offset_bytes - first.offset_bytes,
            len_bytes=v.block_len_bytes,
            cache_kind=v.cache_kind,
            dtype=v.dtype,
        )
        for cls in run
        for v in cls.views
    )
    return Region(
        id=-1,  # numbered once all regions are known: ids follow the sorted order
        allocation_id=first.allocation_id,
        transfer_group=first.transfer_group,
        offset_bytes=first.offset_bytes,
        block_len_bytes=run[-1].end_of_block - first.offset_bytes,
        block_stride_bytes=first.block_stride_bytes,
        num_blocks=first.num_blocks,
        layers=placements,
        fallback_reason=fallback_reason,
    )


def _numbered(regions: Iterable[Region]) -> tuple[Region, ...]:
    """Regions in the documented order, with ids 0..n-1 in that order."""

    def order(r: Region) -> tuple[int, str, int, int, int, int, str]:
        # The tail of the key only breaks ties that a validated geometry
        # cannot produce; it keeps the order total for any input.
        first_layer = r.layers[0].layer_name if r.layers else ""
        return (
            r.transfer_group,
            r.allocation_id,
            r.offset_bytes,
            r.block_len_bytes,
            r.block_stride_bytes,
            r.num_blocks,
            first_layer,
        )

    return tuple(replace(r, id=i) for i, r in enumerate(sorted(regions, key=order)))


def _ineligibility(kinds: Iterable[CacheKind]) -> str:
    """Why views of these kinds cannot join a wider region; "" if they can."""
    for kind in kinds:
        if kind is CacheKind.MHA:
            return "cache kind MHA is split by heads across tensor-parallel ranks"
        if not kind.replicated:
            return (
                f"cache kind {kind.name} is not eligible for coalescing "
                "(only MLA and INDEXER pages are replicated and never split by heads)"
            )
    return ""


# Bump a version whenever the planner's output for some geometry changes:
# peers and operators see it in every region map.
BASELINE_INFO = PlannerInfo(name="baseline", version=1)
COALESCE_INFO = PlannerInfo(name="coalesce", version=1)


@dataclass(frozen=True)
class BaselinePlanner:
    """vLLM's per-layer registration: one region per (de-aliased) view."""

    info: PlannerInfo = BASELINE_INFO

    def plan(self, geometry: WorkerGeometry) -> Plan:
        regions = _numbered(
            _region([cls], "baseline planner: one region per view")
            for cls in _alias_classes(geometry.views)
        )
        return Plan(
            planner=self.info,
            regions=regions,
            baseline_descriptor_count=sum(r.descriptor_count for r in regions),
        )


@dataclass(frozen=True)
class CoalescePlanner:
    """The coalescing rules: maximal runs of adjacent eligible views."""

    info: PlannerInfo = COALESCE_INFO

    def plan(self, geometry: WorkerGeometry) -> Plan:
        devices = {a.id: a.device for a in geometry.allocations}
        candidates: dict[tuple[int, str, DeviceRef, int, int], list[_AliasClass]] = {}
        regions: list[Region] = []
        for cls in _alias_classes(geometry.views):
            reason = _ineligibility(v.cache_kind for v in cls.views)
            if reason:
                regions.append(_region([cls], reason))
                continue
            # The allocation fixes the device already; it is in the key anyway
            # because the rule is about memory type, not about allocation ids.
            key = (
                cls.transfer_group,
                cls.allocation_id,
                devices.get(cls.allocation_id, DeviceRef()),
                cls.block_stride_bytes,
                cls.num_blocks,
            )
            candidates.setdefault(key, []).append(cls)
        for members in candidates.values():
            regions.extend(_region(run, "") for run in _adjacent_runs(members))
        return Plan(
            planner=self.info,
            regions=_numbered(regions),
            baseline_descriptor_count=BASELINE.plan(geometry).descriptor_count,
        )


def _adjacent_runs(members: Sequence[_AliasClass]) -> list[list[_AliasClass]]:
    """Split same-stride classes, sorted by offset, into maximal adjacent runs."""
    runs: list[list[_AliasClass]] = []
    for cls in sorted(members, key=lambda c: (c.offset_bytes, c.block_len_bytes)):
        if runs:
            run = runs[-1]
            run_len = run[-1].end_of_block - run[0].offset_bytes
            # A run never grows past its stride, so a region's blocks never
            # overlap each other. Validated views only reach this limit when
            # they have a single block (with more they would overlap).
            if (
                cls.offset_bytes == run[-1].end_of_block
                and run_len + cls.block_len_bytes <= cls.block_stride_bytes
            ):
                run.append(cls)
                continue
        runs.append([cls])
    return runs


BASELINE = BaselinePlanner()
COALESCE = CoalescePlanner()

PLANNERS: Mapping[str, Planner] = {p.info.name: p for p in (BASELINE, COALESCE)}
DEFAULT_PLANNER = "coalesce"


def get_planner(name: str) -> Planner:
    try:
        return PLANNERS[name]
    except KeyError:
        known = ", ".join(sorted(PLANNERS))
        raise InvalidArgument("planner", f"unknown planner {name!r} (known: {known})") from None
