"""The planners: properties over random valid geometries, then named layouts."""

from __future__ import annotations

from collections import Counter
from importlib import resources
from pathlib import Path

import pytest
from geometry_strategies import geometries, geometry, view
from hypothesis import given, settings
from hypothesis_profiles import examples

from kvmap.core import convert
from kvmap.core.errors import InvalidArgument
from kvmap.core.geometry import CacheKind, Plan, Region, ViewSpec, WorkerGeometry
from kvmap.core.planner import (
    BASELINE,
    COALESCE,
    DEFAULT_PLANNER,
    PLANNERS,
    Planner,
    get_planner,
)
from kvmap.core.validation import validate_geometry

EXAMPLES = Path(str(resources.files("kvmap.daemon.examples")))
PLANS: list[Planner] = [BASELINE, COALESCE]


def _coalesce(g: WorkerGeometry) -> Plan:
    validate_geometry(g)  # named layouts must be legal ones
    return COALESCE.plan(g)


def _block_bytes(offset: int, length: int, stride: int, block: int) -> range:
    start = offset + block * stride
    return range(start, start + length)


def _region_of(plan: Plan) -> dict[str, tuple[Region, int]]:
    """layer name -> (its region, its offset in the region); every layer once."""
    seen = Counter(name for r in plan.regions for name in r.layer_names)
    assert all(n == 1 for n in seen.values()), seen
    return {p.layer_name: (r, p.offset_in_region) for r in plan.regions for p in r.layers}


# Properties ----------------------------------------------------------------


@settings(max_examples=examples(150), deadline=None)
@given(geometries())
def test_every_view_block_is_covered_exactly_once_by_the_same_bytes(g: WorkerGeometry) -> None:
    """In both plans every layer sits in exactly one region of its own allocation and group, and
    each of its blocks is, byte for byte, the same span of memory as the view's block."""
    validate_geometry(g)  # the strategy only draws valid geometries
    for plan in (BASELINE.plan(g), COALESCE.plan(g)):
        where = _region_of(plan)
        assert set(where) == {v.layer_name for v in g.views}
        for v in g.views:
            region, offset_in_region = where[v.layer_name]
            assert (region.allocation_id, region.transfer_group) == (
                v.allocation_id,
                v.transfer_group,
            )
            assert region.num_blocks == v.num_blocks
            for b in range(v.num_blocks):
                region_block = _block_bytes(
                    region.offset_bytes, region.block_len_bytes, region.block_stride_bytes, b
                )
                in_region = region_block[offset_in_region : offset_in_region + v.block_len_bytes]
                assert in_region == _block_bytes(
                    v.offset_bytes, v.block_len_bytes, v.block_stride_bytes, b
                )


@settings(max_examples=examples(150), deadline=None)
@given(geometries())
def test_regions_hold_only_view_bytes_and_stay_inside_their_allocation(g: WorkerGeometry) -> None:
    """A region's layers tile its block with no gap or overlap (aliases at one offset), the block
    fits its stride, and the last block ends inside the allocation."""
    for plan in (BASELINE.plan(g), COALESCE.plan(g)):
        for r in plan.regions:
            # The layers tile the region's block: no gap, no overlap (aliases
            # sit at the same offset with the same length).
            spans = sorted({(p.offset_in_region, p.len_bytes) for p in r.layers})
            pos = 0
            for offset, length in spans:
                assert offset == pos
                pos += length
            assert pos == r.block_len_bytes <= r.block_stride_bytes
            end = r.offset_bytes + (r.num_blocks - 1) * r.block_stride_bytes + r.block_len_bytes
            assert end <= g.allocation(r.allocation_id).size_bytes


@settings(max_examples=examples(150), deadline=None)
@given(geometries())
def test_ids_order_and_counts(g: WorkerGeometry) -> None:
    """Region ids number the regions in (group, allocation, offset) order; the
    baseline plan is one region per distinct view footprint (aliases share
    one), as computed here from the geometry, and its descriptor count, one per
    block of each such region, is what both plans report as the baseline;
    coalescing never needs more regions or descriptors."""
    baseline, coalesced = BASELINE.plan(g), COALESCE.plan(g)
    footprints = {
        (
            v.transfer_group,
            v.allocation_id,
            v.offset_bytes,
            v.block_len_bytes,
            v.block_stride_bytes,
            v.num_blocks,
        )
        for v in g.views
    }
    expected_descriptors = sum(num_blocks for *_, num_blocks in footprints)
    for plan in (baseline, coalesced):
        assert [r.id for r in plan.regions] == list(range(len(plan.regions)))
        keys = [(r.transfer_group, r.allocation_id, r.offset_bytes) for r in plan.regions]
        assert keys == sorted(keys)
        assert plan.baseline_descriptor_count == expected_descriptors
    assert {
        (
            r.transfer_group,
            r.allocation_id,
            r.offset_bytes,
            r.block_len_bytes,
            r.block_stride_bytes,
            r.num_blocks,
        )
        for r in baseline.regions
    } == footprints
    assert len(baseline.regions) == len(footprints)
    assert baseline.descriptor_count == expected_descriptors
    assert len(coalesced.regions) <= len(baseline.regions)
    assert coalesced.descriptor_count <= expected_descriptors


