"""Transfer planning: pieces from the common refinement of two region maps,
and descriptors that move exactly the bytes the per-layer semantics says.

The maps are built here by two tiny planners (per-view ``baseline`` and a
merge-adjacent-in-row ``coalesce``) so these tests do not depend on the
daemon's planner module. ``simulate`` executes a plan on byte buffers the way
NIXL would: it expands the strided Nx5 rows, then copies each descriptor.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from kvmap.core.errors import FailedPrecondition, InvalidArgument, KvmapError, NotFound
from kvmap.core.geometry import (
    CacheKind,
    DeviceRef,
    LayerPlacement,
    PlacedAllocation,
    PlannerInfo,
    Region,
    RegionMapModel,
    ViewSpec,
    WorkerKey,
)
from kvmap.core.transfer_pieces import LayerSelection, PieceTable, Side, build_piece_table
from kvmap.core.transfer_plan import (
    MAX_BLOCKS_PER_TRANSFER,
    GroupPairs,
    TransferPlan,
    first_index,
    piece_dlist_rows,
    plan_transfer,
)

PREFILL = WorkerKey("prefill")
DECODE = WorkerKey("decode")
MLA, IDX, MHA = CacheKind.MLA, CacheKind.INDEXER, CacheKind.MHA

# --- test planners and map construction -------------------------------------

Planner = Callable[[Sequence[ViewSpec]], list[Region]]


def _region(rid: int, views: Sequence[ViewSpec]) -> Region:
    first = views[0]
    return Region(
        id=rid,
        allocation_id=first.allocation_id,
        transfer_group=first.transfer_group,
        offset_bytes=first.offset_bytes,
        block_len_bytes=views[-1].end_of_block - first.offset_bytes,
        block_stride_bytes=first.block_stride_bytes,
        num_blocks=first.num_blocks,
        layers=tuple(
            LayerPlacement(
                v.layer_name, v.offset_bytes - first.offset_bytes, v.block_len_bytes, v.cache_kind
            )
            for v in views
        ),
    )


def baseline(views: Sequence[ViewSpec]) -> list[Region]:
    """vLLM today: one region per layer view."""
    return [_region(i, [v]) for i, v in enumerate(views)]


def coalesce(views: Sequence[ViewSpec]) -> list[Region]:
    """Merge replicated-kind views that follow each other in one row."""

    def key(v: ViewSpec) -> tuple[str, int, int, int, int]:
        return (
            v.allocation_id,
            v.transfer_group,
            v.block_stride_bytes,
            v.num_blocks,
            v.offset_bytes,
        )

    runs: list[list[ViewSpec]] = []
    for v in sorted(views, key=key):
        last = runs[-1][-1] if runs else None
        if (
            last is not None
            and v.cache_kind.replicated
            and last.cache_kind.replicated
            and key(v)[:4] == key(last)[:4]
            and v.offset_bytes == last.end_of_block
        ):
            runs[-1].append(v)
        else:
            runs.append([v])
    return [_region(100 + i, run) for i, run in enumerate(runs)]


@dataclass(frozen=True)
class Layout:
    """One side's layout: views plus allocation (id -> base, size)."""

    views: tuple[ViewSpec, ...]
    allocs: dict[str, tuple[int, int]]


def region_map(
    worker: WorkerKey, side: Layout, planner: Planner, tp_size: int = 1
) -> RegionMapModel:
    return RegionMapModel(
        worker=worker,
        generation=1,
        planner=PlannerInfo(planner.__name__, 1),
        regions=tuple(planner(side.views)),
        allocations=tuple(
            PlacedAllocation(aid, size, DeviceRef(), base)
            for aid, (base, size) in side.allocs.items()
        ),
        tp_size=tp_size,
    )


@dataclass(frozen=True)
class Layer:
    name: str
    group: int
    kind: CacheKind
    len: int
    # Name of the layer whose cache this one shares (same bytes), or "".
    alias: str = ""


def with_aliases(views: list[ViewSpec], layers: Sequence[Layer]) -> list[ViewSpec]:
    """``views`` plus, for each alias layer, a view of its target's bytes
    under the alias's name (vLLM registers layers that share a KV cache)."""
    by_name = {v.layer_name: v for v in views}
    return views + [replace(by_name[ly.alias], layer_name=ly.name) for ly in layers if ly.alias]


def block_outermost(
    layers: Sequence[Layer],
    num_blocks: int,
    alloc: str,
    *,
    gaps: Sequence[int] = (),
    tail: int = 0,
    lead: int = 0,
) -> tuple[list[ViewSpec], int]:
    """Rows of every layer back to back (BLHNC-like); returns views and size."""
    offsets, pos = [], lead
    for j, layer in enumerate(layers):
        offsets.append(pos)
        pos += layer.len + (gaps[j] if j < len(gaps) else 0)
    stride = pos - lead + tail
    views = [
        ViewSpec(ly.name, alloc, ly.group, ly.kind, "bf16", off, ly.len, stride, num_blocks)
        for ly, off in zip(layers, offsets, strict=True)
    ]
    return views, lead + stride * num_blocks


def layer_outermost(
    layers: Sequence[Layer], num_blocks: int, alloc: str, pad: int = 0, gap: int = 0
) -> tuple[list[ViewSpec], int]:
    """One slab of blocks per layer (NHD per layer); returns views and size."""
    views, pos = [], 0
    for ly in layers:
        views.append(
            ViewSpec(
                ly.name, alloc, ly.group, ly.kind, "bf16", pos, ly.len, ly.len + pad, num_blocks
            )
        )
        pos += (ly.len + pad) * num_blocks + gap
    return views, pos


