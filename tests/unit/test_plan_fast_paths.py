"""The decode daemon's per-pull fast paths answer exactly as the code they
replaced: wire block ids parsed once into int64 arrays (never lists of Python
ints), range and repeat checks that search for the offender only when there
is one, whole/split pieces without ``setdiff1d``, and the owner's
announcement copied from the wire fields. The old implementations are kept
here as references; refusals must match them in field and message."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples
from test_transfer_plan import DECODE, PREFILL, _maps, region_map, scenarios

from kvmap.core import transfer_plan as tp
from kvmap.core import transfer_wire
from kvmap.core.convert import worker_id_to_proto
from kvmap.core.errors import InvalidArgument, KvmapError
from kvmap.core.geometry import WorkerKey
from kvmap.core.token_plan import token_groups
from kvmap.core.transfer_pieces import (
    Int64Array,
    LayerSelection,
    PieceTable,
    Side,
    build_piece_table,
)
from kvmap.core.transfer_plan import (
    MAX_BLOCKS_PER_TRANSFER,
    MAX_GROUPS_PER_TRANSFER,
    GroupPairs,
    block_ids,
    plan_transfer,
)
from kvmap.core.transfer_requests import TransferRequest
from kvmap.core.transfer_wire import announcement_to_proto
from kvmap.daemon.engine.transfers import TransferEngine
from kvmap.v1 import peer_pb2, transfers_pb2, types_pb2

INT64 = st.integers(-(2**63), 2**63 - 1)
# Small ids repeat often; extremes probe the unsigned view of negatives.
IDS = st.lists(st.one_of(st.integers(-3, 40), INT64), max_size=60)
LIMITS = st.one_of(
    st.integers(0, 50),
    st.sampled_from([2**63 - 1, 2**63, 2**63 + 1, 2**64 - 1, 2**64, 2**70]),
    st.integers(0, 2**65),
)

# --- the implementations replaced, as references ------------------------------


def old_check_range(field: str, ids: Int64Array, limit: int) -> None:
    bad = np.flatnonzero((ids < 0) | (ids >= limit))
    if bad.size:
        j = int(bad[0])
        raise InvalidArgument(f"{field}[{j}]", f"block {ids[j]} out of range [0, {limit})")


def old_first_repeat(ids: Int64Array) -> tuple[int, int] | None:
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    dup = np.flatnonzero(sorted_ids[1:] == sorted_ids[:-1]) + 1
    if not dup.size:
        return None
    t = int(dup[np.argmin(order[dup])])
    return int(order[t]), int(order[t - 1])


def old_group_descriptors(
    table: PieceTable, pieces: Int64Array, lids: Int64Array, rids: Int64Array
) -> tuple[list[Int64Array], list[Int64Array], list[Int64Array]]:
    """The planner as it was before NIXL merged its runs: split pieces by
    setdiff1d, and explicit run descriptors for whole-row pieces."""
    loc, rem = table.local, table.remote
    whole = pieces[table.whole_row[pieces]]
    split = np.setdiff1d(pieces, whole, assume_unique=True)
    li = [np.add.outer(loc.first_index[split], lids).ravel()]
    ri = [np.add.outer(rem.first_index[split], rids).ravel()]
    if not whole.size:
        return li, ri, []
    brk = np.flatnonzero((np.diff(lids) != 1) | (np.diff(rids) != 1)) + 1
    first = np.concatenate(([0], brk))
    length = np.diff(np.append(first, len(lids)))
    single, multi = first[length == 1], first[length > 1]
    li.append(np.add.outer(loc.first_index[whole], lids[single]).ravel())
    ri.append(np.add.outer(rem.first_index[whole], rids[single]).ravel())
    if not multi.size:
        return li, ri, []
    la = loc.addr[whole, None] + loc.stride[whole, None] * lids[multi]
    ra = rem.addr[whole, None] + rem.stride[whole, None] * rids[multi]
    ln = table.len_bytes[whole, None] * length[length > 1]
    return li, ri, [np.stack([la.ravel(), ra.ravel(), ln.ravel()], axis=1)]


def parse(spec: transfers_pb2.TransferSpec, default_timeout_s: float) -> TransferRequest:
    """The spec as the Pull service parses it (a transfer, not a release)."""
    req = transfer_wire.transfer_from_spec(spec, default_timeout_s)
    assert isinstance(req, TransferRequest)
    return req


def old_groups(req: TransferRequest) -> list[types_pb2.BlockGrant]:
    return [
        types_pb2.BlockGrant(transfer_group=p.transfer_group, block_ids=list(p.remote_block_ids))
        for p in req.pairs
    ]


def outcome(fn: Callable[..., object], *args: Any) -> tuple[str, str, str] | object:
    """What ``fn(*args)`` returned, or the refusal it raised (type, field, message)."""
    try:
        return fn(*args)
    except KvmapError as err:
        return (type(err).__name__, getattr(err, "field", ""), str(err))


# --- range and repeat checks ---------------------------------------------------


@settings(max_examples=examples(600), deadline=None)
@given(IDS, LIMITS)
def test_range_check_refuses_what_the_old_one_refused(ids: list[int], limit: int) -> None:
    """Any int64 ids against any limit (also beyond int64): the one-pass check accepts exactly
    what the old two-comparison check accepted, and refuses the same first offender with the
    same message."""
    arr = np.asarray(ids, dtype=np.int64)
    assert outcome(tp._check_range, "f", arr, limit) == outcome(old_check_range, "f", arr, limit)


@st.composite
def ids_below(draw: st.DrawFn) -> tuple[list[int], int]:
    """(ids, limit): ids in [0, limit), limits small (the bitmap) and large (the sort)."""
    limit = draw(st.one_of(st.integers(1, 40), st.integers(1, 2**63 - 1)))
    small = st.integers(0, min(limit, 40) - 1)
    return draw(st.lists(st.one_of(small, st.integers(0, limit - 1)), max_size=60)), limit


@settings(max_examples=examples(600), deadline=None)
@given(ids_below())
def test_first_repeat_is_the_old_answer(case: tuple[list[int], int]) -> None:
    """The bitmap or sort-first repeat check names the same (later, earlier) positions as the
    old argsort one, or none."""
    ids, limit = case
    arr = np.asarray(ids, dtype=np.int64)
    assert tp._first_repeat(arr, limit) == old_first_repeat(arr)


# --- whole and split pieces ----------------------------------------------------


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_groups_post_the_old_descriptor_count_and_plans_match_lists(
    scenario: tuple,  # type: ignore[type-arg]
) -> None:
    """For random maps and requests, each group's index pairs are every (piece, block) pair, piece
    by piece, and the descriptors NIXL posts once it merges runs (index pairs less ``merged``)
    are as many as the old planner's index pairs and explicit runs; a plan from wire-parsed int64
    arrays equals the plan from Python lists."""
    local, remote, (lp, rp), sels, pairs, direction = scenario
    table = build_piece_table(region_map(DECODE, local, lp), region_map(PREFILL, remote, rp), sels)
    for (start, stop), p in zip(table.spans, pairs, strict=True):
        pieces = np.arange(start, stop)
        lids, rids = np.asarray(p.local_block_ids), np.asarray(p.remote_block_ids)
        li, ri, merged = tp._group_descriptors(table, pieces, lids, rids)
        assert li.tolist() == [table.local.first_index[q] + b for q in pieces for b in lids]
        assert ri.tolist() == [table.remote.first_index[q] + b for q in pieces for b in rids]
        old_li, _, old_runs = old_group_descriptors(table, pieces, lids, rids)
        assert len(li) - merged == sum(map(len, old_li)) + sum(map(len, old_runs))
    wire = [
        transfers_pb2.GroupBlocks(
            local_block_ids=p.local_block_ids, remote_block_ids=p.remote_block_ids
        )
        for p in pairs
    ]
    arrays = [
        GroupPairs(p.transfer_group, block_ids(w.local_block_ids), block_ids(w.remote_block_ids))
        for p, w in zip(pairs, wire, strict=True)
    ]
    dest = Side.LOCAL if direction == "READ" else Side.REMOTE
    a = plan_transfer(table, arrays, destination=dest)
    b = plan_transfer(table, pairs, destination=dest)
    for field in ("local_indices", "remote_indices", "runs"):
        x, y = getattr(a, field), getattr(b, field)
        assert x.dtype == y.dtype and np.array_equal(x, y)
    assert (a.blocks, a.bytes, a.merged) == (b.blocks, b.bytes, b.merged)


# --- wire ids ------------------------------------------------------------------


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(INT64, max_size=300))
def test_wire_ids_parse_to_the_same_int64_values(ids: list[int]) -> None:
    """A repeated int64 field becomes a 1-D int64 array of its values, extremes included, that
    owns its memory: changing or dropping the message afterwards changes nothing."""
    msg = transfers_pb2.GroupBlocks(local_block_ids=ids)
    arr = block_ids(msg.local_block_ids)
    assert arr.dtype == np.int64 and arr.ndim == 1
    assert arr.tolist() == ids
    if ids:
        msg.local_block_ids[0] = ids[0] ^ 1
        del msg
        assert arr.tolist() == ids


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _spec(groups: Sequence[tuple[Sequence[int], Sequence[int]]], **kw: Any) -> Any:
    spec = transfers_pb2.TransferSpec(
        request_id="r", remote_target="127.0.0.1:1", capability="cap", **kw
    )
    spec.local_worker.engine_id, spec.remote_worker.engine_id = "decode", "prefill"
    for i, (local, remote) in enumerate(groups):
        spec.groups.add(transfer_group=i % 2, local_block_ids=local, remote_block_ids=remote)
    return spec


def old_parse(spec: transfers_pb2.TransferSpec) -> tuple[GroupPairs, ...]:
    """The pairs the old ``Request.parse`` built, after its checks, in its order."""
    tp.check_group_count(len(spec.groups))
    pairs = tuple(
        GroupPairs(g.transfer_group, list(g.local_block_ids), list(g.remote_block_ids))
        for g in spec.groups
    )
    if not token_groups(spec):
        tp.check_sizes(pairs)
    return pairs


def test_wire_varints_beyond_int64_are_refused_as_before() -> None:
    """Varints of 2**63 and more (what a client writing uint64s sends) arrive as negative int64s
    and are refused with the old message, not wrapped, truncated or crashed on; int64's extremes
    too."""
    maps = _maps()
    for value in (2**63, 2**64 - 1, 2**63 + 5):
        group = transfers_pb2.GroupBlocks.FromString(
            b"\x08\x00" + b"\x10" + _varint(value) + b"\x18" + _varint(1)
        )
        spec = _spec([])
        spec.groups.append(group)
        want = value - 2**64
        assert list(group.local_block_ids) == [want]
        req = parse(spec, 1.0)
        table = build_piece_table(*maps, [LayerSelection(0)])
        message = f"groups[0].local_block_ids[0]: block {want} out of range [0, 32022)"
        refused = ("InvalidArgument", "groups[0].local_block_ids[0]", message)
        assert outcome(plan_transfer, table, req.pairs) == refused
        assert outcome(plan_transfer, table, old_parse(spec)) == refused
    spec = _spec([([0, 2**63 - 1], [1, -(2**63)])])
    table = build_piece_table(*maps, [LayerSelection(0)])
    for pairs in (parse(spec, 1.0).pairs, old_parse(spec)):
        assert outcome(plan_transfer, table, pairs) == (
            "InvalidArgument",
            "groups[0].local_block_ids[1]",
            "groups[0].local_block_ids[1]: block 9223372036854775807 out of range [0, 32022)",
        )


OVERSIZED = [
    # Too many groups, too many pairs in one group and over several, mismatched lengths.
    [([0], [0])] * (MAX_GROUPS_PER_TRANSFER + 1),
    [(range(MAX_BLOCKS_PER_TRANSFER + 1), range(MAX_BLOCKS_PER_TRANSFER + 1))],
    [(range(MAX_BLOCKS_PER_TRANSFER // 2 + 1), range(MAX_BLOCKS_PER_TRANSFER // 2 + 1))] * 2,
    [([0, 1], [0, 1]), ([0, 1, 2], [0, 1])],
]


@pytest.mark.parametrize("groups", OVERSIZED, ids=["groups", "blocks", "blocks-2", "lengths"])
def test_oversized_requests_are_refused_as_before_and_before_any_copy(
    groups: list[tuple[Sequence[int], Sequence[int]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests over the group or block limits, or with mismatched id counts, get the old
    INVALID_ARGUMENT (field and message), decided on the wire fields' lengths before any id is
    copied into an array."""
    spec = _spec(groups)
    want = outcome(old_parse, spec)
    assert isinstance(want, tuple) and want[0] == "InvalidArgument"

    def copied(values: object) -> None:
        raise AssertionError("block ids were copied before the sizes were checked")

    monkeypatch.setattr(transfer_wire, "block_ids", copied)
    assert outcome(parse, spec, 1.0) == want


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(st.lists(INT64, max_size=40), min_size=1, max_size=4), st.booleans())
def test_parsed_pairs_and_announcement_match_the_old_ones(
    groups: list[list[int]], tokens: bool
) -> None:
    """Parsed pairs hold the wire ids (as int64 arrays), in block-pair and token mode, and the
    owner's announcement is the old message, field for field."""
    spec = _spec(
        [(ids, ids[::-1]) for ids in groups],
        timeout_ms=1500,
        remote_generation=4,
    )
    if tokens:
        for g in spec.groups:
            g.num_tokens = 16
    req = parse(spec, 1.0)
    for got, want in zip(req.pairs, old_parse(spec), strict=True):
        assert got.transfer_group == want.transfer_group
        assert isinstance(got.local_block_ids, np.ndarray)
        assert got.local_block_ids.tolist() == want.local_block_ids
        assert np.asarray(got.remote_block_ids).tolist() == want.remote_block_ids
    assert len(req.tokens) == (len(spec.groups) if tokens else 0)
    for got_t, g in zip(req.tokens, spec.groups, strict=False):
        assert np.asarray(got_t.local_block_ids).tolist() == list(g.local_block_ids)
        assert np.asarray(got_t.remote_block_ids).tolist() == list(g.remote_block_ids)
    engine: Any = type("E", (), {"_agent_name": "me", "_replaces_agents": ("old",)})()
    hs: Any = type("H", (), {"generation": 4, "agent_name": "owner"})()
    plan = plan_transfer(
        build_piece_table(*_maps(), [LayerSelection(0)]), [GroupPairs(0, [1], [1])]
    )
    got_msg = announcement_to_proto(TransferEngine._announcement(engine, req, hs, plan, True, "t1"))
    want_msg = peer_pb2.BeginTransferRequest(
        request_id="r",
        worker=worker_id_to_proto(WorkerKey("prefill")),
        generation=4,
        agent_name="owner",
        peer_agent="me",
        write=True,
        lease_ms=2500,
        blocks=plan.blocks,
        bytes=plan.bytes,
        capability="cap",
        replaces_agents=("old",),
        readers=0,
        groups=old_groups(req),
        transfer_id="t1",
    )
    assert got_msg == want_msg
    assert got_msg.SerializeToString(deterministic=True) == want_msg.SerializeToString(
        deterministic=True
    )
