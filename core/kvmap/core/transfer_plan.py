"""Transfer planning: (piece table, block-id pairs) -> matched NIXL descriptors.

Pure and numpy-vectorised: a 128K-token request on a GLM-5.3 rank (2,048
blocks x up to 101 pieces, ~200K descriptors) plans in milliseconds.

Output, for the NIXL shell:

* ``piece_dlist_rows(table, side, dev_id)`` once per piece table: an Nx5
  strided list ``(addr, len, dev_id, stride, count)`` for
  ``prep_xfer_dlist(..., mem_type=...)``; NIXL expands row ``p`` to ``count``
  descriptors, so descriptor ``first_index[p] + b`` is block ``b`` of piece
  ``p``. The local list is prepared for ``NIXL_INIT_AGENT``, the remote list
  for the remote agent's name.
* ``plan_transfer(table, groups)`` per request: ``local_indices`` /
  ``remote_indices`` for one ``make_prepped_xfer`` against those lists. A run
  of consecutive block pairs of a whole-row piece is a run of consecutive
  index pairs whose descriptors are contiguous on both sides: NIXL merges
  them into one descriptor as it makes the transfer (``merged`` counts the
  pairs it folds), so a pull is one NIXL transfer. ``runs`` (explicit
  descriptors, which ``run_dlist_rows`` turns into the Nx3 lists
  ``get_xfer_descs`` / ``initialize_xfer`` take) are token-mode plans' only.

Block ids are validated before anything is posted, against every region the
selection's pieces touch on each side. The block limit per transfer is an
INVALID_ARGUMENT, not RESOURCE_EXHAUSTED: it is a property of the request
alone and retrying the same request can never succeed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvmap.core.errors import InvalidArgument
from kvmap.core.transfer_pieces import Int64Array, PieceTable, Side

# A 1M-token request at 16 tokens per block; bounds the index arrays a single
# request can make the daemon build (x pieces x 4 bytes each).
MAX_BLOCKS_PER_TRANSFER = 1 << 16
# Groups in one request: a few per worker (MLA, indexer), or one per layer
# selection. Each is planned (and its pieces prepared and cached), so even a
# request of few blocks may not name groups without bound.
MAX_GROUPS_PER_TRANSFER = 1024

Int32Array = npt.NDArray[np.int32]
# 2**63: no int64 is this large, every negative one is as uint64.
_INT64_LIMIT = 1 << 63
# Block counts up to which a repeat is looked for in a bitmap (a byte each).
_BITMAP_BLOCKS = 1 << 16


@dataclass(frozen=True, eq=False)
class GroupPairs:
    """Block pairs of one request group (wire ``GroupBlocks``):
    ``local_block_ids[i] <-> remote_block_ids[i]``."""

    transfer_group: int
    local_block_ids: Sequence[int] | Int64Array
    remote_block_ids: Sequence[int] | Int64Array


@dataclass(frozen=True, eq=False)
class TransferPlan:
    # Pairs of descriptors of the prepared lists, one block of one piece each.
    local_indices: Int32Array
    remote_indices: Int32Array
    # Explicit descriptors (local_addr, remote_addr, len): token-mode plans.
    runs: Int64Array
    blocks: int
    bytes: int
    # Index pairs NIXL folds into the pair before them when it makes the
    # transfer (make_prepped_xfer merges descriptors that are adjacent in
    # the index arrays and contiguous on both sides): the second and later
    # blocks of each run of consecutive block pairs of a whole-row piece.
    merged: int = 0

    @property
    def descriptors(self) -> int:
        """Descriptors NIXL posts."""
        return len(self.local_indices) + len(self.runs) - self.merged


def piece_dlist_rows(table: PieceTable, side: Side, dev_id: int) -> Int64Array:
    """Nx5 ``(addr, len, dev_id, stride, count)``: one strided row per piece."""
    rows = table.side(side)
    return np.stack(
        [rows.addr, table.len_bytes, np.full_like(rows.addr, dev_id), rows.stride, rows.count],
        axis=1,
    )


def first_index(table: PieceTable, side: Side) -> Int64Array:
    """Index of block 0 of each piece in that side's prepared list."""
    return table.side(side).first_index


def run_dlist_rows(plan: TransferPlan, side: Side, dev_id: int) -> Int64Array:
    """Nx3 ``(addr, len, dev_id)`` of ``plan.runs`` on one side; row i of the
    local list pairs with row i of the remote list."""
    addr = plan.runs[:, 0 if side is Side.LOCAL else 1]
    return np.stack([addr, plan.runs[:, 2], np.full_like(addr, dev_id)], axis=1)


def block_ids(values: Sequence[int]) -> Int64Array:
    """Wire block ids (a repeated int64 field) as a 1-D int64 array: upb's
    container hands numpy its values in one copy, where a list of Python
    ints, converted later, costs tens of microseconds per thousand ids."""
    return np.array(values, dtype=np.int64).reshape(-1)


