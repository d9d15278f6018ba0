"""``Grant.allows`` answers with one comparison when a pull names exactly its
granted blocks, and sorts the named ids before its binary search otherwise
(a speed-up of the owner's BeginTransfer). These tests pin that it accepts
and refuses exactly what the plain per-id binary search it replaced did, and
that ``check_binding`` refuses with the same status and message. The
table's group limits, now read once per worker plan, follow a re-plan."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples
from test_grants import _model, _Record

from kvmap.core import grants as core
from kvmap.core.errors import ErrorCode, InvalidArgument, PermissionDenied, status_of
from kvmap.core.geometry import WorkerKey
from kvmap.core.grants import BlockIds, Grant, Int64Array
from kvmap.daemon.adapters.state_store import StateStore
from kvmap.daemon.engine.grants import GrantTable
from kvmap.v1 import peer_pb2, types_pb2

W = WorkerKey("prefill", 0, 0, 0)


def reference_allows(
    blocks: Mapping[int, Int64Array], groups: Iterable[tuple[int, BlockIds]]
) -> bool:
    """The check as it was before the fast paths (one binary search per id,
    in the order the request names them)."""
    named = False
    for group, ids in groups:
        granted = blocks.get(group)
        if granted is None:
            return False
        if not len(ids):
            continue
        named = True
        wanted = np.asarray(ids, dtype=np.int64)
        at = np.searchsorted(granted, wanted)
        inside = at < len(granted)
        if not inside.all() or not (granted[at] == wanted).all():
            return False
    return named


def _grant(blocks: Mapping[int, Int64Array]) -> Grant:
    return Grant(
        digest=b"d" * 32,
        worker=W,
        generation=1,
        request_id="r",
        blocks=blocks,
        expires_unix_ms=1 << 60,
        max_uses=1,
    )


# Granted groups as the table holds them: sorted, distinct (possibly empty).
_granted = st.dictionaries(
    st.integers(0, 3),
    st.sets(st.integers(0, 40), max_size=12).map(lambda s: np.array(sorted(s), dtype=np.int64)),
    max_size=3,
)


@st.composite
def _case(draw: st.DrawFn) -> tuple[dict[int, Int64Array], list[tuple[int, list[int]]]]:
    """A grant and a request's groups: often exactly the granted ids (in
    order, shuffled, a subset, with a duplicate or a stranger), sometimes
    anything at all (unknown groups, negative or huge ids, empty groups)."""
    blocks = draw(_granted)
    groups: list[tuple[int, list[int]]] = []
    for _ in range(draw(st.integers(0, 4))):
        group = draw(st.one_of(st.sampled_from(sorted(blocks) or [0]), st.integers(-1, 5)))
        granted = [int(i) for i in blocks.get(group, np.array([], dtype=np.int64))]
        ids = draw(
            st.one_of(
                st.just(granted),
                st.permutations(granted),
                st.lists(st.sampled_from(granted), max_size=16) if granted else st.just([]),
                st.lists(st.integers(-3, 45), max_size=16),
                st.lists(st.integers(-(1 << 63), (1 << 63) - 1), max_size=4),
            )
        )
        if ids and draw(st.booleans()):
            near = draw(st.sampled_from(ids)) + draw(st.sampled_from([0, 1, -1]))
            ids = [*ids, min(max(near, -(1 << 63)), (1 << 63) - 1)]  # (an int64 still)
        groups.append((group, ids))
    return blocks, groups


@settings(max_examples=examples(3000), deadline=None)
@given(_case())
def test_allows_answers_as_the_plain_binary_search(
    case: tuple[dict[int, Int64Array], list[tuple[int, list[int]]]],
) -> None:
    """Every grant and every request: the same answer, for block ids as a
    list, as an int64 array and as the protobuf field a BeginTransfer brings."""
    blocks, groups = case
    expected = reference_allows(blocks, groups)
    grant = _grant(blocks)
    assert grant.allows(groups) is expected
    assert grant.allows([(g, np.asarray(ids, dtype=np.int64)) for g, ids in groups]) is expected
    if any(g < 0 for g, _ in groups):
        return  # (transfer_group is unsigned on the wire)
    req = peer_pb2.BeginTransferRequest(
        groups=[types_pb2.BlockGrant(transfer_group=g, block_ids=ids) for g, ids in groups]
    )
    assert grant.allows([(g.transfer_group, g.block_ids) for g in req.groups]) is expected


@settings(max_examples=examples(500), deadline=None)
@given(_case())
def test_check_binding_refuses_with_the_same_status_and_message(
    case: tuple[dict[int, Int64Array], list[tuple[int, list[int]]]],
) -> None:
    """A refused binding is the one generic PERMISSION_DENIED (``DENIED``),
    an allowed one returns the grant, exactly as the reference says."""
    blocks, groups = case
    grant = _grant(blocks)
    if reference_allows(blocks, groups):
        assert (
            core.check_binding(grant, worker=W, generation=1, request_id="r", groups=groups)
            is grant
        )
    else:
        with pytest.raises(PermissionDenied) as err:
            core.check_binding(grant, worker=W, generation=1, request_id="r", groups=groups)
        assert status_of(err.value) == (ErrorCode.PERMISSION_DENIED, core.DENIED)


def test_shuffled_subset_and_stranger_ids_of_a_large_grant() -> None:
    """A pull the size of the bench's (2,048 scattered blocks of 32,022):
    its granted ids in any order pass, a subset passes, and one id that was
    not granted (or a duplicate of a granted one, as before) is answered as
    the reference answers."""
    rng = np.random.default_rng(7)
    granted = np.sort(rng.choice(32_022, 2048, replace=False)).astype(np.int64)
    grant = _grant({0: granted, 1: granted[:100]})
    stranger = int(np.setdiff1d(np.arange(32_022), granted)[0])
    for ids in (
        granted,
        rng.permutation(granted),
        rng.permutation(granted)[:1000],
        np.append(rng.permutation(granted)[:-1], stranger),
        np.append(granted[:-1], granted[0]),
    ):
        groups = [(0, ids), (1, granted[:100][::-1])]
        assert grant.allows(groups) is reference_allows(grant.blocks, groups)
    assert not grant.allows([(0, np.append(granted[:-1], stranger))])
    assert grant.allows([(0, np.append(granted[:-1], granted[0]))])


def test_a_grant_is_checked_against_the_worker_current_plan() -> None:
    """The table keeps each worker's group limits with the model they came
    from: a worker re-planned with fewer blocks (or other groups) is checked
    against its new plan, a dropped worker's limits are read again."""
    table = GrantTable(StateStore(""))
    before = _Record(_model(generation=1, blocks=(16, 8)))
    table.grant(before, request_id="a", groups=[(0, [15]), (1, [7])], ttl_ms=0, max_uses=1)  # type: ignore[arg-type]
    after = _Record(_model(generation=2, blocks=(4,)))
    for groups, message in (
        ([(0, [15])], "groups[0].block_ids[0]: block 15 out of range [0, 4)"),
        ([(1, [0])], "groups[0].transfer_group: worker has no group 1"),
    ):
        with pytest.raises(InvalidArgument) as err:
            table.grant(after, request_id="b", groups=groups, ttl_ms=0, max_uses=1)  # type: ignore[arg-type]
        assert str(err.value) == message
    table.grant(after, request_id="b", groups=[(0, [3])], ttl_ms=0, max_uses=1)  # type: ignore[arg-type]
    table.drop_worker(W)
    with pytest.raises(InvalidArgument):
        table.grant(after, request_id="c", groups=[(0, [4])], ttl_ms=0, max_uses=1)  # type: ignore[arg-type]
    table.grant(before, request_id="c", groups=[(0, [15])], ttl_ms=0, max_uses=1)  # type: ignore[arg-type]