def one_alloc(views_size: tuple[list[ViewSpec], int], alloc: str = "a0") -> Layout:
    views, size = views_size
    return Layout(tuple(views), {alloc: (1 << 20, size)})


# --- simulation --------------------------------------------------------------

Memory = dict[int, np.ndarray]  # allocation base address -> bytes


def memory(side: Layout, seed: int) -> Memory:
    rng = np.random.default_rng(seed)
    return {base: rng.integers(0, 256, size, dtype=np.uint8) for base, size in side.allocs.values()}


def _locate(mem: Memory, addr: int, length: int) -> tuple[int, int]:
    for base, buf in mem.items():
        if base <= addr and addr + length <= base + len(buf):
            return base, addr - base
    raise AssertionError(f"descriptor [{addr:#x}, +{length}) is outside every allocation")


def expand(table: PieceTable, side: Side, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What NIXL's prepared strided list holds at these indices: (addr, len)."""
    rows = piece_dlist_rows(table, side, 0)
    first = first_index(table, side)
    p = np.searchsorted(first, indices, side="right") - 1
    block = indices - first[p]
    assert np.all((block >= 0) & (block < rows[p, 4]))
    return rows[p, 0] + block * rows[p, 3], rows[p, 1]


def simulate(
    plan: TransferPlan, table: PieceTable, local_mem: Memory, remote_mem: Memory, direction: str
) -> dict[int, np.ndarray]:
    """Apply the plan; return how often each destination byte was written."""
    la, ll = expand(table, Side.LOCAL, plan.local_indices.astype(np.int64))
    ra, rl = expand(table, Side.REMOTE, plan.remote_indices.astype(np.int64))
    assert np.array_equal(ll, rl)
    src, dst = (remote_mem, local_mem) if direction == "READ" else (local_mem, remote_mem)
    writes = {base: np.zeros(len(buf), dtype=np.int32) for base, buf in dst.items()}
    for l_addr, r_addr, length in zip(la.tolist(), ra.tolist(), ll.tolist(), strict=True):
        s_addr, d_addr = (r_addr, l_addr) if direction == "READ" else (l_addr, r_addr)
        sb, so = _locate(src, s_addr, length)
        db, do = _locate(dst, d_addr, length)
        dst[db][do : do + length] = src[sb][so : so + length]
        writes[db][do : do + length] += 1
    return writes


def nixl_merged(plan: TransferPlan, table: PieceTable) -> list[tuple[int, int, int]]:
    """The plan's index pairs as NIXL's make_prepped_xfer posts them
    (local address, remote address, length): a pair whose descriptors
    continue the previous pair's on both sides is folded into it."""
    la, ll = expand(table, Side.LOCAL, plan.local_indices.astype(np.int64))
    ra, _ = expand(table, Side.REMOTE, plan.remote_indices.astype(np.int64))
    out: list[list[int]] = []
    for l_addr, r_addr, length in zip(la.tolist(), ra.tolist(), ll.tolist(), strict=True):
        last = out[-1] if out else None
        if last and last[0] + last[2] == l_addr and last[1] + last[2] == r_addr:
            last[2] += length
        else:
            out.append([l_addr, r_addr, length])
    return [(a, b, n) for a, b, n in out]


def naive(
    local: Layout,
    remote: Layout,
    sels: Sequence[LayerSelection],
    pairs: Sequence[GroupPairs],
    *,
    local_mem: Memory,
    remote_mem: Memory,
    direction: str,
) -> tuple[dict[int, np.ndarray], int]:
    """Per layer, per block copy straight from the views; returns the written
    mask and the descriptor count vLLM's per-layer path would post."""
    lv = {v.layer_name: v for v in local.views}
    rv = {v.layer_name: v for v in remote.views}
    src, dst = (remote_mem, local_mem) if direction == "READ" else (local_mem, remote_mem)
    mask = {base: np.zeros(len(buf), dtype=bool) for base, buf in dst.items()}
    count = 0
    for sel, gp in zip(sels, pairs, strict=True):
        names = sel.layer_names or [
            v.layer_name for v in local.views if v.transfer_group == sel.transfer_group
        ]
        for name in names:
            for lb, rb in zip(gp.local_block_ids, gp.remote_block_ids, strict=True):
                a, b = lv[name], rv[name]
                l_addr = (
                    local.allocs[a.allocation_id][0] + a.offset_bytes + lb * a.block_stride_bytes
                )
                r_addr = (
                    remote.allocs[b.allocation_id][0] + b.offset_bytes + rb * b.block_stride_bytes
                )
                s_addr, d_addr = (r_addr, l_addr) if direction == "READ" else (l_addr, r_addr)
                sb, so = _locate(src, s_addr, a.block_len_bytes)
                db, do = _locate(dst, d_addr, a.block_len_bytes)
                dst[db][do : do + a.block_len_bytes] = src[sb][so : so + a.block_len_bytes]
                mask[db][do : do + a.block_len_bytes] = True
                count += 1
    return mask, count


def check_moves_exactly(
    local: Layout,
    remote: Layout,
    planners: tuple[Planner, Planner],
    sels: Sequence[LayerSelection],
    pairs: Sequence[GroupPairs],
    *,
    direction: str = "READ",
) -> tuple[PieceTable, TransferPlan]:
    local_plan, remote_plan = planners
    table = build_piece_table(
        region_map(DECODE, local, local_plan), region_map(PREFILL, remote, remote_plan), sels
    )
    dest = Side.LOCAL if direction == "READ" else Side.REMOTE
    plan = plan_transfer(table, pairs, destination=dest)
    assert len(plan.runs) == 0  # one prepped transfer carries the plan
    got_l, got_r = memory(local, 1), memory(remote, 2)
    want_l, want_r = memory(local, 1), memory(remote, 2)
    writes = simulate(plan, table, got_l, got_r, direction)
    mask, naive_count = naive(
        local, remote, sels, pairs, local_mem=want_l, remote_mem=want_r, direction=direction
    )
    for got, want in ((got_l, want_l), (got_r, want_r)):
        for base in got:
            assert np.array_equal(got[base], want[base])
    for base, w in writes.items():
        assert w.max(initial=0) <= 1, "a destination byte was written twice"
        assert np.array_equal(w > 0, mask[base]), "written bytes differ from the per-layer set"
    assert plan.descriptors <= naive_count
    # What NIXL posts is never more than the plan counts (it may fold more:
    # pieces that happen to continue each other on both sides).
    assert len(nixl_merged(plan, table)) <= plan.descriptors
    assert plan.blocks == sum(len(p.local_block_ids) for p in pairs)
    assert plan.bytes == sum(int(m.sum()) for m in mask.values())
    return table, plan


# --- property test -----------------------------------------------------------

LENS = st.sampled_from([8, 16, 24, 32, 64])
KINDS = st.sampled_from([MLA, MLA, MLA, IDX, IDX, MHA, CacheKind.MAMBA])


@st.composite
def models(draw: st.DrawFn, aligned: bool) -> tuple[list[list[Layer]], list[int]]:
    groups, blocks = [], []
    kinds = st.sampled_from([MLA, IDX]) if aligned else KINDS
    for g in range(draw(st.integers(1, 3))):
        n = draw(st.integers(1, 6))
        layers = [Layer(f"g{g}.l{j}", g, draw(kinds), draw(LENS)) for j in range(n)]
        for target in draw(st.lists(st.sampled_from(layers), unique=True, max_size=2)):
            layers.append(replace(target, name=f"{target.name}b", alias=target.name))
        groups.append(layers)
        blocks.append(draw(st.integers(1, 12)))
    return groups, blocks


@st.composite
def layouts(draw: st.DrawFn, groups: list[list[Layer]], blocks: list[int], aligned: bool) -> Layout:
    """Each group's layers, in random order unless ``aligned``, cut into up
    to three allocations, each laid out block- or (unless ``aligned``)
    layer-outermost with random padding. ``aligned`` layouts coalesce into
    rows that line up with the other side's except at the cuts."""
    views: list[ViewSpec] = []
    allocs: dict[str, tuple[int, int]] = {}
    gap_sizes = [0] if aligned else [0, 0, 0, 0, 0, 8]
    for all_layers, nb in zip(groups, blocks, strict=True):
        layers = [ly for ly in all_layers if not ly.alias]
        first_view = len(views)
        order = layers if aligned else draw(st.permutations(layers))
        cuts = []
        if len(order) > 1:
            cuts = sorted(draw(st.sets(st.integers(1, len(order) - 1), max_size=2)))
        for chunk in (order[a:b] for a, b in itertools.pairwise([0, *cuts, len(order)])):
            aid = f"a{len(allocs)}"
            n = nb + draw(st.integers(0, 2))  # regions may hold more blocks than used
            if aligned or draw(st.booleans()):
                gaps = draw(
                    st.lists(
                        st.sampled_from(gap_sizes),
                        min_size=len(chunk),
                        max_size=len(chunk),
                    )
                )
                tail, lead = draw(st.sampled_from([0, 0, 16])), draw(st.sampled_from([0, 32]))
                vs, size = block_outermost(chunk, n, aid, gaps=gaps, tail=tail, lead=lead)
            else:
                pad, gap = draw(st.sampled_from([0, 0, 8])), draw(st.sampled_from([0, 24]))
                vs, size = layer_outermost(chunk, n, aid, pad, gap)
            views.extend(vs)
            allocs[aid] = ((len(allocs) + 1) << 20, size)
        views[first_view:] = with_aliases(views[first_view:], all_layers)
    return Layout(tuple(views), allocs)


@st.composite
def block_pairs(draw: st.DrawFn, limit: int) -> tuple[list[int], list[int]]:
    """(destination ids, source ids): destination ids never repeat."""
    mode = draw(st.sampled_from(["consecutive", "scattered", "runs"]))
    if mode == "consecutive":
        n = draw(st.integers(0, limit))
        d0, s0 = draw(st.integers(0, limit - n)), draw(st.integers(0, limit - n))
        return list(range(d0, d0 + n)), list(range(s0, s0 + n))
    if mode == "scattered":
        dest = draw(st.lists(st.integers(0, limit - 1), unique=True, max_size=limit))
        src = draw(st.lists(st.integers(0, limit - 1), min_size=len(dest), max_size=len(dest)))
        return dest, src
    dest, src = [], []
    for _ in range(draw(st.integers(1, 3))):
        n = draw(st.integers(1, limit))
        d0, s0 = draw(st.integers(0, limit - n)), draw(st.integers(0, limit - n))
        for d, s in zip(range(d0, d0 + n), range(s0, s0 + n), strict=True):
            if d not in dest:
                dest.append(d)
                src.append(s)
    return dest, src


@st.composite
def scenarios(draw: st.DrawFn, aligned: bool = False) -> tuple:  # type: ignore[type-arg]
    groups, blocks = draw(models(aligned))
    local = draw(layouts(groups, blocks, aligned))
    remote = local if draw(st.booleans()) else draw(layouts(groups, blocks, aligned))
    planners = (coalesce, coalesce)
    if not aligned:
        planner = st.sampled_from([coalesce, baseline])
        planners = draw(st.tuples(planner, planner))
    direction = draw(st.sampled_from(["READ", "WRITE"]))
    chosen = draw(st.lists(st.integers(0, len(groups) - 1), unique=True, min_size=1))
    sels, pairs = [], []
    for g in chosen:
        names = [ly.name for ly in groups[g]]
        subset = draw(st.lists(st.sampled_from(names), unique=True)) if draw(st.booleans()) else []
        dest, src = draw(block_pairs(blocks[g]))
        lids, rids = (dest, src) if direction == "READ" else (src, dest)
        sels.append(LayerSelection(g, tuple(subset)))
        pairs.append(GroupPairs(g, lids, rids))
    return local, remote, planners, sels, pairs, direction


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_plan_moves_exactly_the_per_layer_bytes(scenario: tuple) -> None:  # type: ignore[type-arg]
    """For random layouts, planners, layer subsets, block pairs and both directions, executing the
    plan writes exactly the bytes vLLM's per-layer copy would, each once, with no more
    descriptors."""
    local, remote, (lp, rp), sels, pairs, direction = scenario
    table, plan = check_moves_exactly(local, remote, (lp, rp), sels, pairs, direction=direction)
    # Coverage of the interesting shapes (see --hypothesis-show-statistics).
    event(f"{lp.__name__} vs {rp.__name__}, {direction}")
    event(f"pieces with several layers: {any(len(p.layer_names) > 1 for p in table.pieces)}")
    event(f"merged runs: {plan.merged > 0}")


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(aligned=True))
def test_coalesced_peers_split_only_where_either_side_cuts(scenario: tuple) -> None:  # type: ignore[type-arg]
    """Two coalescing peers whose rows differ only in allocation cuts and
    padding: pieces are the common refinement, one per stretch of layers that
    both sides keep in one region."""
    local, remote, planners, sels, pairs, direction = scenario
    table, plan = check_moves_exactly(local, remote, planners, sels, pairs, direction=direction)
    lmap, rmap = region_map(DECODE, local, coalesce), region_map(PREFILL, remote, coalesce)
    lreg = {p.layer_name: r.id for r in lmap.regions for p in r.layers}
    rreg = {p.layer_name: r.id for r in rmap.regions for p in r.layers}
    for sel, (a, b) in zip(sels, table.spans, strict=True):
        if sel.layer_names:
            continue
        names = [
            v.layer_name
            for v in local.views
            if v.transfer_group == sel.transfer_group and not v.layer_name.endswith("b")
        ]  # aliases ("...b") ride in their target's piece
        cuts = sum((lreg[x], rreg[x]) != (lreg[y], rreg[y]) for x, y in itertools.pairwise(names))
        assert b - a == cuts + 1
    event(f"pieces with several layers: {any(len(p.layer_names) > 1 for p in table.pieces)}")
    event(f"merged runs: {plan.merged > 0}")