@settings(max_examples=examples(150), deadline=None)
@given(geometries())
def test_coalesced_runs_are_eligible_and_maximal(g: WorkerGeometry) -> None:
    """Coalesced regions hold only replicated kinds (MLA, INDEXER) or are single-offset fallbacks
    with a reason, and no two eligible regions could still be merged."""
    regions = COALESCE.plan(g).regions
    for r in regions:
        kinds = {p.cache_kind for p in r.layers}
        if r.fallback_reason:
            assert not all(k.replicated for k in kinds)
            assert {p.offset_in_region for p in r.layers} == {0}
        else:
            assert all(k.replicated for k in kinds)
    eligible = [r for r in regions if not r.fallback_reason]
    for a in eligible:
        for b in eligible:
            same_set = (a.transfer_group, a.allocation_id, a.block_stride_bytes, a.num_blocks) == (
                b.transfer_group,
                b.allocation_id,
                b.block_stride_bytes,
                b.num_blocks,
            )
            mergeable = (
                same_set
                and a.offset_bytes + a.block_len_bytes == b.offset_bytes
                and a.block_len_bytes + b.block_len_bytes <= a.block_stride_bytes
            )
            assert not mergeable, (a, b)


@settings(max_examples=examples(100), deadline=None)
@given(geometries())
def test_plans_do_not_depend_on_registration_order(g: WorkerGeometry) -> None:
    """Both planners produce the same regions whatever order the views were registered in."""
    reversed_g = WorkerGeometry(
        g.worker, g.kv_cache_layout, g.block_size_tokens, g.allocations, g.views[::-1]
    )

    def canonical(plan: Plan) -> list[tuple[object, ...]]:
        return [
            (r.offset_bytes, r.allocation_id, r.block_len_bytes, sorted(r.layer_names))
            for r in plan.regions
        ]

    for planner in PLANS:
        assert canonical(planner.plan(g)) == canonical(planner.plan(reversed_g))


# Named layouts ---------------------------------------------------------------


def test_blhnc_mla_row_coalesces_to_one_full_row_region() -> None:
    """Four adjacent MLA layers filling a block-outermost row become one full-row region with the
    layers at their offsets: 8 descriptors instead of 32."""
    g = geometry(*(view(f"l{i}", i * 100, 100, 400, 8) for i in range(4)))
    plan = _coalesce(g)
    (region,) = plan.regions
    assert region.full_row and region.block_len_bytes == 400 and region.fallback_reason == ""
    assert [(p.layer_name, p.offset_in_region) for p in region.layers] == [
        ("l0", 0),
        ("l1", 100),
        ("l2", 200),
        ("l3", 300),
    ]
    assert (plan.descriptor_count, plan.baseline_descriptor_count) == (8, 32)


def test_a_gap_splits_a_run() -> None:
    """A gap between layers splits a run into two regions, both eligible."""
    g = geometry(view("l0", 0, 100, 500), view("l1", 100, 100, 500), view("l2", 300, 100, 500))
    regions = _coalesce(g).regions
    assert [r.layer_names for r in regions] == [("l0", "l1"), ("l2",)]
    assert [r.fallback_reason for r in regions] == ["", ""]  # eligible, alone


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (view("l0", 0, 100, 200, 2), view("l1", 100, 100, 400, 2)),
        (view("l0", 0, 100, 200, 4), view("l1", 100, 100, 200, 3)),
    ],
    ids=["stride", "block-count"],
)
def test_stride_or_block_count_mismatch_does_not_merge(first: ViewSpec, second: ViewSpec) -> None:
    """Adjacent views with a different stride or block count stay separate regions."""
    regions = _coalesce(geometry(first, second)).regions
    assert [r.layer_names for r in regions] == [("l0",), ("l1",)]
    assert [r.fallback_reason for r in regions] == ["", ""]