def _ids(values: Sequence[int] | Int64Array) -> Int64Array:
    if isinstance(values, np.ndarray) and values.dtype == np.int64 and values.ndim == 1:
        return values  # as the daemon parses the wire ids: nothing to convert
    return np.asarray(values, dtype=np.int64).reshape(-1)


def _check_range(field: str, ids: Int64Array, limit: int) -> None:
    # One pass for the usual request, all in range: as unsigned, a negative
    # id is at least 2**63, above every limit an int64 block count can be.
    # Only a refused request is searched for its first offender.
    if not ids.size or (limit <= _INT64_LIMIT and int(ids.view(np.uint64).max()) < limit):
        return
    bad = np.flatnonzero((ids < 0) | (ids >= limit))
    if bad.size:
        j = int(bad[0])
        raise InvalidArgument(f"{field}[{j}]", f"block {ids[j]} out of range [0, {limit})")


def _repeats(ids: Int64Array, limit: int) -> bool:
    """Whether any of ``ids``, all in ``[0, limit)``, repeats: a bitmap of
    the blocks where that is small next to the ids (a few microseconds for
    thousands), else a sort (still half an argsort)."""
    if limit <= max(_BITMAP_BLOCKS, 16 * len(ids)):
        seen = np.zeros(limit, dtype=np.bool_)
        seen[ids] = True
        return int(np.count_nonzero(seen)) != len(ids)
    sorted_ids = np.sort(ids)
    return bool((sorted_ids[1:] == sorted_ids[:-1]).any())


def _first_repeat(ids: Int64Array, limit: int) -> tuple[int, int] | None:
    """(later, earlier) positions of the first repeated id, or None; ``ids``
    lie in ``[0, limit)``. Only a refused request pays for finding which."""
    if not _repeats(ids, limit):
        return None
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    dup = np.flatnonzero(sorted_ids[1:] == sorted_ids[:-1]) + 1
    if not dup.size:
        return None
    # A stable sort keeps equal ids in input order: order[t - 1] < order[t].
    t = int(dup[np.argmin(order[dup])])
    return int(order[t]), int(order[t - 1])


def check_group_count(count: int) -> None:
    if count > MAX_GROUPS_PER_TRANSFER:
        raise InvalidArgument(
            "groups", f"{count} transfer groups exceed the limit of {MAX_GROUPS_PER_TRANSFER}"
        )


def check_sizes(groups: Sequence[GroupPairs]) -> None:
    """The limits that need no region map, checked before anything is
    planned, prepared or cached for a request."""
    check_group_count(len(groups))
    total = sum(len(g.local_block_ids) for g in groups)
    if total > MAX_BLOCKS_PER_TRANSFER:
        raise InvalidArgument(
            "groups", f"{total} block pairs exceed the limit of {MAX_BLOCKS_PER_TRANSFER}"
        )
    for i, g in enumerate(groups):
        if len(g.remote_block_ids) != len(g.local_block_ids):
            raise InvalidArgument(
                f"groups[{i}].remote_block_ids",
                f"{len(g.remote_block_ids)} ids for {len(g.local_block_ids)} local ids",
            )


def _validate(
    table: PieceTable, groups: Sequence[GroupPairs], destination: Side
) -> list[tuple[Int64Array, Int64Array]]:
    if len(groups) != len(table.selections) or any(
        g.transfer_group != s.transfer_group for g, s in zip(groups, table.selections, strict=False)
    ):
        # The caller builds the table from the same request groups; a mismatch
        # is a bug in the daemon, not bad input.
        raise ValueError("groups do not match the piece table's selections")
    check_sizes(groups)
    out: list[tuple[Int64Array, Int64Array]] = []
    for i, g in enumerate(groups):
        local, remote = _ids(g.local_block_ids), _ids(g.remote_block_ids)
        if len(remote) != len(local):
            raise InvalidArgument(
                f"groups[{i}].remote_block_ids", f"{len(remote)} ids for {len(local)} local ids"
            )
        _check_range(f"groups[{i}].local_block_ids", local, table.local_limits[i])
        _check_range(f"groups[{i}].remote_block_ids", remote, table.remote_limits[i])
        out.append((local, remote))
    _check_destination(table, groups, out, destination)
    return out