# --- named cases -------------------------------------------------------------


def glm_like(n: int = 8) -> list[Layer]:
    """MLA latent (small here) followed by the indexer keys of each layer."""
    out = []
    for i in range(n):
        out += [Layer(f"layers.{i}.mla", 0, MLA, 64), Layer(f"layers.{i}.indexer", 0, IDX, 16)]
    return out


def test_coalesce_vs_baseline_glm_like() -> None:
    """Against a per-layer peer the plan has one piece per layer and no merged runs; two coalescing
    peers get one whole-row piece, and NIXL merges consecutive block pairs into one descriptor."""
    layers = glm_like()
    side = one_alloc(block_outermost(layers, 40, "a0"))
    sels, pairs = [LayerSelection(0)], [GroupPairs(0, [3, 4, 5, 9], [10, 11, 12, 30])]
    for lp, rp in ((coalesce, baseline), (baseline, coalesce)):
        table, plan = check_moves_exactly(side, side, (lp, rp), sels, pairs)
        # The per-layer side's boundaries win: one piece per layer.
        assert len(table.pieces) == len(layers)
        assert plan.descriptors == 4 * len(layers) and len(plan.runs) == 0
    table, plan = check_moves_exactly(side, side, (coalesce, coalesce), sels, pairs)
    assert len(table.pieces) == 1 and table.pieces[0].whole_row
    assert table.pieces[0].layer_names == tuple(ly.name for ly in layers)
    # Run 3..5 <-> 10..12 is one descriptor once NIXL merges it, 9 <-> 30 another.
    assert plan.descriptors == 2 and plan.merged == 2
    posted = nixl_merged(plan, table)
    assert posted[0] == ((1 << 20) + 3 * 640, (1 << 20) + 10 * 640, 3 * 640) and len(posted) == 2


