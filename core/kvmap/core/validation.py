"""Checks that a worker geometry is well formed before anything is planned.

``validate_geometry`` raises ``InvalidArgument`` naming the offending field
with the path of the wire message (``views[17].block_stride_bytes``), so the
caller can act on it. Pure: no I/O.

The overlap rule is checked exactly, not by comparing extents: two views of
one allocation may interleave (block-outermost layouts do exactly that) as
long as no byte belongs to both, unless the two views are identical (aliased
layers that share their cache).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvmap.core.errors import InvalidArgument
from kvmap.core.geometry import AllocationSpec, ViewSpec, WorkerGeometry

MAX_VIEWS = 16384
MAX_ALLOCATIONS = 1024
# Blocks of one view, and descriptors of a whole worker under the baseline
# planner (sum of num_blocks): what the daemon may have to hold in memory.
MAX_BLOCKS = 1 << 24
MAX_DESCRIPTORS = 1 << 25
# Every size, offset and count; leaves headroom below int64 for sums.
MAX_VALUE = 1 << 62
# Views of different strides whose extents meet are compared pair by pair
# (O(log stride) each, ~20 us at worst); this bounds the work a pathological
# geometry can cause to about a second. Real layouts have a handful of pairs.
MAX_CROSS_STRIDE_PAIRS = 1 << 16


def validate_geometry(g: WorkerGeometry) -> None:
    _check_header(g)
    _check_allocations(g.allocations)
    _check_views(g.views, {a.id: a for a in g.allocations})
    _check_overlaps(g.views)


def _check_int(field: str, value: int, minimum: int) -> None:
    if value < minimum:
        relation = "> 0" if minimum == 1 else f">= {minimum}"
        raise InvalidArgument(field, f"must be {relation} (got {value})")
    if value > MAX_VALUE:
        raise InvalidArgument(field, f"must be <= 2**62 (got {value})")


def _check_header(g: WorkerGeometry) -> None:
    if not g.worker.engine_id:
        raise InvalidArgument("worker.engine_id", "must not be empty")
    for name in ("dp_rank", "tp_rank", "pp_rank"):
        _check_int(f"worker.{name}", getattr(g.worker, name), 0)
    _check_int("block_size_tokens", g.block_size_tokens, 1)
    _check_int("tp_size", g.tp_size, 1)
    if g.worker.tp_rank >= g.tp_size:
        raise InvalidArgument(
            "worker.tp_rank", f"must be < tp_size ({g.worker.tp_rank} >= {g.tp_size})"
        )
    _check_count("allocations", len(g.allocations), "MAX_ALLOCATIONS", MAX_ALLOCATIONS)
    _check_count("views", len(g.views), "MAX_VIEWS", MAX_VIEWS)


def _check_count(field: str, count: int, limit_name: str, limit: int) -> None:
    if count == 0:
        raise InvalidArgument(field, "must not be empty")
    if count > limit:
        raise InvalidArgument(field, f"too many ({count} > {limit_name} = {limit})")


def _check_allocations(allocations: Sequence[AllocationSpec]) -> None:
    first_index: dict[str, int] = {}
    for i, a in enumerate(allocations):
        if not a.id:
            raise InvalidArgument(f"allocations[{i}].id", "must not be empty")
        if a.id in first_index:
            raise InvalidArgument(
                f"allocations[{i}].id",
                f"duplicate allocation id {a.id!r} (also allocations[{first_index[a.id]}].id)",
            )
        first_index[a.id] = i
        _check_int(f"allocations[{i}].size_bytes", a.size_bytes, 1)
        _check_int(f"allocations[{i}].device.index", a.device.index, 0)


def _check_views(views: Sequence[ViewSpec], allocations: dict[str, AllocationSpec]) -> None:
    first_index: dict[str, int] = {}
    descriptors = 0
    for i, v in enumerate(views):
        at = f"views[{i}]"
        if not v.layer_name:
            raise InvalidArgument(f"{at}.layer_name", "must not be empty")
        if v.layer_name in first_index:
            raise InvalidArgument(
                f"{at}.layer_name",
                f"duplicate layer name {v.layer_name!r} "
                f"(also views[{first_index[v.layer_name]}].layer_name)",
            )
        first_index[v.layer_name] = i
        allocation = allocations.get(v.allocation_id)
        if allocation is None:
            known = ", ".join(repr(k) for k in list(allocations)[:8])
            raise InvalidArgument(
                f"{at}.allocation_id", f"unknown allocation {v.allocation_id!r} (known: {known})"
            )
        _check_int(f"{at}.transfer_group", v.transfer_group, 0)
        _check_int(f"{at}.offset_bytes", v.offset_bytes, 0)
        _check_int(f"{at}.block_len_bytes", v.block_len_bytes, 1)
        _check_int(f"{at}.block_stride_bytes", v.block_stride_bytes, 1)
        if v.block_stride_bytes < v.block_len_bytes:
            raise InvalidArgument(
                f"{at}.block_stride_bytes",
                f"must be >= block_len_bytes ({v.block_len_bytes} > {v.block_stride_bytes})",
            )
        _check_int(f"{at}.num_blocks", v.num_blocks, 1)
        if v.num_blocks > MAX_BLOCKS:
            raise InvalidArgument(
                f"{at}.num_blocks", f"too many blocks ({v.num_blocks} > MAX_BLOCKS = {MAX_BLOCKS})"
            )
        end = _extent(v)[1]
        if end > allocation.size_bytes:
            raise InvalidArgument(
                at,
                f"does not fit in allocation {v.allocation_id!r}: its last block ends at byte "
                f"{end} > size_bytes {allocation.size_bytes}",
            )
        descriptors += v.num_blocks
    if descriptors > MAX_DESCRIPTORS:
        raise InvalidArgument(
            "views",
            f"too many descriptors in total ({descriptors} > MAX_DESCRIPTORS = {MAX_DESCRIPTORS})",
        )


def _extent(v: ViewSpec) -> tuple[int, int]:
    """[first byte, one past the last byte) of all of the view's blocks."""
    last_block = v.offset_bytes + (v.num_blocks - 1) * v.block_stride_bytes
    return v.offset_bytes, last_block + v.block_len_bytes