def _check_destination(
    table: PieceTable,
    groups: Sequence[GroupPairs],
    ids: list[tuple[Int64Array, Int64Array]],
    destination: Side,
) -> None:
    """No destination byte may be written twice: a block id repeated within a
    group, two layers of a group covering common bytes (aliased on the
    destination but not the source, or partly overlapping), or a block id
    shared by two groups whose layers cover common bytes, would race."""
    which = 0 if destination is Side.LOCAL else 1
    name = f"{destination.value}_block_ids"
    # _validate checked each destination id against these.
    limits = table.local_limits if destination is Side.LOCAL else table.remote_limits
    overlaps = table.overlaps(destination)
    dests = [pair[which] for pair in ids]
    shared = _first_shared_write(table.shared(destination), dests)
    for i in range(len(groups)):
        dest = ids[i][which]
        if overlaps and overlaps[i] and dest.size:
            raise InvalidArgument(
                f"groups[{i}].layer_names",
                f"{overlaps[i]} on the {destination.value} side: each block would be written twice",
            )
        repeat = _first_repeat(dest, limits[i])
        if repeat:
            later, earlier = repeat
            raise InvalidArgument(
                f"groups[{i}].{name}[{later}]",
                f"block {dest[later]} repeats groups[{i}].{name}[{earlier}]; "
                "one destination block would be written twice",
            )
        if shared is not None and shared[0] == i:
            k = shared[1]
            j = int(np.flatnonzero(np.isin(dest, dests[k]))[0])
            raise InvalidArgument(
                f"groups[{i}].{name}[{j}]",
                f"block {dest[j]} is also written by groups[{k}] for the same layers",
            )


def _first_shared_write(
    cells: Sequence[tuple[int, ...]], dests: Sequence[Int64Array]
) -> tuple[int, int] | None:
    """(i, k): the first group i that writes a block some group k < i writes
    too while a cell holds both (their layers cover common bytes), with the
    first such k; None when there is none. Per cell, its groups' ids sorted
    by (block, group): a block's run that holds a group other than its first
    is written twice."""
    first_i: int | None = None
    for cell in cells:
        blocks = np.concatenate([dests[g] for g in cell])
        groups = np.concatenate([np.full(dests[g].size, g, dtype=np.int64) for g in cell])
        order = np.lexsort((groups, blocks))
        blocks, groups = blocks[order], groups[order]
        starts = np.flatnonzero(np.r_[True, blocks[1:] != blocks[:-1]]) if blocks.size else blocks
        runs_first = np.repeat(groups[starts], np.diff(np.r_[starts, blocks.size]))
        later = groups[groups != runs_first]
        if later.size and (first_i is None or int(later.min()) < first_i):
            first_i = int(later.min())
    if first_i is None:
        return None
    partners = {g for cell in cells if first_i in cell for g in cell if g < first_i}
    k = min(g for g in partners if np.isin(dests[first_i], dests[g]).any())
    return first_i, k


def _group_descriptors(
    table: PieceTable, pieces: Int64Array, lids: Int64Array, rids: Int64Array
) -> tuple[Int64Array, Int64Array, int]:
    """(local indices, remote indices, pairs NIXL merges) moving one request
    group's ``pieces`` (a span of ``table``) for every block pair
    ``(lids[k], rids[k])``: piece by piece, each piece's blocks in pair
    order, so that a run of pairs ``(lb, rb), (lb+1, rb+1), ...`` of a
    whole-row piece (contiguous on both sides) is a run of adjacent
    descriptors, which NIXL posts as one."""
    li = np.add.outer(table.local.first_index[pieces], lids).ravel()
    ri = np.add.outer(table.remote.first_index[pieces], rids).ravel()
    whole = int(np.count_nonzero(table.whole_row[pieces]))
    if not whole:
        return li, ri, 0
    follows = int(np.count_nonzero((lids[1:] - lids[:-1] == 1) & (rids[1:] - rids[:-1] == 1)))
    return li, ri, whole * follows


def plan_transfer(
    table: PieceTable,
    groups: Sequence[GroupPairs],
    *,
    destination: Side = Side.LOCAL,
) -> TransferPlan:
    """Matched descriptors moving, for every ``groups[i]`` pair ``(lb, rb)`` and
    every selected layer, the layer's local block ``lb`` <-> remote block ``rb``.

    ``groups[i]`` must be the request group ``table.selections[i]`` was built
    from. ``destination`` is the side written (LOCAL for a pull / READ, REMOTE
    for a push / WRITE): its block ids must not repeat. Every descriptor is
    an index pair, so one prepped transfer carries the plan.
    """
    pairs = _validate(table, groups, destination)
    li: list[Int64Array] = []
    ri: list[Int64Array] = []
    blocks = nbytes = merged = 0
    for (start, stop), (lids, rids) in zip(table.spans, pairs, strict=True):
        n = len(lids)
        blocks += n
        nbytes += n * int(table.len_bytes[start:stop].sum())
        if n:
            local, remote, folded = _group_descriptors(table, np.arange(start, stop), lids, rids)
            li.append(local)
            ri.append(remote)
            merged += folded
    empty = np.zeros(0, dtype=np.int64)
    return TransferPlan(
        local_indices=np.concatenate([empty, *li]).astype(np.int32),
        remote_indices=np.concatenate([empty, *ri]).astype(np.int32),
        runs=np.zeros((0, 3), dtype=np.int64),
        blocks=blocks,
        bytes=nbytes,
        merged=merged,
    )