def test_identical_coalesced_full_row_maps_give_one_descriptor_per_run() -> None:
    """Two full-row coalesced maps pair region for region, and each stretch of consecutive block
    pairs becomes one descriptor as NIXL posts it (a lone pair stays one)."""
    layers = glm_like(4)
    local = one_alloc(block_outermost(layers, 64, "a0"))
    remote = one_alloc(block_outermost(layers, 80, "r0", lead=64), "r0")
    ids = list(range(10, 30)) + list(range(40, 50)) + [60]
    rids = list(range(50, 70)) + list(range(0, 10)) + [1]
    table, plan = check_moves_exactly(
        local, remote, (coalesce, coalesce), [LayerSelection(0)], [GroupPairs(0, ids, rids)]
    )
    rmap = region_map(PREFILL, remote, coalesce)
    assert [(p.local_region_id, p.remote_region_id) for p in table.pieces] == [
        (r.id, r.id) for r in rmap.regions
    ]
    assert plan.descriptors == 3 and len(plan.local_indices) == 31
    assert [n for _, _, n in nixl_merged(plan, table)] == [20 * 320, 10 * 320, 320]


def test_partial_row_pieces_never_merge_runs() -> None:
    """A coalesced region that does not cover the whole row (padding at its end) is never merged
    across blocks: one descriptor per block pair."""
    # Coalesced regions with padding at the row's end: not full_row.
    side = one_alloc(block_outermost(glm_like(2), 16, "a0", tail=64))
    table, plan = check_moves_exactly(
        side, side, (coalesce, coalesce), [LayerSelection(0)], [GroupPairs(0, range(8), range(8))]
    )
    assert not table.pieces[0].whole_row and plan.descriptors == 8 and plan.merged == 0
    assert len(nixl_merged(plan, table)) == 8


