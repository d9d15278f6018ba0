"""validate_geometry: one test per rule, asserting the exact field path."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import replace
from types import FrameType
from typing import Any

import pytest
from geometry_strategies import geometries, geometry, view
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from kvmap.core import validation
from kvmap.core.errors import InvalidArgument
from kvmap.core.geometry import (
    AllocationSpec,
    DeviceRef,
    ViewSpec,
    WorkerGeometry,
    WorkerKey,
)
from kvmap.core.validation import (
    MAX_ALLOCATIONS,
    MAX_BLOCKS,
    MAX_CROSS_STRIDE_PAIRS,
    MAX_DESCRIPTORS,
    MAX_VIEWS,
    find_shared_byte,
    validate_geometry,
)

VALID = geometry(
    view("l0", 0, 100, 200, 4),
    view("l1", 100, 100, 200, 4),
    view("i0", 0, 50, 50, 4, allocation="idx", group=1),
)


def _error(g: WorkerGeometry) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as err:
        validate_geometry(g)
    return err.value


def _with_view(index: int, **changes: object) -> WorkerGeometry:
    views = list(VALID.views)
    views[index] = replace(views[index], **changes)  # type: ignore[arg-type]
    return replace(VALID, views=tuple(views))


def _with_allocation(index: int, **changes: object) -> WorkerGeometry:
    allocations = list(VALID.allocations)
    allocations[index] = replace(allocations[index], **changes)  # type: ignore[arg-type]
    return replace(VALID, allocations=tuple(allocations))


def test_the_reference_geometry_is_valid() -> None:
    """The reference geometry the rule cases are derived from passes validation, so each rule case
    fails for its one change only."""
    validate_geometry(VALID)


RULES = [
    (replace(VALID, worker=WorkerKey("")), "worker.engine_id", "must not be empty"),
    (replace(VALID, block_size_tokens=0), "block_size_tokens", "must be > 0 (got 0)"),
    (replace(VALID, tp_size=0), "tp_size", "must be > 0 (got 0)"),
    (
        replace(VALID, worker=WorkerKey("e", tp_rank=2), tp_size=2),
        "worker.tp_rank",
        "must be < tp_size (2 >= 2)",
    ),
    (replace(VALID, worker=WorkerKey("e", dp_rank=-1)), "worker.dp_rank", "must be >= 0 (got -1)"),
    (replace(VALID, allocations=()), "allocations", "must not be empty"),
    (replace(VALID, views=()), "views", "must not be empty"),
    (_with_allocation(1, id=""), "allocations[1].id", "must not be empty"),
    (
        _with_allocation(1, id="kv"),
        "allocations[1].id",
        "duplicate allocation id 'kv' (also allocations[0].id)",
    ),
    (_with_allocation(0, size_bytes=0), "allocations[0].size_bytes", "must be > 0 (got 0)"),
    (
        _with_allocation(0, size_bytes=2**62 + 1),
        "allocations[0].size_bytes",
        f"must be <= 2**62 (got {2**62 + 1})",
    ),
    (
        _with_allocation(0, device=DeviceRef(index=-1)),
        "allocations[0].device.index",
        "must be >= 0 (got -1)",
    ),
    (_with_view(2, layer_name=""), "views[2].layer_name", "must not be empty"),
    (
        _with_view(2, layer_name="l0"),
        "views[2].layer_name",
        "duplicate layer name 'l0' (also views[0].layer_name)",
    ),
    (
        _with_view(1, allocation_id="nope"),
        "views[1].allocation_id",
        "unknown allocation 'nope' (known: 'kv', 'idx')",
    ),
    (_with_view(1, transfer_group=-1), "views[1].transfer_group", "must be >= 0 (got -1)"),
    (_with_view(1, offset_bytes=-1), "views[1].offset_bytes", "must be >= 0 (got -1)"),
    (_with_view(1, block_len_bytes=0), "views[1].block_len_bytes", "must be > 0 (got 0)"),
    (
        _with_view(1, block_len_bytes=4096, block_stride_bytes=2048),
        "views[1].block_stride_bytes",
        "must be >= block_len_bytes (4096 > 2048)",
    ),
    (_with_view(1, num_blocks=0), "views[1].num_blocks", "must be > 0 (got 0)"),
    (
        _with_view(1, offset_bytes=2**62 + 1),
        "views[1].offset_bytes",
        f"must be <= 2**62 (got {2**62 + 1})",
    ),
    (
        _with_view(1, num_blocks=MAX_BLOCKS + 1),
        "views[1].num_blocks",
        f"too many blocks ({MAX_BLOCKS + 1} > MAX_BLOCKS = {MAX_BLOCKS})",
    ),
    (
        _with_view(1, num_blocks=5),
        "views[1]",
        "does not fit in allocation 'kv': its last block ends at byte 1000 > size_bytes 800",
    ),
]


@pytest.mark.parametrize(("g", "field", "problem"), RULES, ids=[field for _, field, _ in RULES])
def test_each_rule_names_its_field(g: WorkerGeometry, field: str, problem: str) -> None:
    """Each single-rule violation (empty ids, non-positive sizes, bad ranks, duplicates, unknown
    allocation, stride < length, limits, overrun) is INVALID_ARGUMENT with the exact field path
    and problem text."""
    err = _error(g)
    assert (err.field, err.problem) == (field, problem)
    assert str(err) == f"{field}: {problem}"


def test_too_many_allocations_and_views_name_the_limit() -> None:
    """More than MAX_ALLOCATIONS allocations or MAX_VIEWS views is INVALID_ARGUMENT on "allocations"
    / "views" naming the limit and its value."""
    allocations = tuple(AllocationSpec(f"a{i}", 10) for i in range(MAX_ALLOCATIONS + 1))
    err = _error(replace(VALID, allocations=allocations))
    assert err.field == "allocations" and "MAX_ALLOCATIONS = 1024" in err.problem
    views = tuple(view(f"l{i}", 0, 1, 1, 1) for i in range(MAX_VIEWS + 1))
    err = _error(replace(VALID, views=views))
    assert err.field == "views" and "MAX_VIEWS = 16384" in err.problem


def test_too_many_descriptors_in_total_names_the_limit() -> None:
    """Views whose block counts add up past MAX_DESCRIPTORS are INVALID_ARGUMENT on "views", giving
    the total and the limit."""
    count = MAX_DESCRIPTORS // MAX_BLOCKS + 1
    views = [view(f"l{i}", i, 1, count, MAX_BLOCKS) for i in range(count)]
    err = _error(geometry(*views))
    assert err.field == "views"
    assert err.problem.startswith(f"too many descriptors in total ({count * MAX_BLOCKS} >")
    assert "MAX_DESCRIPTORS" in err.problem


def test_overlapping_views_are_rejected_naming_both() -> None:
    """Two views that share bytes without being identical are INVALID_ARGUMENT on the later view,
    naming the earlier one, the allocation and the first shared byte; a differing block count
    alone counts as overlap."""
    err = _error(geometry(view("a", 0, 100, 200), view("b", 50, 100, 200)))
    assert err.field == "views[1]"
    assert err.problem == (
        "overlaps views[0] ('a') in allocation 'kv' at byte 50 without being identical to it"
    )
    # Same bytes in block 0 only with a different block count is still an overlap.
    assert _error(geometry(view("a", 0, 100, 200, 4), view("b", 0, 100, 200, 3))).field


def test_aliased_and_interleaved_views_are_accepted() -> None:
    """Identical views (aliases in different groups) and views with different strides that
    interleave without sharing a byte are both valid."""
    validate_geometry(geometry(view("a", 0, 100, 200), view("b", 0, 100, 200, group=1)))
    # Different strides that interleave without sharing a byte: even / odd bytes.
    validate_geometry(geometry(view("even", 0, 1, 4, 8), view("odd", 1, 1, 6, 6)))


def _interleaved(count: int) -> list[ViewSpec]:
    """``count`` one-byte views at offsets 0..count-1 of two even strides: odd
    offsets never meet even ones, but every pair of different strides whose
    extents meet has to be checked."""
    return [view(f"l{r}", r, 1, 4096 if r % 2 else 6144, 4) for r in range(count)]


def _pair_checks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[ViewSpec, ViewSpec]]:
    """Every pair the validator hands to ``find_shared_byte`` from now on."""
    pairs: list[tuple[ViewSpec, ViewSpec]] = []

    def counted(a: ViewSpec, b: ViewSpec) -> int | None:
        pairs.append((a, b))
        return find_shared_byte(a, b)

    monkeypatch.setattr(validation, "find_shared_byte", counted)
    return pairs


def test_cross_stride_pairs_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Interleaved views with different strides are accepted up to a point; past
    MAX_CROSS_STRIDE_PAIRS they are INVALID_ARGUMENT naming that limit, and the pairs
    compared stay within the limit however many more the geometry would need."""
    pairs = _pair_checks(monkeypatch)
    validate_geometry(geometry(*_interleaved(64)))
    assert pairs, "the interleaved views were never compared pair by pair"
    per_stride = math.isqrt(MAX_CROSS_STRIDE_PAIRS) + 1
    for count in (2 * per_stride, 8 * per_stride):
        pairs.clear()
        err = _error(geometry(*_interleaved(count)))
        assert err.field == "views" and "MAX_CROSS_STRIDE_PAIRS" in err.problem
        # Every view of one stride meets every view of the other: (count / 2)^2
        # pairs, all over the limit, of which only the limit's worth is compared.
        assert (count // 2) ** 2 > MAX_CROSS_STRIDE_PAIRS
        assert len(pairs) <= MAX_CROSS_STRIDE_PAIRS


def _lines_run(fn: Callable[[], object]) -> int:
    """Python lines executed by ``fn()`` and everything it calls: a count of
    the work done that does not depend on the machine's speed or load."""
    lines = 0

    def local(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal lines
        lines += event == "line"
        return local

    def calls(frame: FrameType, event: str, arg: object) -> Any:
        return local

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        fn()
    finally:
        sys.settrace(previous)
    return lines


def test_many_block_outermost_views_validate_in_near_linear_work() -> None:
    """MAX_VIEWS block-outermost views (one shared stride) are valid, and validating them
    executes less than twice the lines per view that a quarter as many views take: no
    pairwise comparison, which would take four times as many per view."""

    def block_outermost(count: int) -> WorkerGeometry:
        return geometry(*(view(f"l{i}", i * 8, 8, 8 * count, 32) for i in range(count)))

    small, large = block_outermost(MAX_VIEWS // 4), block_outermost(MAX_VIEWS)
    small_lines = _lines_run(lambda: validate_geometry(small))
    large_lines = _lines_run(lambda: validate_geometry(large))
    assert small_lines > MAX_VIEWS // 4  # the counter sees the validator's work
    # Linear work grows 4x with 4x the views and n log n about 4.7x; every pair
    # compared would grow it 16x.
    assert large_lines < 2 * 4 * small_lines, (small_lines, large_lines)


# Properties ----------------------------------------------------------------


@settings(max_examples=examples(200), deadline=None)
@given(geometries())
def test_random_valid_geometries_pass(g: WorkerGeometry) -> None:
    """Every geometry from the valid-geometry strategy passes validation (no false rejections)."""
    validate_geometry(g)


def _bytes(v: ViewSpec) -> set[int]:
    return {
        v.offset_bytes + b * v.block_stride_bytes + k
        for b in range(v.num_blocks)
        for k in range(v.block_len_bytes)
    }


@st.composite
def _small_views(draw: st.DrawFn, name: str) -> ViewSpec:
    stride = draw(st.integers(1, 24))
    length = draw(st.integers(1, stride))
    return view(name, draw(st.integers(0, 40)), length, stride, draw(st.integers(1, 6)))


@settings(max_examples=examples(400), deadline=None)
@given(_small_views("a"), _small_views("b"))
def test_find_shared_byte_is_exact(a: ViewSpec, b: ViewSpec) -> None:
    """For random small strided views, find_shared_byte returns a byte both views cover exactly when
    they share one, and None otherwise."""
    shared = _bytes(a) & _bytes(b)
    found = find_shared_byte(a, b)
    assert (found is not None) == bool(shared)
    assert found is None or found in shared


@st.composite
def _random_views(draw: st.DrawFn) -> list[ViewSpec]:
    return [draw(_small_views(f"l{i}")) for i in range(draw(st.integers(2, 8)))]


@st.composite
def _interleaved_views(draw: st.DrawFn) -> list[ViewSpec]:
    """Views on separate byte lanes modulo a common period, with strides that
    are multiples of it: they interleave, mostly without clashing. Nudging one
    view by a byte makes near misses."""
    period = draw(st.integers(2, 8))
    lanes = sorted(draw(st.sets(st.integers(1, period - 1), max_size=3)))
    views: list[ViewSpec] = []
    for start, end in zip([0, *lanes], [*lanes, period], strict=True):
        for _ in range(draw(st.integers(1, 3))):
            offset = start + period * draw(st.integers(0, 6))
            stride = period * draw(st.integers(1, 4))
            blocks = draw(st.integers(1, 5))
            views.append(view(f"l{len(views)}", offset, end - start, stride, blocks))
    if draw(st.booleans()):
        i = draw(st.integers(0, len(views) - 1))
        nudged = max(0, views[i].offset_bytes + draw(st.sampled_from([-1, 1])))
        views[i] = replace(views[i], offset_bytes=nudged)
    return views


@settings(max_examples=examples(400), deadline=None)
@given(st.one_of(_random_views(), _interleaved_views()))
def test_overlap_check_matches_brute_force(views: list[ViewSpec]) -> None:
    """For random and interleaved view sets, validation rejects exactly the sets where two non-
    identical views share a byte (by brute force), and the two views it names do share one."""
    footprints = [
        (v.offset_bytes, v.block_len_bytes, v.block_stride_bytes, v.num_blocks) for v in views
    ]
    clash = any(
        footprints[i] != footprints[j] and _bytes(views[i]) & _bytes(views[j])
        for i in range(len(views))
        for j in range(i)
    )
    g = geometry(*views)
    if not clash:
        validate_geometry(g)
        return
    err = _error(g)
    assert "overlaps" in err.problem
    second = int(err.field.removeprefix("views[").removesuffix("]"))
    first = int(err.problem.split("views[")[1].split("]")[0])
    assert _bytes(views[first]) & _bytes(views[second])
