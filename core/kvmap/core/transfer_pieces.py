"""The common refinement of two region maps: the *pieces* a transfer moves.

The two sides of a transfer may be planned differently (a coalescing peer and a
per-layer ``baseline`` peer, two planner versions, different allocations). A
piece is a maximal run of selected layers that is contiguous inside one local
region's row *and* inside one remote region's row, so one descriptor per piece
per block moves exactly the right bytes on both sides. When both maps are the
same coalesced plan, pieces are its regions.

A ``PieceTable`` depends only on the two maps and the layer selections, never
on block ids: the caller computes it once per (local generation, remote
generation, selections), prepares NIXL descriptor lists from it
(``transfer_plan.piece_dlist_rows``) and reuses both for every transfer.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvmap.core.errors import FailedPrecondition, InvalidArgument, NotFound
from kvmap.core.geometry import LayerPlacement, Region, RegionMapModel, WorkerKey

# NIXL's make_prepped_xfer takes int32 descriptor indices.
MAX_PREPPED_DESCRIPTORS = 2**31 - 1
# Addresses are carried in int64 arrays; user-space virtual addresses fit.
_MAX_ADDRESS = 2**63 - 1

Int64Array = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


class Side(enum.Enum):
    LOCAL = "local"
    REMOTE = "remote"


@dataclass(frozen=True)
class LayerSelection:
    """Which layers of a transfer group a request moves (a wire ``GroupBlocks``
    without its block ids). An empty ``layer_names`` means every layer."""

    transfer_group: int
    layer_names: tuple[str, ...] = ()


@dataclass(frozen=True)
class Piece:
    """Layers ``layer_names`` of selection ``selection`` occupy ``len_bytes``
    at ``local_offset`` of every row of local region ``local_region_id`` and
    at ``remote_offset`` of every row of remote region ``remote_region_id``."""

    selection: int
    local_region_id: int
    local_offset: int
    remote_region_id: int
    remote_offset: int
    len_bytes: int
    layer_names: tuple[str, ...]
    # The piece is each side's whole row and both rows are back to back
    # (full_row): a run of consecutive block ids is one contiguous span.
    whole_row: bool


@dataclass(frozen=True, eq=False)
class SideRows:
    """One side's per-piece arrays, indexed like ``PieceTable.pieces``.

    Descriptor ``first_index[p] + b`` of this side's prepared list is block
    ``b`` of piece ``p``: ``addr[p] + b * stride[p]``, ``len_bytes`` long.
    """

    addr: Int64Array  # address of the piece in block 0 of its region
    stride: Int64Array
    count: Int64Array  # num_blocks of the piece's region
    first_index: Int64Array


@dataclass(frozen=True, eq=False)
class PieceTable:
    local_worker: WorkerKey
    local_generation: int
    remote_worker: WorkerKey
    remote_generation: int
    selections: tuple[LayerSelection, ...]
    pieces: tuple[Piece, ...]
    # pieces[start:stop] belong to selections[i].
    spans: tuple[tuple[int, int], ...]
    len_bytes: Int64Array
    whole_row: BoolArray
    local: SideRows
    remote: SideRows
    # Block ids of selection i must lie in [0, limit): the fewest blocks of
    # any region its pieces touch, on each side.
    local_limits: tuple[int, ...]
    remote_limits: tuple[int, ...]
    # Where two pieces' bytes meet on a side (the same block id of both
    # covers a common byte): what would be written twice were that side the
    # destination. ``*_overlaps[i]`` names two layers of selection i that
    # meet, or is ""; ``*_shared`` lists cells: the selections (2+, in
    # order) whose pieces all cover one common byte range. Two selections
    # meet when some cell holds both; they may then not share a block id.
    # (Cells, not pairs: a thousand groups naming one layer are one cell,
    # where their pairs would be half a million.)
    local_overlaps: tuple[str, ...] = ()
    remote_overlaps: tuple[str, ...] = ()
    local_shared: tuple[tuple[int, ...], ...] = ()
    remote_shared: tuple[tuple[int, ...], ...] = ()

    def side(self, side: Side) -> SideRows:
        return self.local if side is Side.LOCAL else self.remote

    def overlaps(self, side: Side) -> tuple[str, ...]:
        return self.local_overlaps if side is Side.LOCAL else self.remote_overlaps

    def shared(self, side: Side) -> tuple[tuple[int, ...], ...]:
        return self.local_shared if side is Side.LOCAL else self.remote_shared


@dataclass(frozen=True)
class _Placed:
    region: Region
    layer: LayerPlacement


@dataclass(frozen=True)
class _Pair:
    """One selected layer as each side places it."""

    local: _Placed
    remote: _Placed


class _MapIndex:
    """Layers of one map by transfer group and name, each region checked once."""

    def __init__(self, model: RegionMapModel, side: Side) -> None:
        self.model = model
        self.who = f"{side.value} worker {model.worker}"
        self.groups: dict[int, dict[str, _Placed]] = {}
        self._bases: dict[int, int] = {}
        for region in model.regions:
            if region.id in self._bases:
                raise FailedPrecondition(f"{self.who}: region id {region.id} appears twice")
            self._bases[region.id] = -1  # checked and filled by base()
            layers = self.groups.setdefault(region.transfer_group, {})
            for layer in region.layers:
                if layer.layer_name in layers:
                    raise FailedPrecondition(
                        f"{self.who}: layer {layer.layer_name!r} appears twice in "
                        f"transfer group {region.transfer_group}"
                    )
                layers[layer.layer_name] = _Placed(region, layer)

    def group(self, transfer_group: int) -> dict[str, _Placed]:
        layers = self.groups.get(transfer_group)
        if not layers:
            raise NotFound(f"transfer group {transfer_group} not in {self.who}")
        return layers

    def base(self, placed: _Placed) -> int:
        """Address of the region's block 0, after checking that every byte the
        region's layers describe lies inside its allocation: a peer's map is
        input, and a pull may touch only registered bytes."""
        region, layer = placed.region, placed.layer
        where = f"{self.who} region {region.id}"
        if not (layer.offset_in_region >= 0 and layer.len_bytes > 0) or (
            layer.offset_in_region + layer.len_bytes > region.block_len_bytes
        ):
            raise FailedPrecondition(
                f"{where}: layer {layer.layer_name!r} [{layer.offset_in_region}, "
                f"+{layer.len_bytes}) is outside the region's {region.block_len_bytes}-byte block"
            )
        if self._bases[region.id] >= 0:
            return self._bases[region.id]
        try:
            alloc = self.model.allocation(region.allocation_id)
        except KeyError:
            raise FailedPrecondition(
                f"{where}: allocation {region.allocation_id!r} is not in the map"
            ) from None
        end = region.offset_bytes + region.block_len_bytes
        end += max(region.num_blocks - 1, 0) * region.block_stride_bytes
        if (
            region.offset_bytes < 0
            or region.num_blocks < 0
            # Rows may not overlap; a one-block region has no next row (a
            # planner may merge one-block views whose stride is their length).
            or (region.num_blocks > 1 and region.block_len_bytes > region.block_stride_bytes)
            or end > alloc.size_bytes
            or alloc.base_address + alloc.size_bytes > _MAX_ADDRESS
        ):
            raise FailedPrecondition(
                f"{where}: {region.num_blocks} blocks of {region.block_len_bytes} bytes, "
                f"stride {region.block_stride_bytes}, at offset {region.offset_bytes} "
                f"do not fit allocation {alloc.id!r} of {alloc.size_bytes} bytes"
            )
        self._bases[region.id] = base = alloc.base_address + region.offset_bytes
        return base


def _selected_names(i: int, sel: LayerSelection, li: _MapIndex, ri: _MapIndex) -> list[str]:
    """The selection's layer names, each present on both sides."""
    g = sel.transfer_group
    local, remote = li.group(g), ri.group(g)
    if not sel.layer_names:
        # "Every layer of the group" must mean the same set on both sides, or
        # the two engines do not run the same model.
        for have, lack in ((li, ri), (ri, li)):
            for name in have.groups[g]:
                if name not in lack.groups[g]:
                    raise FailedPrecondition(
                        f"layer {name!r} of transfer group {g} is in {have.who} "
                        f"but not in {lack.who}"
                    )
        return list(local)
    seen: set[str] = set()
    for j, name in enumerate(sel.layer_names):
        field = f"groups[{i}].layer_names[{j}]"
        if name in seen:
            raise InvalidArgument(field, f"layer {name!r} is listed twice")
        seen.add(name)
        if name not in local:
            raise NotFound(f"{field}: layer {name!r} not in transfer group {g} of {li.who}")
        if name not in remote:
            raise FailedPrecondition(
                f"{field}: layer {name!r} of transfer group {g} is not in {ri.who}"
            )
    return list(sel.layer_names)