def test_two_groups_and_a_layer_subset() -> None:
    """Two transfer groups in different allocations, one restricted to a single layer, move the
    right bytes, with per-group piece spans and block limits."""
    mla = [Layer(f"m{i}", 0, MLA, 32) for i in range(3)]
    mha = [Layer(f"h{i}", 1, MHA, 16) for i in range(2)]
    lv, lsize = block_outermost(mla, 20, "a0")
    hv, hsize = layer_outermost(mha, 24, "a1", pad=8)
    local = Layout((*lv, *hv), {"a0": (1 << 20, lsize), "a1": (2 << 20, hsize)})
    rv, rsize = layer_outermost(mla + mha, 30, "b0")
    remote = Layout(tuple(rv), {"b0": (1 << 24, rsize)})
    sels = [LayerSelection(0), LayerSelection(1, ("h1",))]
    pairs = [GroupPairs(0, [1, 2, 7], [4, 5, 6]), GroupPairs(1, [23, 0], [29, 29])]
    table, plan = check_moves_exactly(local, remote, (coalesce, baseline), sels, pairs)
    assert table.spans == ((0, 3), (3, 4))
    assert table.local_limits == (20, 24) and table.remote_limits == (30, 30)
    assert plan.descriptors == 3 * 3 + 2 and plan.bytes == 3 * 96 + 2 * 16


def test_same_group_twice_with_disjoint_layers_may_share_block_ids() -> None:
    """One group selected twice for disjoint layer subsets may name the same destination blocks in
    both entries."""
    side = one_alloc(block_outermost(glm_like(2), 8, "a0"))
    sels = [LayerSelection(0, ("layers.0.mla",)), LayerSelection(0, ("layers.1.mla",))]
    pairs = [GroupPairs(0, [1, 2], [1, 2]), GroupPairs(0, [1, 2], [3, 4])]
    check_moves_exactly(side, side, (coalesce, baseline), sels, pairs)


def test_layer_subset_pieces_follow_row_order_and_skip_gaps() -> None:
    """Selected layers, listed in any order, become pieces in row order, merged where adjacent and
    split where an unselected layer lies between."""
    layers = glm_like(3)  # m0 i0 m1 i1 m2 i2, one coalesced row on each side
    side = one_alloc(block_outermost(layers, 8, "a0"))
    names = ("layers.2.indexer", "layers.2.mla", "layers.1.indexer", "layers.0.mla")
    table, plan = check_moves_exactly(
        side,
        side,
        (coalesce, coalesce),
        [LayerSelection(0, names)],
        [GroupPairs(0, [0, 1], [2, 3])],
    )
    # Listed backwards, merged in row order; the unselected layers.0.indexer
    # and layers.1.mla split the row.
    assert [p.layer_names for p in table.pieces] == [
        ("layers.0.mla",),
        ("layers.1.indexer", "layers.2.mla", "layers.2.indexer"),
    ]
    assert [p.local_offset for p in table.pieces] == [0, 144]
    assert plan.descriptors == 4


def test_dlist_rows_are_strided_rows_per_piece() -> None:
    """The prepared descriptor list holds one strided row per piece (address, length, device,
    stride, block count), and first_index gives each piece's starting index on each side."""
    layers = glm_like(2)
    local = one_alloc(block_outermost(layers, 40, "a0"))
    remote = one_alloc(layer_outermost(layers, 50, "b0"), "b0")
    table = build_piece_table(
        region_map(DECODE, local, coalesce),
        region_map(PREFILL, remote, baseline),
        [LayerSelection(0)],
    )
    rows = piece_dlist_rows(table, Side.LOCAL, 3)
    assert rows.dtype == np.int64 and rows.shape == (4, 5)
    assert rows[:, 0].tolist() == [(1 << 20) + off for off in (0, 64, 80, 144)]
    assert rows[:, 1:].tolist() == [[n, 3, 160, 40] for n in (64, 16, 64, 16)]
    assert first_index(table, Side.LOCAL).tolist() == [0, 40, 80, 120]
    assert first_index(table, Side.REMOTE).tolist() == [0, 50, 100, 150]
    assert piece_dlist_rows(table, Side.REMOTE, 0)[:, 3].tolist() == [64, 16, 64, 16]