# Overlaps ------------------------------------------------------------------


def find_shared_byte(a: ViewSpec, b: ViewSpec) -> int | None:
    """A byte that blocks of both views cover, or None; ignores allocation ids.
    Expects positive lengths, strides and block counts.

    Exact and O(log stride) for any pair of strides: block i of ``a`` meets
    block j of ``b`` iff ``j*t - i*s`` falls in a window of ``l + k - 1``
    values, which becomes "least r with (c + r*q) mod t in [0, w]".
    """
    s, t = a.block_stride_bytes, b.block_stride_bytes
    lo_gap = 1 - b.block_len_bytes - (b.offset_bytes - a.offset_bytes)
    hi_gap = a.block_len_bytes - 1 - (b.offset_bytes - a.offset_bytes)
    # Only blocks i of ``a`` whose window can reach some block j in [0, m) of b.
    first_i = max(0, -(hi_gap // s))
    last_i = min(a.num_blocks - 1, ((b.num_blocks - 1) * t - lo_gap) // s)
    if first_i > last_i:
        return None
    width = hi_gap - lo_gap
    start = (-(lo_gap + first_i * s)) % t
    r = _least_step_into(start, (-s) % t, t, width)
    if r is None or first_i + r > last_i:
        return None
    i = first_i + r
    j = max(0, -(-(lo_gap + i * s) // t))
    return max(a.offset_bytes + i * s, b.offset_bytes + j * t)


def _least_step_into(start: int, step: int, modulus: int, width: int) -> int | None:
    """Least r >= 0 with (start + r*step) mod modulus <= width."""
    if start <= width:
        return 0
    # (r*step) mod modulus must land in [modulus - start, modulus - start + width].
    return _least_multiplier(step, modulus, modulus - start, modulus - start + width)


def _least_multiplier(a: int, m: int, lo: int, hi: int) -> int | None:
    """Least x >= 0 with lo <= (a*x) mod m <= hi, for 0 <= lo <= hi < m and 0 <= a < m.

    Euclid-like: if no multiple of ``a`` lies in [lo, hi] directly, the number
    y of wraps past ``m`` must satisfy the same kind of condition modulo ``a``.
    """
    if lo == 0:
        return 0
    if a == 0:
        return None
    x = -(-lo // a)
    if a * x <= hi:
        return x
    y = _least_multiplier(m % a, a, (-hi) % a, (-lo) % a)
    return None if y is None else -(-(lo + m * y) // a)


@dataclass(frozen=True)
class _Rect:
    """A view's bytes drawn on rows of ``stride`` bytes: columns [col0, col1)
    of rows [row0, row1]. A view whose block wraps past a row end is two."""

    col0: int
    col1: int
    row0: int
    row1: int
    owner: int


def _rects(index: int, v: ViewSpec) -> list[_Rect]:
    s = v.block_stride_bytes
    row, col = divmod(v.offset_bytes, s)
    last = row + v.num_blocks - 1
    end = col + v.block_len_bytes
    if end <= s:
        return [_Rect(col, end, row, last, index)]
    return [_Rect(col, s, row, last, index), _Rect(0, end - s, row + 1, last + 1, index)]


def _same_stride_conflict(members: Iterable[tuple[int, ViewSpec]]) -> tuple[int, int] | None:
    """First pair of same-stride views sharing a byte: a sweep over columns.

    While no conflict is found, the active rectangles' row ranges are
    disjoint, so a sorted list of their starts answers each insertion with
    one bisection: O(V log V) instead of comparing every pair.
    """
    events: list[tuple[int, int, int, _Rect]] = []
    for index, v in members:
        for seq, r in enumerate(_rects(index, v)):
            # Removals (0) sort before insertions (1): columns are half-open.
            events.append((r.col1, 0, 2 * index + seq, r))
            events.append((r.col0, 1, 2 * index + seq, r))
    starts: list[int] = []
    active: dict[int, _Rect] = {}
    for _, is_insert, _, r in sorted(events, key=lambda e: e[:3]):
        pos = bisect_left(starts, r.row0)
        if not is_insert:
            del starts[pos]
            del active[r.row0]
            continue
        if pos > 0 and active[starts[pos - 1]].row1 >= r.row0:
            return active[starts[pos - 1]].owner, r.owner
        if pos < len(starts) and starts[pos] <= r.row1:
            return active[starts[pos]].owner, r.owner
        starts.insert(pos, r.row0)
        active[r.row0] = r
    return None


def _cross_stride_conflict(members: Sequence[tuple[int, ViewSpec]]) -> tuple[int, int] | None:
    """First pair of different-stride views sharing a byte: views whose extents
    meet are found by a sweep over offsets, then checked exactly."""
    active: dict[int, list[tuple[int, int]]] = {}  # stride -> heap of (extent end, index)
    by_index = dict(members)
    checked = 0
    for index, v in sorted(members, key=lambda m: m[1].offset_bytes):
        for stride in list(active):
            heap = active[stride]
            while heap and heap[0][0] <= v.offset_bytes:
                heapq.heappop(heap)
            if not heap:
                del active[stride]
                continue
            if stride == v.block_stride_bytes:
                continue
            for _, other in heap:
                checked += 1
                if checked > MAX_CROSS_STRIDE_PAIRS:
                    raise InvalidArgument(
                        "views",
                        f"too many pairs of views with different block strides share byte "
                        f"ranges of allocation {v.allocation_id!r} "
                        f"(> MAX_CROSS_STRIDE_PAIRS = {MAX_CROSS_STRIDE_PAIRS})",
                    )
                if find_shared_byte(by_index[other], v) is not None:
                    return other, index
        heapq.heappush(active.setdefault(v.block_stride_bytes, []), (_extent(v)[1], index))
    return None


def _check_overlaps(views: Sequence[ViewSpec]) -> None:
    # Identical views are aliases and may share bytes: keep one of each.
    unique: dict[tuple[str, int, int, int, int], int] = {}
    for i, v in enumerate(views):
        key = (v.allocation_id, v.offset_bytes, v.block_len_bytes, v.block_stride_bytes)
        unique.setdefault((*key, v.num_blocks), i)
    per_allocation: dict[str, list[tuple[int, ViewSpec]]] = {}
    for i in unique.values():
        per_allocation.setdefault(views[i].allocation_id, []).append((i, views[i]))
    for members in per_allocation.values():
        per_stride: dict[int, list[tuple[int, ViewSpec]]] = {}
        for i, v in members:
            per_stride.setdefault(v.block_stride_bytes, []).append((i, v))
        conflicts = [_same_stride_conflict(group) for group in per_stride.values()]
        conflicts.append(_cross_stride_conflict(members))
        found = [sorted(c) for c in conflicts if c is not None]
        if found:
            first, second = min(found)
            a, b = views[first], views[second]
            raise InvalidArgument(
                f"views[{second}]",
                f"overlaps views[{first}] ({a.layer_name!r}) in allocation {a.allocation_id!r} "
                f"at byte {find_shared_byte(a, b)} without being identical to it",
            )