def _check_layer(lp: _Placed, rp: _Placed, li: _MapIndex, ri: _MapIndex) -> None:
    name, lk, rk = lp.layer.layer_name, lp.layer.cache_kind, rp.layer.cache_kind
    if lp.layer.len_bytes != rp.layer.len_bytes:
        raise FailedPrecondition(
            f"layer {name!r}: block length {lp.layer.len_bytes} bytes in {li.who} "
            f"vs {rp.layer.len_bytes} in {ri.who}"
        )
    if lk != rk:
        raise FailedPrecondition(
            f"layer {name!r}: cache kind {lk.name} in {li.who} vs {rk.name} in {ri.who}"
        )
    lt, rt = li.model.tp_size, ri.model.tp_size
    if lt != rt and not lk.replicated:
        # Each rank holds a different slice of the heads; equal block lengths
        # across TP sizes would only hide that the bytes mean different things.
        raise FailedPrecondition(
            f"layer {name!r}: {lk.name} is split by heads; tp_size {lt} vs {rt}"
        )
    li.base(lp)
    ri.base(rp)


def _follows(prev: _Placed, nxt: _Placed) -> bool:
    """``nxt`` starts where ``prev`` ends, in the same region's row."""
    return (
        nxt.region.id == prev.region.id
        and nxt.layer.offset_in_region == prev.layer.offset_in_region + prev.layer.len_bytes
    )


