"""Open grants, the pure part (``core.grants``): how a declared reader count
fixes an open grant's uses, how a fixed one refuses another count, and what
a released use spends; every input in range and out of it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmap.client.connector.tp_mapping import TpSplit
from kvmap.core import grants as core
from kvmap.core.errors import FailedPrecondition, InvalidArgument
from kvmap.core.geometry import WorkerKey
from kvmap.core.reshard import rank_heads, source_readers


def grant(max_uses: int, uses: int = 0) -> core.Grant:
    return core.Grant(
        digest=b"d" * 32,
        worker=WorkerKey("prefill", 0, 0, 0),
        generation=1,
        request_id="r",
        blocks={0: np.array([1, 2], dtype=np.int64)},
        expires_unix_ms=10,
        max_uses=max_uses,
        uses=uses,
    )


READERS = st.integers(min_value=-(2**33), max_value=2**33)
IN_RANGE = st.integers(min_value=0, max_value=core.MAX_USES)


@given(readers=READERS)
def test_an_open_grant_takes_the_declared_count(readers: int) -> None:
    """An open grant: a declared count in [1, 64] becomes its use count, none (0) makes it 1,
    anything else is INVALID_ARGUMENT; no use is spent by declaring."""
    g = grant(core.OPEN_USES)
    assert g.open and not g.exhausted
    if not 0 <= readers <= core.MAX_USES:
        with pytest.raises(InvalidArgument, match="readers"):
            core.declare_readers(g, readers)
        return
    fixed = core.declare_readers(g, readers)
    assert (fixed.max_uses, fixed.uses, fixed.open) == (readers or 1, 0, False)


@given(max_uses=st.integers(min_value=1, max_value=core.MAX_USES), readers=IN_RANGE)
def test_a_fixed_grant_refuses_another_count(max_uses: int, readers: int) -> None:
    """A fixed grant admits a claim declaring nothing or its own count, unchanged; another
    count is FAILED_PRECONDITION naming both."""
    g = grant(max_uses)
    if readers in (0, max_uses):
        assert core.declare_readers(g, readers) == g
    else:
        with pytest.raises(FailedPrecondition, match=f"admits {max_uses} readers"):
            core.declare_readers(g, readers)


# Rank 1 of 2 of a replicated (MLA) cache: a decode engine of TP 1 reads it not
# at all, and at most 32 decode ranks (of 64) read it.
UNREAD = core.ReaderLayout(tp_size=2, tp_rank=1)


@given(max_uses=st.integers(min_value=0, max_value=core.MAX_USES), readers=IN_RANGE)
def test_a_release_spends_one_use(max_uses: int, readers: int) -> None:
    """A release spends one use of the count it declares; declaring no reader uses up an
    open grant of a rank its layout lets go unread at once and is refused by a fixed one;
    an open grant refuses more readers than its layout has."""
    g = grant(max_uses)
    if readers == 0 and not g.open:
        with pytest.raises(FailedPrecondition, match="declared none"):
            core.release_use(g, readers, UNREAD)
        return
    if readers and not g.open and readers != max_uses:
        with pytest.raises(FailedPrecondition):
            core.release_use(g, readers, UNREAD)
        return
    if g.open and readers > UNREAD.max_readers:
        with pytest.raises(FailedPrecondition, match="read by at most 32 decode ranks"):
            core.release_use(g, readers, UNREAD)
        return
    after = core.release_use(g, readers, UNREAD)
    assert after.uses == 1
    assert after.max_uses == (readers or 1 if g.open else max_uses)
    assert after.exhausted == (after.max_uses == 1)


def test_grant_uses_of_an_open_grant() -> None:
    """open_uses needs max_uses 0 (stored as OPEN_USES); without it max_uses is as before."""
    assert core.check_grant_uses(0, True) == core.OPEN_USES
    assert core.check_grant_uses(0, False) == 1
    assert core.check_grant_uses(5, False) == 5
    with pytest.raises(InvalidArgument, match="must be 0 for an open grant"):
        core.check_grant_uses(2, True)
    assert grant(2, 2).exhausted and not grant(2, 1).exhausted


@given(tp_size=st.integers(min_value=1, max_value=core.MAX_USES), readers=IN_RANGE)
def test_an_open_grant_admits_no_more_readers_than_its_layout_has(
    tp_size: int, readers: int
) -> None:
    """A first claim of an open grant declaring more readers than ceil(64 / tp_size) (what
    64 decode ranks spread over tp_size prefill ranks give one rank) is FAILED_PRECONDITION;
    up to that it fixes the count. A fixed grant's own count is the worker's word and stands."""
    layout = core.ReaderLayout(tp_size=tp_size)
    most = -(-core.MAX_USES // tp_size)
    if readers > most:
        with pytest.raises(FailedPrecondition, match=f"read by at most {most} decode ranks"):
            core.declare_readers(grant(0), readers, layout)
    else:
        assert core.declare_readers(grant(0), readers, layout).max_uses == (readers or 1)
    assert core.declare_readers(grant(core.MAX_USES), 0, layout).max_uses == core.MAX_USES


def test_the_layout_bounds_cover_every_reader_count_resharding_gives() -> None:
    """For every prefill TP size, decode TP size and KV head count that split evenly, no
    prefill rank is read by more decode ranks (``reshard.source_readers``) than its layout's
    ``max_readers``, and a rank read by none is one whose layout ``may_go_unread``: a
    legitimate decode is never refused."""
    for src in range(1, core.MAX_USES + 1):
        most = core.ReaderLayout(tp_size=src).max_readers
        for dst in range(1, core.MAX_USES + 1):
            for heads in (0, 1, 2, 4, 8, 16, 64, 3, 6, 24):
                counts = _readers_or_none(heads, src, dst)
                if counts is None:
                    continue
                assert max(counts) <= most, (src, dst, heads, counts)
                for rank in (r for r, n in enumerate(counts) if n == 0):
                    layout = core.ReaderLayout(tp_size=src, tp_rank=rank, kv_heads=heads)
                    assert layout.may_go_unread, (src, dst, heads, rank)


def _readers_or_none(heads: int, src: int, dst: int) -> tuple[int, ...] | None:
    """``source_readers`` for sizes the heads split over evenly on both sides (None else)."""
    try:
        if heads:
            rank_heads(heads, src, 0)
            rank_heads(heads, dst, 0)
        return source_readers(heads, src, dst, replicated=not heads)
    except FailedPrecondition:
        return None


def test_only_a_rank_past_the_first_holding_replicas_may_go_unread() -> None:
    """Rank 0 is read by every decode engine (decode rank 0 reads it) and a rank of a
    head-split cache holding heads of its own (no more ranks than heads) by some decode rank:
    a readers-0 release of their open grants is FAILED_PRECONDITION and spends nothing.
    Replicated caches and replicated heads (8 ranks, 2 heads) past rank 0 may go unread."""
    assert core.ReaderLayout(tp_size=2, tp_rank=1).may_go_unread
    assert core.ReaderLayout(tp_size=8, tp_rank=4, kv_heads=2).may_go_unread
    for layout in (
        core.ReaderLayout(tp_size=2, tp_rank=0),
        core.ReaderLayout(tp_size=1, tp_rank=0),
        core.ReaderLayout(tp_size=8, tp_rank=0, kv_heads=2),
        core.ReaderLayout(tp_size=4, tp_rank=3, kv_heads=8),
        core.ReaderLayout(tp_size=4, tp_rank=3, kv_heads=4),
    ):
        assert not layout.may_go_unread
        with pytest.raises(FailedPrecondition, match="read by every decode engine"):
            core.release_use(grant(0), 0, layout)


# The worker's word on an unread release (GrantTransferRequest.unread_release) ------------------

LAYOUTS = st.builds(
    lambda tp, rank, heads: core.ReaderLayout(tp_size=tp, tp_rank=rank % tp, kv_heads=heads),
    st.integers(min_value=1, max_value=core.MAX_USES),
    st.integers(min_value=0, max_value=core.MAX_USES - 1),
    st.sampled_from([0, 1, 2, 4, 8, 16, 64]),
)


@given(
    choice=st.sampled_from(core.UnreadRelease),
    layout=LAYOUTS,
    max_uses=st.sampled_from([core.OPEN_USES, 1, 2]),
)
def test_an_unread_release_needs_the_workers_word_and_its_layout(
    choice: core.UnreadRelease, layout: core.ReaderLayout, max_uses: int
) -> None:
    """A release declaring no readers uses the grant up exactly when the grant is open, its
    worker did not say REFUSED, and its layout lets the rank go unread: ALLOWED and
    UNSPECIFIED both leave the last word to the layout. Anything else is FAILED_PRECONDITION;
    a REFUSED grant's refusal says it is the worker's word."""
    g = replace(grant(max_uses), unread_release=choice)
    if g.open and choice is not core.UnreadRelease.REFUSED and layout.may_go_unread:
        after = core.release_use(g, 0, layout)
        assert (after.max_uses, after.uses, after.exhausted) == (1, 1, True)
        assert after.unread_release is choice
        return
    why = "declared none" if not g.open else "said every decode" if choice == 2 else "every"
    with pytest.raises(FailedPrecondition, match=why):
        core.release_use(g, 0, layout)


def test_refused_leaves_a_release_declaring_readers_as_it_was() -> None:
    """REFUSED is about releases declaring no readers only: a release declaring one reader of
    an open grant still fixes its count and spends a use."""
    g = replace(grant(core.OPEN_USES), unread_release=core.UnreadRelease.REFUSED)
    after = core.release_use(g, 1, UNREAD)
    assert (after.max_uses, after.uses, after.unread_release) == (1, 1, g.unread_release)


@given(value=st.integers(min_value=-(2**31), max_value=2**31 - 1), open_uses=st.booleans())
def test_a_grant_request_says_a_known_unread_release(value: int, open_uses: bool) -> None:
    """The wire's unread_release: UNSPECIFIED, ALLOWED and REFUSED are taken, ALLOWED only for
    an open grant (no other can be released unread); any other value is INVALID_ARGUMENT
    naming the field (protobuf passes on enum values it does not know)."""
    if value not in (0, 1, 2) or (value == 1 and not open_uses):
        with pytest.raises(InvalidArgument, match="unread_release"):
            core.check_unread_release(value, open_uses)
    else:
        assert core.check_unread_release(value, open_uses) == value


def test_the_connector_allows_an_unread_release_exactly_where_a_decode_may_read_nothing() -> None:
    """The prefill connector's word per rank (``TpSplit.unread_allowed``): for every prefill
    and decode TP size and head count that split evenly, a rank no decode rank reads is
    ALLOWED (a legitimate release is never refused), and every ALLOWED rank is one the
    daemon's layout rule lets go unread too (the two agree). A model mixing MLA with head-split
    layers (no head count, not replicated) allows none."""
    for src in range(1, 17):
        for heads in (0, 1, 2, 4, 8, 3, 6):
            allowed = TpSplit(heads, replicated=not heads).unread_allowed(src)
            for rank, ok in enumerate(allowed):
                layout = core.ReaderLayout(tp_size=src, tp_rank=rank, kv_heads=heads)
                assert not ok or layout.may_go_unread, (src, heads, rank)
            for dst in range(1, 17):
                counts = _readers_or_none(heads, src, dst)
                for rank in (r for r, n in enumerate(counts or ()) if n == 0):
                    assert allowed[rank], (src, dst, heads, rank)
    assert TpSplit(0, replicated=False).unread_allowed(4) == (False,) * 4