def test_protobuf_repeated_ids_are_accepted() -> None:
    """Block ids given as protobuf repeated fields plan and move the same bytes as lists."""
    from kvmap.v1 import transfers_pb2

    msg = transfers_pb2.GroupBlocks(local_block_ids=[1, 2], remote_block_ids=[2, 3])
    side = one_alloc(block_outermost(glm_like(1), 8, "a0"))
    check_moves_exactly(
        side,
        side,
        (coalesce, coalesce),
        [LayerSelection(0)],
        [GroupPairs(0, msg.local_block_ids, msg.remote_block_ids)],
    )


# --- validation --------------------------------------------------------------


def _maps(
    tp: tuple[int, int] = (1, 1), kinds: tuple[CacheKind, ...] = (MLA, MLA)
) -> tuple[RegionMapModel, RegionMapModel]:
    # Big block counts cost nothing here: planning never touches memory.
    layers = [Layer(f"l{i}", 0, k, 64) for i, k in enumerate(kinds)]
    a, sa = layer_outermost(layers[:1], 40000, "a0")
    b, sb = layer_outermost(layers[1:], 32022, "a1")
    c, sc = layer_outermost([Layer("g1", 1, MLA, 64)], 100, "a2")
    side = Layout((*a, *b, *c), {"a0": (1 << 30, sa), "a1": (2 << 30, sb), "a2": (3 << 30, sc)})
    return (region_map(DECODE, side, coalesce, tp[0]), region_map(PREFILL, side, baseline, tp[1]))


def _plan(
    groups: Sequence[GroupPairs],
    sels: Sequence[LayerSelection] | None = None,
    maps: tuple[RegionMapModel, RegionMapModel] | None = None,
    destination: Side = Side.LOCAL,
) -> TransferPlan:
    local, remote = maps or _maps()
    table = build_piece_table(
        local, remote, sels or [LayerSelection(g.transfer_group) for g in groups]
    )
    return plan_transfer(table, groups, destination=destination)


def _raises(exc: type[KvmapError], message: str, fn: Callable[[], object]) -> KvmapError:
    with pytest.raises(exc) as info:
        fn()
    assert str(info.value) == message
    return info.value


def test_unknown_transfer_group() -> None:
    """A transfer group missing from the local or the remote map is NOT_FOUND naming the group and
    the worker."""
    local, remote = _maps()
    _raises(
        NotFound,
        "transfer group 3 not in local worker decode/dp0/tp0/pp0",
        lambda: build_piece_table(local, remote, [LayerSelection(3)]),
    )
    thin = RegionMapModel(PREFILL, 1, remote.planner, remote.regions[:2], remote.allocations)
    _raises(
        NotFound,
        "transfer group 1 not in remote worker prefill/dp0/tp0/pp0",
        lambda: build_piece_table(local, thin, [LayerSelection(1)]),
    )


def test_block_id_validation_names_the_field() -> None:
    """Mismatched id counts and block ids outside the group's smallest region are INVALID_ARGUMENT
    naming the field and index; a selection of one layer uses that layer's own limit."""
    ok = GroupPairs(1, [0], [0])
    err = _raises(
        InvalidArgument,
        "groups[1].remote_block_ids: 5 ids for 4 local ids",
        lambda: _plan([ok, GroupPairs(0, range(4), range(5))]),
    )
    assert isinstance(err, InvalidArgument) and err.field == "groups[1].remote_block_ids"
    # l0's region holds 40,000 blocks, l1's 32,022: the group's limit is the smaller.
    ids = [1, 2, 3, 4, 5, 6, 7, 40000]
    _raises(
        InvalidArgument,
        "groups[0].local_block_ids[7]: block 40000 out of range [0, 32022)",
        lambda: _plan([GroupPairs(0, ids, range(8))]),
    )
    _raises(
        InvalidArgument,
        "groups[0].remote_block_ids[1]: block -1 out of range [0, 32022)",
        lambda: _plan([GroupPairs(0, [0, 1], [0, -1])]),
    )
    _plan([GroupPairs(0, [39999], [0])], [LayerSelection(0, ("l0",))])  # l0 alone: in range


def test_destination_block_written_twice_is_rejected() -> None:
    """A destination block repeated within a group, or written by two entries for the same layers,
    is INVALID_ARGUMENT naming both positions; repeated source blocks are allowed."""
    _raises(
        InvalidArgument,
        "groups[0].local_block_ids[3]: block 2 repeats "
        "groups[0].local_block_ids[1]; one destination block would be written twice",
        lambda: _plan([GroupPairs(0, [1, 2, 3, 2, 1], range(5))]),
    )
    _plan([GroupPairs(0, range(5), [1, 2, 3, 2, 1])])  # reading one source twice is fine
    _raises(
        InvalidArgument,
        "groups[0].remote_block_ids[1]: block 1 repeats "
        "groups[0].remote_block_ids[0]; one destination block would be written twice",
        lambda: _plan([GroupPairs(0, range(2), [1, 1])], destination=Side.REMOTE),
    )
    _raises(
        InvalidArgument,
        "groups[1].local_block_ids[1]: block 5 is also written by groups[0] for the same layers",
        lambda: _plan(
            [GroupPairs(0, [4, 5], [0, 1]), GroupPairs(0, [6, 5], [0, 1])],
            [LayerSelection(0), LayerSelection(0, ("l1",))],
        ),
    )


