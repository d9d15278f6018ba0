"""Where pieces of a transfer's selections meet, and the first block two
meeting groups would both write: the cell form (``_meetings``' cells,
``_first_shared_write``) against the pairwise definition it replaced, which
swept every pair of pieces and listed every pair of meeting selections
(quadratic in the groups: a thousand groups naming one layer were half a
million pairs and a second of planning)."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from kvmap.core.transfer_pieces import Piece, _meetings
from kvmap.core.transfer_plan import _first_shared_write

Row = tuple[int, int, int]


def _piece(selection: int, length: int, name: str) -> Piece:
    return Piece(selection, 0, 0, 0, 0, length, (name,), False)


def _pairwise(pieces: list[Piece], rows: list[Row]) -> tuple[tuple[str, ...], set[tuple[int, int]]]:
    """The definition: a sweep over all pieces sorted by (stride, start),
    comparing each with every piece still open."""
    within = [""] * (max((p.selection for p in pieces), default=-1) + 1)
    between: set[tuple[int, int]] = set()
    active: list[int] = []
    for j in sorted(range(len(pieces)), key=lambda j: (rows[j][1], rows[j][0])):
        addr, stride, _ = rows[j]
        active = [
            a for a in active if rows[a][1] == stride and rows[a][0] + pieces[a].len_bytes > addr
        ]
        for a in active:
            si, sj = pieces[a].selection, pieces[j].selection
            if si == sj and not within[si]:
                within[si] = (
                    f"layers {pieces[a].layer_names[0]!r} and {pieces[j].layer_names[0]!r} "
                    "cover common bytes"
                )
            elif si != sj:
                between.add((min(si, sj), max(si, sj)))
        active.append(j)
    return tuple(within), between


def _first_pairwise(pairs: set[tuple[int, int]], dests: list[np.ndarray]) -> tuple[int, int] | None:
    for i in range(len(dests)):
        for k in range(i):
            if (k, i) in pairs and np.isin(dests[i], dests[k]).any():
                return i, k
    return None


@st.composite
def layouts(draw: st.DrawFn) -> tuple[list[Piece], list[Row], list[np.ndarray]]:
    """Pieces of a few selections in two row layouts, their ranges drawn
    from a small space (so that they meet often), and each group's block ids."""
    selections = draw(st.integers(1, 7))
    pieces: list[Piece] = []
    rows: list[Row] = []
    for s in range(selections):
        for n in range(draw(st.integers(1, 4))):
            start, length = draw(st.integers(0, 40)), draw(st.integers(1, 16))
            pieces.append(_piece(s, length, f"s{s}l{n}"))
            rows.append((start, draw(st.sampled_from([64, 128])), 8))
    ids = st.lists(st.integers(0, 9), max_size=4).map(lambda b: np.array(b, dtype=np.int64))
    dests = [draw(ids) for _ in range(selections)]
    return pieces, rows, dests


@settings(max_examples=examples(500), deadline=None)
@given(layouts())
def test_cells_say_what_the_pairwise_sweep_said(
    layout: tuple[list[Piece], list[Row], list[np.ndarray]],
) -> None:
    """Same layers named within each selection; two selections share a cell
    exactly when a pair of their pieces meets; the same first (group, earlier
    group) writing one block twice."""
    pieces, rows, dests = layout
    within, cells = _meetings(pieces, rows)
    want_within, want_pairs = _pairwise(pieces, rows)
    assert within == want_within
    pairs = {pair for cell in cells for pair in itertools.combinations(cell, 2)}
    assert pairs == want_pairs
    assert all(len(cell) >= 2 and list(cell) == sorted(set(cell)) for cell in cells)
    assert _first_shared_write(cells, dests) == _first_pairwise(want_pairs, dests)


def test_a_thousand_groups_on_one_layer_are_one_cell() -> None:
    """The case that was quadratic: every group names the same layer (one
    range), so one cell holds them all; the first group to repeat an earlier
    one's block is found."""
    pieces = [_piece(s, 100, "m0") for s in range(1000)]
    rows = [(0, 512, 32)] * 1000
    within, cells = _meetings(pieces, rows)
    assert within == ("",) * 1000
    assert cells == (tuple(range(1000)),)
    dests = [np.array([s], dtype=np.int64) for s in range(1000)]
    assert _first_shared_write(cells, dests) is None
    dests[700] = np.array([5, 123], dtype=np.int64)
    assert _first_shared_write(cells, dests) == (700, 5)