def _runs(i: int, sel: LayerSelection, li: _MapIndex, ri: _MapIndex) -> list[list[_Pair]]:
    """The selection's layers cut into pieces: each inner list is one piece."""
    lg, rg = li.group(sel.transfer_group), ri.group(sel.transfer_group)
    pairs = [_Pair(lg[n], rg[n]) for n in _selected_names(i, sel, li, ri)]
    for pair in pairs:
        _check_layer(pair.local, pair.remote, li, ri)
    pairs = _without_aliases(pairs, li, ri)
    # Walk the layers in local row order; a layer extends the current piece
    # when it follows it directly in the same region on both sides.
    pairs.sort(key=lambda p: (p.local.region.id, p.local.layer.offset_in_region))
    runs: list[list[_Pair]] = []
    for pair in pairs:
        last = runs[-1][-1] if runs else None
        if last and _follows(last.local, pair.local) and _follows(last.remote, pair.remote):
            runs[-1].append(pair)
            continue
        runs.append([pair])
    return runs


def _footprint(p: _Placed, idx: _MapIndex) -> tuple[int, int, int]:
    """(address in block 0, stride, length): the bytes a layer covers in
    every block, whichever region or allocation id names them."""
    return idx.base(p) + p.layer.offset_in_region, p.region.block_stride_bytes, p.layer.len_bytes