def test_different_transfer_groups_never_merge() -> None:
    """Adjacent views of different transfer groups stay separate regions."""
    g = geometry(view("l0", 0, 100, 200, group=0), view("l1", 100, 100, 200, group=1))
    regions = _coalesce(g).regions
    assert [(r.transfer_group, r.layer_names) for r in regions] == [(0, ("l0",)), (1, ("l1",))]


def test_layer_outermost_mha_keeps_one_region_per_layer_with_a_reason() -> None:
    """MHA (split by heads across TP ranks) and MAMBA views keep one region each, with the reason
    they were not coalesced."""
    views = [
        view(f"l{i}.{kv}", (2 * i + j) * 400, 100, 100, 4, kind=CacheKind.MHA)
        for i in range(3)
        for j, kv in enumerate("kv")
    ]
    regions = _coalesce(geometry(*views)).regions
    assert [r.layer_names for r in regions] == [(v.layer_name,) for v in views]
    assert {r.fallback_reason for r in regions} == {
        "cache kind MHA is split by heads across tensor-parallel ranks"
    }
    mamba = _coalesce(geometry(view("m", 0, 100, 100, kind=CacheKind.MAMBA))).regions
    assert "MAMBA" in mamba[0].fallback_reason


def test_aliased_views_share_a_region_at_the_same_offset() -> None:
    """Two views of the same bytes land in the same region at the same offset,
    under both planners."""
    g = geometry(view("l0", 0, 100, 300), view("l1", 100, 100, 300), view("l1b", 100, 100, 300))
    for planner, expected in ((BASELINE, 2), (COALESCE, 1)):
        validate_geometry(g)
        regions = planner.plan(g).regions
        assert len(regions) == expected
        placements = {p.layer_name: p for r in regions for p in r.layers}
        where = {name: next(r for r in regions if name in r.layer_names) for name in placements}
        assert where["l1"] is where["l1b"]
        assert placements["l1"].offset_in_region == placements["l1b"].offset_in_region


def test_mla_and_indexer_adjacent_share_a_region() -> None:
    """Adjacent MLA and INDEXER pages of one row coalesce into one region, each keeping its cache
    kind."""
    g = geometry(view("mla", 0, 100, 150), view("idx", 100, 50, 150, kind=CacheKind.INDEXER))
    (region,) = _coalesce(g).regions
    assert [(p.layer_name, p.cache_kind) for p in region.layers] == [
        ("mla", CacheKind.MLA),
        ("idx", CacheKind.INDEXER),
    ]


def test_region_ids_follow_group_allocation_offset() -> None:
    """Region ids follow (transfer group, allocation, offset) order, not registration order."""
    g = geometry(
        view("b", 0, 10, 10, allocation="b"),
        view("a1", 50, 10, 10, allocation="a"),
        view("a0", 0, 10, 10, allocation="a"),
        view("g1", 100, 10, 10, group=1, allocation="a"),
    )
    regions = _coalesce(g).regions
    assert [(r.id, r.layer_names) for r in regions] == [
        (0, ("a0",)),
        (1, ("a1",)),
        (2, ("b",)),
        (3, ("g1",)),
    ]


def test_full_scale_glm53_rank() -> None:
    """The bundled GLM-5.3 rank: baseline 101 regions / 3,234,222 descriptors, coalesce 2 full-row
    regions / 64,044 descriptors, with 78 and 23 layers."""
    g = convert.geometry_from_json((EXAMPLES / "glm53-rank.json").read_text())
    validate_geometry(g)
    baseline, coalesced = BASELINE.plan(g), _coalesce(g)
    assert (len(baseline.regions), baseline.descriptor_count) == (101, 3_234_222)
    assert (len(coalesced.regions), coalesced.descriptor_count) == (2, 64_044)
    assert coalesced.baseline_descriptor_count == 3_234_222
    assert all(r.full_row for r in coalesced.regions)
    assert [len(r.layers) for r in coalesced.regions] == [78, 23]


def test_registry() -> None:
    """The planner registry: coalesce is the default, both planners are known by name, and an
    unknown one is an InvalidArgument listing the known ones."""
    assert DEFAULT_PLANNER == "coalesce"
    assert sorted(PLANNERS) == ["baseline", "coalesce"]
    assert get_planner("baseline") is BASELINE
    assert get_planner("coalesce").info.version >= 1
    with pytest.raises(InvalidArgument) as err:
        get_planner("x")
    assert err.value.field == "planner"
    assert str(err.value) == "planner: unknown planner 'x' (known: baseline, coalesce)"
