"""The prefill side's push specs, pure (kvmap.client.connector.pushes): layer
groups cut the layers into contiguous, balanced, covering groups; a push is
the pull a decode rank would make, turned around; the decode ranks a prefill
rank writes are exactly the ones that would read it; the uses a grant admits
are every writer's layer groups."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmap.client.connector import ConnectorOptions
from kvmap.client.connector.metadata import PushSendTask
from kvmap.client.connector.pushes import (
    PrefillRank,
    decode_ranks_written,
    layer_groups,
    layer_pushes,
    push_spec,
    uses_per_writer,
    writers_of,
)
from kvmap.client.connector.tp_mapping import TpSplit
from kvmap.core.push_offers import Offer, OfferedGroup
from kvmap.core.reshard import source_ranks
from kvmap.v1 import registry_pb2, types_pb2

FEATURES = frozenset(
    {registry_pb2.DAEMON_FEATURE_TOKEN_MODE, registry_pb2.DAEMON_FEATURE_REMOTE_FIRST_TOKEN,
     registry_pb2.DAEMON_FEATURE_OPEN_GRANTS}
)  # fmt: skip
OPTIONS = ConnectorOptions(socket="/unused", transfer_timeout_s=5.0)


def rank(tp: int, r: int = 0, block: int = 16, heads: int = 4) -> PrefillRank:
    worker = types_pb2.WorkerId(engine_id="prefill", tp_rank=r)
    return PrefillRank(worker, tp, block, TpSplit(heads), features=lambda: FEATURES)


def offer(d_rank: int, d_tp: int, blocks: tuple[int, ...], *, block: int = 16, first: int = 0,
          tokens: int = 40) -> Offer:  # fmt: skip
    return Offer(
        push_id="x" * 24,
        prefill_engine_id="prefill",
        decode_worker=types_pb2.WorkerId(engine_id="decode", tp_rank=d_rank),
        decode_target="127.0.0.1:5",
        decode_tp_size=d_tp,
        decode_block_size=block,
        first_token=first,
        num_tokens=tokens - first,
        groups=(OfferedGroup(0, blocks),),
        capability="cap",
        expires_unix_ms=0,
        request_id="req-d",
    )


@given(n=st.integers(1, 200), count=st.integers(1, 64), groups=st.integers(1, 3))
def test_layer_groups_are_contiguous_balanced_and_cover_every_layer(
    n: int, count: int, groups: int
) -> None:
    """Any layer count cut into any number of groups: every layer in exactly
    one group, group sizes within one of each other, each a contiguous run
    of the compute order (so a group is done when its last layer is)."""
    layers = [(f"l{i}", i % groups) for i in range(n)]
    cut = layer_groups(layers, count)
    assert len(cut) == min(count, n)
    flat = [(name, g) for group in cut for g, names in group.items() for name in names]
    assert sorted(flat) == sorted(layers)
    sizes = [sum(len(v) for v in group.values()) for group in cut]
    assert max(sizes) - min(sizes) <= 1
    # Contiguous: each group's layers are a run of the compute order.
    order = {name: i for i, (name, _) in enumerate(layers)}
    for group in cut:
        at = sorted(order[name] for names in group.values() for name in names)
        assert at == list(range(at[0], at[0] + len(at)))


def test_equal_engines_push_block_for_block() -> None:
    """Equal TP and block sizes: one push into the same rank, local and remote
    swapped from the pull, the decode's capability, the decode's request id."""
    task = PushSendTask("req-p", "x" * 24, ((5, 1, 9),), 40)
    spec, writers = push_spec(rank(1), task, offer(0, 1, (4, 0, 7)), OPTIONS)
    assert spec is not None and writers == 1
    (g,) = spec.groups
    assert list(g.local_block_ids) == [5, 1, 9] and list(g.remote_block_ids) == [4, 0, 7]
    assert spec.capability == "cap" and spec.request_id == "req-d"
    assert spec.remote_worker.engine_id == "decode" and spec.remote_target == "127.0.0.1:5"


def test_a_decode_prefix_hit_pushes_only_the_tail() -> None:
    """Decode holds the first 32 tokens already: only the prefill blocks
    after them are written."""
    task = PushSendTask("req-p", "x" * 24, ((1, 2, 3, 4),), 64)
    spec, _ = push_spec(rank(1), task, offer(0, 1, (20, 21), first=32, tokens=64), OPTIONS)
    assert spec is not None
    assert list(spec.groups[0].local_block_ids) == [3, 4]


def test_another_prompt_length_is_refused() -> None:
    """An offer for another number of tokens than the prefill computed is
    refused, never written in part."""
    task = PushSendTask("req-p", "x" * 24, ((1, 2, 3),), 40)
    with pytest.raises(ValueError, match="tokens"):
        push_spec(rank(1), task, offer(0, 1, (3, 4), tokens=32), OPTIONS)


def test_a_prefix_hit_inside_a_prefill_block_is_refused() -> None:
    """Prefill blocks of 32, decode of 16 with a 16-token hit: the first token
    to write is not at a prefill block start; refused, not written wrong."""
    task = PushSendTask("req-p", "x" * 24, ((1, 2),), 64)
    with pytest.raises(ValueError, match="inside a prefill block"):
        push_spec(rank(1, block=32), task, offer(0, 1, (7, 8, 9), first=16, tokens=64), OPTIONS)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1)])
def test_prefill_ranks_write_exactly_the_decode_ranks_that_would_read_them(
    p_tp: int, d_tp: int
) -> None:
    """Across TP sizes, a push is a pull turned around: each prefill rank
    writes exactly the decode ranks that would pull from it, and each
    decode rank's grant counts every rank that writes it."""
    for p in range(p_tp):
        written = decode_ranks_written(rank(p_tp, p), d_tp)
        readers = {
            d
            for d in range(d_tp)
            for s, _ in source_ranks(4, p_tp, d_tp, d, replicated=False)
            if s == p
        }
        assert written == readers
        for d in written:
            n = len(source_ranks(4, p_tp, d_tp, d, replicated=False))
            assert writers_of(rank(p_tp, p), offer(d, d_tp, (1,))) == n
            task = PushSendTask("req-p", "x" * 24, ((5, 1, 9),), 40)
            spec, writers = push_spec(rank(p_tp, p), task, offer(d, d_tp, (4, 0, 7)), OPTIONS)
            assert spec is not None and writers == n
            assert spec.groups[0].num_tokens == 40  # token mode across TP sizes


def test_layer_pushes_declare_every_writers_uses() -> None:
    """Layer groups cut one push into one transfer per group, each naming
    its layers and declaring the uses of every writer's every group, so the
    decode's open grant is used up only by the last one."""
    task = PushSendTask("req-p", "x" * 24, ((5,),), 10)
    spec, writers = push_spec(rank(1), task, offer(0, 1, (4,), tokens=10), OPTIONS)
    assert spec is not None
    groups = layer_groups([(f"l{i}", 0) for i in range(5)], 3)
    cut = layer_pushes(spec, groups, writers * uses_per_writer(groups, {0}))
    assert [k for k, _ in cut] == [0, 1, 2]
    assert all(c.readers == 3 for _, c in cut)
    assert [list(c.groups[0].layer_names) for _, c in cut] == [["l0"], ["l1", "l2"], ["l3", "l4"]]
    # A layer group with none of the offered transfer groups is no push.
    assert uses_per_writer([{1: ("m",)}, *groups], {0}) == 3