def _without_aliases(pairs: list[_Pair], li: _MapIndex, ri: _MapIndex) -> list[_Pair]:
    """The pairs with aliases dropped: vLLM registers layers that share one
    KV cache (same bytes) under several names, and "every layer" must move
    those bytes once, not once per name. A layer is an alias of an earlier
    one only when it covers the same bytes on *both* sides; aliases on one
    side only are left for ``transfer_plan`` to refuse where they would write
    a destination byte twice."""
    seen: set[tuple[tuple[int, int, int], tuple[int, int, int]]] = set()
    kept: list[_Pair] = []
    for pair in pairs:
        key = (_footprint(pair.local, li), _footprint(pair.remote, ri))
        if key not in seen:
            seen.add(key)
            kept.append(pair)
    return kept


def _piece(i: int, run: list[_Pair]) -> Piece:
    lp, rp = run[0].local, run[0].remote
    length = sum(p.local.layer.len_bytes for p in run)
    return Piece(
        selection=i,
        local_region_id=lp.region.id,
        local_offset=lp.layer.offset_in_region,
        remote_region_id=rp.region.id,
        remote_offset=rp.layer.offset_in_region,
        len_bytes=length,
        layer_names=tuple(p.local.layer.layer_name for p in run),
        # length <= block_len <= stride (for regions of 2+ blocks, the only
        # ones a run can span), so length == stride means the piece is the
        # whole row and the region is full_row.
        whole_row=length == lp.region.block_stride_bytes == rp.region.block_stride_bytes,
    )


def build_piece_table(
    local: RegionMapModel, remote: RegionMapModel, selections: Sequence[LayerSelection]
) -> PieceTable:
    """Pieces of each selection; ``selections[i]`` is the request's ``groups[i]``
    (its field paths name it so). Raises NotFound / InvalidArgument /
    FailedPrecondition before anything could be posted."""
    li, ri = _MapIndex(local, Side.LOCAL), _MapIndex(remote, Side.REMOTE)
    pieces: list[Piece] = []
    spans: list[tuple[int, int]] = []
    rows: dict[Side, list[tuple[int, int, int]]] = {Side.LOCAL: [], Side.REMOTE: []}
    limits: dict[Side, list[int]] = {Side.LOCAL: [], Side.REMOTE: []}
    for i, sel in enumerate(selections):
        runs = _runs(i, sel, li, ri)
        spans.append((len(pieces), len(pieces) + len(runs)))
        pieces.extend(_piece(i, run) for run in runs)
        for side, idx in ((Side.LOCAL, li), (Side.REMOTE, ri)):
            heads = [run[0].local if side is Side.LOCAL else run[0].remote for run in runs]
            rows[side].extend(
                (
                    idx.base(h) + h.layer.offset_in_region,
                    h.region.block_stride_bytes,
                    h.region.num_blocks,
                )
                for h in heads
            )
            limits[side].append(min(h.region.num_blocks for h in heads))
    overlaps = {side: _meetings(pieces, rows[side]) for side in (Side.LOCAL, Side.REMOTE)}
    return PieceTable(
        local_worker=local.worker,
        local_generation=local.generation,
        remote_worker=remote.worker,
        remote_generation=remote.generation,
        selections=tuple(selections),
        pieces=tuple(pieces),
        spans=tuple(spans),
        len_bytes=np.array([p.len_bytes for p in pieces], dtype=np.int64),
        whole_row=np.array([p.whole_row for p in pieces], dtype=np.bool_),
        local=_side_rows(rows[Side.LOCAL], li),
        remote=_side_rows(rows[Side.REMOTE], ri),
        local_limits=tuple(limits[Side.LOCAL]),
        remote_limits=tuple(limits[Side.REMOTE]),
        local_overlaps=overlaps[Side.LOCAL][0],
        remote_overlaps=overlaps[Side.REMOTE][0],
        local_shared=overlaps[Side.LOCAL][1],
        remote_shared=overlaps[Side.REMOTE][1],
    )


