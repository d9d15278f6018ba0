"""``tp_mapping.TpSplit``: the one rule of which decode ranks read which
prefill ranks, as the prefill grants, the decode pulls and push mode's
writes all use it, for head-split, replicated (MLA, indexer) and mixed
models."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmap.client.connector import ConnectorOptions, SchedulerCore
from kvmap.client.connector.tp_mapping import TpSplit, tp_readers
from kvmap.core.reshard import source_ranks
from kvmap.v1 import types_pb2

MHA, MLA, INDEXER = (
    types_pb2.CACHE_KIND_MHA,
    types_pb2.CACHE_KIND_MLA,
    types_pb2.CACHE_KIND_INDEXER,
)
POW2 = st.sampled_from([1, 2, 4, 8, 16])


def test_a_model_split_from_what_its_engine_reports() -> None:
    """An MLA model has no head count and is replicated when every layer is MLA or indexer;
    a head-split model keeps its KV heads; a model mixing MLA with head-split layers has
    neither, and moves only between equal TP sizes."""
    assert TpSplit.of_model(use_mla=True, total_kv_heads=1, cache_kinds=[MLA, INDEXER]) == (
        TpSplit(0, replicated=True)
    )
    assert TpSplit.of_model(use_mla=False, total_kv_heads=8, cache_kinds=[MHA]) == TpSplit(8)
    mixed = TpSplit.of_model(use_mla=True, total_kv_heads=1, cache_kinds=[MLA, MHA])
    assert mixed == TpSplit(0) and not mixed.resizable
    assert not TpSplit.of_model(use_mla=True, total_kv_heads=1, cache_kinds=[]).replicated


def test_a_mixed_model_needs_equal_tp_sizes() -> None:
    """A model with no head count that is not all replicated (MLA mixed with head-split
    layers) is refused at start-up when told of decode engines of another TP size; its own
    size, no size, a head-split model and an all-MLA model are accepted."""
    with pytest.raises(ValueError, match="mixing MLA with head-split attention layers"):
        SchedulerCore("e", ConnectorOptions(decode_tp_size=2), tp_size=1)
    with pytest.raises(ValueError, match="mixing MLA with head-split attention layers"):
        TpSplit(0).sources(1, 2, 0)
    SchedulerCore("e", ConnectorOptions(decode_tp_size=2), tp_size=2)
    SchedulerCore("e", ConnectorOptions(), tp_size=1)
    SchedulerCore("e", ConnectorOptions(decode_tp_size=2), tp_size=1, kv_heads=8)
    SchedulerCore("e", ConnectorOptions(decode_tp_size=2), tp_size=1, replicated=True)
    assert TpSplit(0).sources(2, 2, 1) == [1]  # equal sizes: rank r reads rank r


def test_sizes_the_heads_do_not_split_over_are_refused_on_both_sides() -> None:
    """Six heads split over neither 4 nor 5 ranks, whichever side the size is on: a
    ValueError, never a rank out of range."""
    for src, dst in ((4, 2), (2, 4), (1, 5)):
        with pytest.raises(ValueError, match="do not split evenly"):
            TpSplit(6).sources(src, dst, 0)
        with pytest.raises(ValueError, match="do not split evenly"):
            TpSplit(6).readers(src, dst)


@given(heads=POW2, p_tp=POW2, d_tp=POW2, replicated=st.booleans())
def test_sources_readers_and_destinations_are_one_mapping(
    heads: int, p_tp: int, d_tp: int, replicated: bool
) -> None:
    """For any power-of-two sizes: the prefill ranks each decode rank reads are the core's
    ``source_ranks``; each prefill rank's destinations are exactly the decode ranks that read
    it and its reader count is their number; the prefill side's grants (``tp_readers``) count
    the same wherever they accept the sizes."""
    split = TpSplit(heads, replicated)
    sources = [split.sources(p_tp, d_tp, d) for d in range(d_tp)]
    if p_tp != d_tp:
        assert sources == [
            [s for s, _ in source_ranks(heads, p_tp, d_tp, d, replicated=replicated)]
            for d in range(d_tp)
        ]
    readers = split.readers(p_tp, d_tp)
    for p in range(p_tp):
        read_by = {d for d in range(d_tp) if p in sources[d]}
        assert split.destinations(p_tp, d_tp, p) == read_by
        assert readers[p] == len(read_by)
    if replicated or 0 not in readers:
        assert tp_readers(heads, p_tp, d_tp, replicated=replicated) == readers
    else:
        with pytest.raises(ValueError, match="holds no heads"):
            tp_readers(heads, p_tp, d_tp, replicated=replicated)


def test_a_replicated_cache_is_read_from_one_rank_and_some_ranks_may_go_unread() -> None:
    """MLA between 4 prefill and 2 decode ranks: decode rank d reads prefill rank d alone,
    ranks 2 and 3 are read by no one (granted nothing), and an open grant may be released
    unread on every rank but 0; a mixed model allows none."""
    split = TpSplit(replicated=True)
    assert [split.sources(4, 2, d) for d in range(2)] == [[0], [1]]
    assert split.readers(4, 2) == (1, 1, 0, 0)
    assert split.unread_allowed(4) == (False, True, True, True)
    assert TpSplit(0).unread_allowed(4) == (False,) * 4