def test_block_limit_per_transfer() -> None:
    """More block pairs than MAX_BLOCKS_PER_TRANSFER is INVALID_ARGUMENT on the groups field."""
    n = MAX_BLOCKS_PER_TRANSFER + 1
    err = _raises(
        InvalidArgument,
        f"groups: {n} block pairs exceed the limit of {MAX_BLOCKS_PER_TRANSFER}",
        lambda: _plan([GroupPairs(0, range(n), range(n))]),
    )
    assert isinstance(err, InvalidArgument) and err.field == "groups"


def test_layer_selection_validation() -> None:
    """A selected layer not in the group (or in another group) is NOT_FOUND, and a layer listed
    twice is INVALID_ARGUMENT, each naming the layer_names index."""
    _raises(
        NotFound,
        "groups[0].layer_names[1]: layer 'nope' not in transfer group 0 of "
        "local worker decode/dp0/tp0/pp0",
        lambda: _plan([GroupPairs(0, [0], [0])], [LayerSelection(0, ("l0", "nope"))]),
    )
    _raises(
        InvalidArgument,
        "groups[0].layer_names[1]: layer 'l0' is listed twice",
        lambda: _plan([GroupPairs(0, [0], [0])], [LayerSelection(0, ("l0", "l0"))]),
    )
    _raises(
        NotFound,
        "groups[0].layer_names[0]: layer 'g1' not in transfer group 0 of "
        "local worker decode/dp0/tp0/pp0",
        lambda: _plan([GroupPairs(0, [0], [0])], [LayerSelection(0, ("g1",))]),
    )


def test_maps_that_disagree_on_layers() -> None:
    """A layer present locally but not remotely, or with different block lengths on the two sides,
    is FAILED_PRECONDITION naming the layer and both workers."""
    local, remote = _maps()
    fewer = RegionMapModel(PREFILL, 1, remote.planner, remote.regions[1:], remote.allocations)
    _raises(
        FailedPrecondition,
        "layer 'l0' of transfer group 0 is in local worker "
        "decode/dp0/tp0/pp0 but not in remote worker prefill/dp0/tp0/pp0",
        lambda: build_piece_table(local, fewer, [LayerSelection(0)]),
    )
    _raises(
        FailedPrecondition,
        "groups[0].layer_names[0]: layer 'l0' of transfer group 0 is "
        "not in remote worker prefill/dp0/tp0/pp0",
        lambda: build_piece_table(local, fewer, [LayerSelection(0, ("l0",))]),
    )
    r0 = remote.regions[0]
    longer = Region(
        r0.id, r0.allocation_id, 0, 0, 128, 128, 10, (LayerPlacement("l0", 0, 128, MLA),)
    )
    wide = RegionMapModel(
        PREFILL, 1, remote.planner, (longer, *remote.regions[1:]), remote.allocations
    )
    _raises(
        FailedPrecondition,
        "layer 'l0': block length 64 bytes in local worker "
        "decode/dp0/tp0/pp0 vs 128 in remote worker prefill/dp0/tp0/pp0",
        lambda: build_piece_table(local, wide, [LayerSelection(0)]),
    )


def test_remote_map_outside_its_allocation_is_rejected() -> None:
    """A remote map whose region overruns its allocation, places a layer outside the block, repeats
    a region id or names a missing allocation is FAILED_PRECONDITION."""
    local, remote = _maps()
    r0 = remote.regions[0]
    bad = Region(r0.id, r0.allocation_id, 0, 64, 64, 64, 40000, r0.layers)  # one block too far
    evil = RegionMapModel(
        PREFILL, 1, remote.planner, (bad, *remote.regions[1:]), remote.allocations
    )
    _raises(
        FailedPrecondition,
        "remote worker prefill/dp0/tp0/pp0 region 0: 40000 blocks of 64 "
        "bytes, stride 64, at offset 64 do not fit allocation 'a0' of 2560000 bytes",
        lambda: build_piece_table(local, evil, [LayerSelection(0)]),
    )
    wide = Region(r0.id, r0.allocation_id, 0, 0, 64, 64, 10, (LayerPlacement("l0", 32, 64, MLA),))
    _raises(
        FailedPrecondition,
        "remote worker prefill/dp0/tp0/pp0 region 0: layer 'l0' [32, +64) is outside the "
        "region's 64-byte block",
        lambda: build_piece_table(
            local, replace(remote, regions=(wide, *remote.regions[1:])), [LayerSelection(0)]
        ),
    )
    twice = replace(remote, regions=(*remote.regions, remote.regions[0]))
    _raises(
        FailedPrecondition,
        "remote worker prefill/dp0/tp0/pp0: region id 0 appears twice",
        lambda: build_piece_table(local, twice, [LayerSelection(0)]),
    )
    _raises(
        FailedPrecondition,
        "remote worker prefill/dp0/tp0/pp0 region 0: allocation 'a0' is not in the map",
        lambda: build_piece_table(
            local, replace(remote, allocations=remote.allocations[1:]), [LayerSelection(0)]
        ),
    )


def test_tp_mismatch_mla_ok_mha_split_by_heads() -> None:
    """Peers with different tp_size may transfer MLA layers, but an MHA layer (split by heads) is
    FAILED_PRECONDITION unless the tp sizes match or it is left out of the selection."""
    _plan([GroupPairs(0, [1], [1])], maps=_maps(tp=(2, 4)))
    mha = _maps(tp=(2, 4), kinds=(MLA, MHA))
    _raises(
        FailedPrecondition,
        "layer 'l1': MHA is split by heads; tp_size 2 vs 4",
        lambda: _plan([GroupPairs(0, [1], [1])], maps=mha),
    )
    _plan([GroupPairs(0, [1], [1])], [LayerSelection(0, ("l0",))], maps=mha)  # MLA layer only
    _plan([GroupPairs(0, [1], [1])], maps=_maps(tp=(4, 4), kinds=(MLA, MHA)))