def _meetings(
    pieces: Sequence[Piece], rows: Sequence[tuple[int, int, int]]
) -> tuple[tuple[str, ...], tuple[tuple[int, ...], ...]]:
    """Which pieces of one side cover common bytes in the same block id:
    within a selection (named by two of their layers) and between
    selections (cells, see ``PieceTable``).

    Pieces of equal stride meet when their block-0 byte ranges meet; pieces
    of different strides lie in different row layouts (a planner never puts
    one layer's bytes in two), so they are not compared."""
    return _within_selections(pieces, rows), _shared_cells(pieces, rows)


def _within_selections(
    pieces: Sequence[Piece], rows: Sequence[tuple[int, int, int]]
) -> tuple[str, ...]:
    """Per selection, two of its layers whose pieces meet, or "": a sweep
    over each selection's ranges sorted by (stride, start), which keeps the
    pieces still open."""
    within = [""] * (max((p.selection for p in pieces), default=-1) + 1)
    by_selection: dict[int, list[int]] = {}
    for j in sorted(range(len(pieces)), key=lambda j: (rows[j][1], rows[j][0])):
        by_selection.setdefault(pieces[j].selection, []).append(j)
    for selection, order in by_selection.items():
        active: list[int] = []  # pieces of the current stride still open
        for j in order:
            addr, stride, _ = rows[j]
            ends = {a: rows[a][0] + pieces[a].len_bytes for a in active}
            active = [a for a in active if rows[a][1] == stride and ends[a] > addr]
            if active:
                within[selection] = (
                    f"layers {pieces[active[0]].layer_names[0]!r} and "
                    f"{pieces[j].layer_names[0]!r} cover common bytes"
                )
                break
            active.append(j)
    return tuple(within)


def _shared_cells(
    pieces: Sequence[Piece], rows: Sequence[tuple[int, int, int]]
) -> tuple[tuple[int, ...], ...]:
    """The cells of two or more selections: per stride, the pieces' ranges
    cut at every piece's start and end into elementary ranges, each with the
    selections whose pieces cover it. The work is the pieces' ranges counted
    in elementary ranges (at most the layers each selection names)."""
    by_stride: dict[int, list[int]] = {}
    for j, (_, stride, _) in enumerate(rows):
        by_stride.setdefault(stride, []).append(j)
    cells: set[tuple[int, ...]] = set()
    for members in by_stride.values():
        starts = np.array([rows[j][0] for j in members], dtype=np.int64)
        ends = starts + np.array([pieces[j].len_bytes for j in members], dtype=np.int64)
        edges = np.unique(np.concatenate((starts, ends)))
        first, stop = np.searchsorted(edges, starts), np.searchsorted(edges, ends)
        covering: dict[int, set[int]] = {}
        for j, lo, hi in zip(members, first.tolist(), stop.tolist(), strict=True):
            for elementary in range(lo, hi):
                covering.setdefault(elementary, set()).add(pieces[j].selection)
        cells.update(tuple(sorted(c)) for c in covering.values() if len(c) > 1)
    return tuple(sorted(cells))


def _side_rows(rows: list[tuple[int, int, int]], idx: _MapIndex) -> SideRows:
    arr = np.array(rows, dtype=np.int64).reshape(-1, 3)
    count = arr[:, 2].copy()
    first = np.zeros(len(rows), dtype=np.int64)
    np.cumsum(count[:-1], out=first[1:])
    if int(count.sum()) > MAX_PREPPED_DESCRIPTORS:
        raise FailedPrecondition(
            f"{idx.who}: the selected pieces have {int(count.sum())} blocks, "
            f"more than a prepared descriptor list can index ({MAX_PREPPED_DESCRIPTORS})"
        )
    return SideRows(addr=arr[:, 0].copy(), stride=arr[:, 1].copy(), count=count, first_index=first)