# --- scale sanity --------------------------------------------------------------


def test_glm_scale_plans_fast() -> None:
    """2,048 scattered blocks x 101 layers, per-layer peer: ~200K descriptors."""
    layers = [
        Layer(f"layers.{i}", 0, MLA if i % 4 else IDX, 1152 if i % 4 else 128) for i in range(101)
    ]
    local = region_map(DECODE, one_alloc(block_outermost(layers, 32022, "a0")), coalesce)
    remote = region_map(PREFILL, one_alloc(block_outermost(layers, 32022, "a0")), baseline)
    rng = np.random.default_rng(0)
    lids = rng.choice(32022, 2048, replace=False)
    rids = rng.choice(32022, 2048, replace=False)
    t0 = time.perf_counter()
    table = build_piece_table(local, remote, [LayerSelection(0)])
    t1 = time.perf_counter()
    plan = plan_transfer(table, [GroupPairs(0, lids, rids)])
    t2 = time.perf_counter()
    assert plan.descriptors == 2048 * 101 and len(table.pieces) == 101
    same = build_piece_table(local, local, [LayerSelection(0)])
    t3 = time.perf_counter()
    merged = plan_transfer(same, [GroupPairs(0, np.arange(2048), np.arange(100, 2148))])
    t4 = time.perf_counter()
    assert merged.descriptors == 1 and merged.merged == 2047
    print(
        f"\npiece table {1e3 * (t1 - t0):.1f} ms, plan {plan.descriptors} descriptors "
        f"{1e3 * (t2 - t1):.1f} ms; coalesced table {1e3 * (t3 - t2):.1f} ms, "
        f"consecutive plan {1e3 * (t4 - t3):.1f} ms"
    )


# --- aliased views ---------------------------------------------------------------


def _aliased(alias_on: tuple[bool, bool]) -> tuple[RegionMapModel, RegionMapModel]:
    """Decode and prefill maps of layers l0, l1 (100 bytes a block each) and
    l1b, which shares l1's bytes on the sides ``alias_on`` says and has bytes
    of its own on the others."""
    sides = []
    for aliased in alias_on:
        views, size = block_outermost(
            [Layer("l0", 0, MHA, 100), Layer("l1", 0, MHA, 100), Layer("l1b", 0, MHA, 100)], 4, "a0"
        )
        if aliased:
            views = with_aliases(views[:2], [Layer("l1b", 0, MHA, 100, alias="l1")])
        sides.append(Layout(tuple(views), {"a0": (1 << 20, size)}))
    return region_map(DECODE, sides[0], baseline), region_map(PREFILL, sides[1], baseline)


def test_aliased_layer_moves_its_bytes_once() -> None:
    """Layers l0, l1 and l1b of 100 bytes a block, where l1b aliases l1 on both sides, move 400
    bytes for two block pairs (not 600): the alias rides with l1, whether every layer or the three
    names are selected."""
    local, remote = _aliased((True, True))
    for sel in (LayerSelection(0), LayerSelection(0, ("l0", "l1", "l1b"))):
        table = build_piece_table(local, remote, [sel])
        plan = plan_transfer(table, [GroupPairs(0, [0, 2], [1, 3])])
        assert (plan.bytes, plan.descriptors) == (400, 4)  # 2 block pairs x 2 distinct layers
        assert [p.layer_names for p in table.pieces] == [("l0",), ("l1",)]


def test_alias_on_the_destination_only_is_rejected() -> None:
    """l1b aliasing l1 on the destination but not on the source would write each destination byte
    of l1 twice from different source bytes: INVALID_ARGUMENT naming the two layers; as a source
    the same alias is fine, and a pull without l1b is fine."""
    local, remote = _aliased((True, False))
    table = build_piece_table(local, remote, [LayerSelection(0)])
    _raises(
        InvalidArgument,
        "groups[0].layer_names: layers 'l1' and 'l1b' cover common bytes on the local side: "
        "each block would be written twice",
        lambda: plan_transfer(table, [GroupPairs(0, [0], [0])]),
    )
    assert plan_transfer(table, [GroupPairs(0, [0], [0])], destination=Side.REMOTE).bytes == 300
    assert plan_transfer(table, [GroupPairs(0, [], [])]).bytes == 0
    only = build_piece_table(local, remote, [LayerSelection(0, ("l0", "l1"))])
    assert plan_transfer(only, [GroupPairs(0, [0], [0])]).bytes == 200


def test_aliases_in_two_groups_may_not_share_a_destination_block() -> None:
    """Two request groups that select l1 and its alias l1b may not write one destination block."""
    local, remote = _aliased((True, True))
    sels = [LayerSelection(0, ("l1",)), LayerSelection(0, ("l1b",))]
    table = build_piece_table(local, remote, sels)
    _raises(
        InvalidArgument,
        "groups[1].local_block_ids[0]: block 2 is also written by groups[0] for the same layers",
        lambda: plan_transfer(table, [GroupPairs(0, [1, 2], [0, 1]), GroupPairs(0, [2], [2])]),
    )
    assert plan_transfer(table, [GroupPairs(0, [1], [0]), GroupPairs(0, [2], [2])]).bytes == 200
