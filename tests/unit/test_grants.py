"""Per-request capabilities: the core's checks (core.grants) and the owner's
table (engine.grants) over a real state store (SQLite in a temp dir), with a
clock the test sets."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from kvmap.core import grants as core
from kvmap.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
)
from kvmap.core.geometry import PlannerInfo, Region, RegionMapModel, WorkerKey
from kvmap.daemon.adapters.state_store import StateStore
from kvmap.daemon.engine.grants import GrantTable

W = WorkerKey("prefill", 0, 0, 0)
OTHER = WorkerKey("other", 0, 0, 0)


def _model(
    key: WorkerKey = W, generation: int = 1, blocks: Sequence[int] = (16, 8)
) -> RegionMapModel:
    """A worker with one region per transfer group, ``blocks[g]`` blocks in group g."""
    regions = tuple(
        Region(
            id=g,
            allocation_id="kv",
            transfer_group=g,
            offset_bytes=0,
            block_len_bytes=64,
            block_stride_bytes=64,
            num_blocks=n,
            layers=(),
        )
        for g, n in enumerate(blocks)
    )
    return RegionMapModel(
        worker=key,
        generation=generation,
        planner=PlannerInfo("baseline", 1),
        regions=regions,
        allocations=(),
    )


class _Record:
    """What the table reads of a WorkerRecord: its key, generation and model."""

    def __init__(self, model: RegionMapModel) -> None:
        self.model = model

    @property
    def key(self) -> WorkerKey:
        return self.model.worker

    @property
    def generation(self) -> int:
        return self.model.generation


class _Clock:
    def __init__(self) -> None:
        self.now = 1_000_000

    def __call__(self) -> int:
        return self.now


def _grant(**blocks: list[int]) -> core.Grant:
    return core.Grant(
        digest=b"d",
        worker=W,
        generation=1,
        request_id="r",
        blocks={int(g[1:]): np.array(sorted(ids), dtype=np.int64) for g, ids in blocks.items()},
        expires_unix_ms=10,
        max_uses=1,
    )


# Core ---------------------------------------------------------------------------


@settings(max_examples=examples(200), deadline=None)
@given(
    granted=st.sets(st.integers(0, 63), min_size=1, max_size=20),
    wanted=st.lists(st.integers(0, 63), min_size=1, max_size=20),
)
def test_a_transfer_is_allowed_exactly_when_its_blocks_are_a_subset(
    granted: set[int], wanted: list[int]
) -> None:
    """``allows`` is subset inclusion of the named block ids in the granted
    ones of the same group, for any sets (repeats in the request allowed)."""
    grant = _grant(g0=sorted(granted))
    assert grant.allows([(0, wanted)]) == set(wanted).issubset(granted)


def test_allows_needs_a_granted_group_and_at_least_one_block() -> None:
    """A group the grant lacks, or a request that names no block at all, is
    not allowed; empty groups beside named blocks are harmless."""
    grant = _grant(g0=[1, 2], g1=[5])
    assert grant.allows([(0, [1]), (1, [5])])
    assert grant.allows([(0, [2]), (1, [])])
    assert not grant.allows([(2, [1])])
    assert not grant.allows([(0, [])])
    assert not grant.allows([])


@settings(max_examples=examples(100), deadline=None)
@given(ids=st.lists(st.integers(-3, 20), min_size=1, max_size=30))
def test_granted_blocks_are_sorted_distinct_and_in_range(ids: list[int]) -> None:
    """Valid ids come back sorted; any id outside [0, 16) or repeated is
    INVALID_ARGUMENT naming the field."""
    limits = {0: 16}
    if all(0 <= b < 16 for b in ids) and len(set(ids)) == len(ids):
        assert core.granted_blocks([(0, ids)], limits)[0].tolist() == sorted(ids)
    else:
        with pytest.raises(InvalidArgument) as raised:
            core.granted_blocks([(0, ids)], limits)
        assert raised.value.field.startswith("groups[0].block_ids")


def test_group_limits_are_the_blocks_every_region_of_the_group_has() -> None:
    """A group's valid block ids are those of its smallest region."""
    model = _model(blocks=(16, 8))
    two = RegionMapModel(
        worker=W,
        generation=1,
        planner=model.planner,
        regions=(*model.regions, Region(9, "kv", 0, 0, 64, 64, 12, ())),
        allocations=(),
    )
    assert core.group_limits(two) == {0: 12, 1: 8}


@pytest.mark.parametrize(
    ("groups", "field"),
    [
        ([], "groups"),
        ([(0, [])], "groups"),
        ([(5, [1])], "groups[0].transfer_group"),
        ([(0, [1]), (0, [2])], "groups[1].transfer_group"),
    ],
)
def test_grant_groups_are_checked_against_the_geometry(
    groups: list[tuple[int, list[int]]], field: str
) -> None:
    """No group, no block, an unknown group or a group twice is INVALID_ARGUMENT."""
    with pytest.raises(InvalidArgument) as raised:
        core.granted_blocks(groups, {0: 16})
    assert raised.value.field == field


def test_ttl_uses_and_request_id_are_bounded() -> None:
    """0 means the default (ttl) or one (uses); over the stated maximum is
    refused, not cut; the request id is required and bounded."""
    assert core.check_ttl(0) == core.DEFAULT_TTL_MS
    assert core.check_ttl(core.MAX_TTL_MS) == core.MAX_TTL_MS
    assert core.check_max_uses(0) == 1
    assert core.check_max_uses(core.MAX_USES) == core.MAX_USES
    for call in (
        lambda: core.check_ttl(core.MAX_TTL_MS + 1),
        lambda: core.check_max_uses(core.MAX_USES + 1),
        lambda: core.check_request_id(""),
        lambda: core.check_request_id("r" * (core.MAX_REQUEST_ID + 1)),
    ):
        with pytest.raises(InvalidArgument):
            call()


def test_the_digest_is_sha256_of_the_capability() -> None:
    """The table keys grants by SHA-256 of the capability, never the capability."""
    assert core.digest("abc") == hashlib.sha256(b"abc").digest()


# The table ------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> StateStore:
    return StateStore(str(tmp_path / "state"))


# The authenticated peer every call of these tests comes from.
HOST = "10.0.0.7"


def _table(store: StateStore, clock: _Clock | None = None) -> GrantTable:
    return GrantTable(store, clock or _Clock())


def _admit(
    table: GrantTable,
    capability: str,
    record: _Record,
    *,
    request_id: str = "r1",
    groups: Sequence[tuple[int, Sequence[int]]] = ((0, [3]),),
    peer: str = "decode-a",
) -> core.Grant:
    return table.admit(
        capability,
        record=record,  # type: ignore[arg-type]
        request_id=request_id,
        groups=groups,
        peer_agent=peer,
        peer=HOST,
    )


def _mint(table: GrantTable, record: _Record, **kw: object) -> tuple[str, core.Grant]:
    args: dict[str, object] = {
        "request_id": "r1",
        "groups": [(0, [3, 4]), (1, [0])],
        "ttl_ms": 0,
        "max_uses": 0,
    }
    args.update(kw)
    return table.grant(record, **args)  # type: ignore[arg-type]


def test_minted_capability_is_random_stored_only_as_its_digest_and_survives_a_restart(
    store: StateStore, tmp_path: Path
) -> None:
    """A capability has 256 random bits (43 URL-safe characters); the store
    holds its digest and binding, never the capability; a new table over the
    same store (a restarted daemon) admits it."""
    record = _Record(_model())
    table = _table(store)
    cap, grant = _mint(table, record)
    cap2, _ = _mint(table, record, request_id="r2")
    assert len(cap) == 43 and cap != cap2
    assert grant.digest == core.digest(cap)
    raw = Path(store.path).read_bytes() + Path(store.path + "-wal").read_bytes()
    assert cap.encode() not in raw
    store.close()
    again = StateStore(str(tmp_path / "state"))
    restarted = _table(again)
    assert len(restarted) == 2
    admitted = _admit(restarted, cap, record, groups=[(0, [4]), (1, [0])])
    assert admitted.blocks[0].tolist() == [3, 4] and admitted.request_id == "r1"
    again.close()


@pytest.mark.parametrize(
    "change",
    [
        {"capability": ""},
        {"capability": "wrong"},
        {"request_id": "r2"},
        {"groups": [(0, [5])]},
        {"groups": [(2, [0])]},
        {"record": _Record(_model(OTHER))},
        {"record": _Record(_model(generation=2))},
    ],
    ids=lambda c: next(iter(c)) + "=" + str(next(iter(c.values())))[:20],
)
def test_any_mismatch_is_one_permission_denied_and_changes_nothing(
    store: StateStore, change: dict[str, object]
) -> None:
    """A missing or wrong capability, another request, a block or group
    outside the grant, another worker or generation: PermissionDenied with
    the one generic message, and the grant stays claimable."""
    record = _Record(_model())
    table = _table(store)
    cap, _ = _mint(table, record)
    args: dict[str, object] = {"capability": cap, "record": record}
    args.update(change)
    capability = str(args.pop("capability"))
    with pytest.raises(PermissionDenied) as raised:
        _admit(table, capability, **args)  # type: ignore[arg-type]
    assert raised.value.message == core.DENIED
    table.claim(_admit(table, cap, record), "decode-a", HOST)


def test_expired_is_failed_precondition_then_swept(store: StateStore) -> None:
    """After its expiry a grant answers FAILED_PRECONDITION for
    EXPIRED_KEPT_MS, then the sweep forgets it (store included)."""
    clock = _Clock()
    record = _Record(_model())
    table = _table(store, clock)
    cap, grant = _mint(table, record, ttl_ms=1000)
    assert grant.expires_unix_ms == clock.now + 1000
    clock.now += 1000
    with pytest.raises(FailedPrecondition):
        _admit(table, cap, record)
    assert table.sweep() == 0
    clock.now += core.EXPIRED_KEPT_MS
    assert table.sweep() == 1
    assert len(table) == 0 and store.grants() == []
    with pytest.raises(PermissionDenied):
        _admit(table, cap, record)


def test_single_use_claim_release_and_consume(store: StateStore) -> None:
    """The first admitted peer claims the capability: another agent is
    denied while it holds it; a released claim (failed transfer) lets anyone
    holding the capability retry; a completed transfer consumes it."""
    record = _Record(_model())
    table = _table(store)
    cap, _ = _mint(table, record)
    grant = _admit(table, cap, record, peer="decode-a")
    table.claim(grant, "decode-a", HOST)
    with pytest.raises(PermissionDenied):
        _admit(table, cap, record, peer="decode-b")
    with pytest.raises(PermissionDenied):  # its one use is taken by the live claim
        _admit(table, cap, record, peer="decode-a")
    table.release(grant.digest)
    table.claim(_admit(table, cap, record, peer="decode-b"), "decode-b", HOST)
    table.complete(grant.digest)
    assert len(table) == 0 and store.grants() == []
    for peer in ("decode-a", "decode-b"):
        with pytest.raises(PermissionDenied):
            _admit(table, cap, record, peer=peer)


def test_uses_count_across_a_restart(store: StateStore, tmp_path: Path) -> None:
    """A two-use capability spends one use per completed transfer, and the
    count is persisted: after a restart one use is left, then none."""
    record = _Record(_model())
    table = _table(store)
    cap, grant = _mint(table, record, max_uses=2)
    table.claim(_admit(table, cap, record), "decode-a", HOST)
    table.complete(grant.digest)
    store.close()
    again = StateStore(str(tmp_path / "state"))
    restarted = _table(again)
    restarted.claim(_admit(restarted, cap, record, peer="decode-b"), "decode-b", HOST)
    restarted.complete(grant.digest)
    with pytest.raises(PermissionDenied):
        _admit(restarted, cap, record)
    again.close()


def test_revoke_drop_and_rebind(store: StateStore) -> None:
    """Revoking a request withdraws all its capabilities (others stay); a
    re-planned worker's grants follow its new generation; dropping a worker
    withdraws all of its grants."""
    record = _Record(_model())
    table = _table(store)
    cap1, _ = _mint(table, record)
    cap1b, _ = _mint(table, record)
    cap2, _ = _mint(table, record, request_id="r2")
    assert len(table.revoke(W, "r1")) == 2
    for cap in (cap1, cap1b):
        with pytest.raises(PermissionDenied):
            _admit(table, cap, record)
    replanned = _Record(_model(generation=2))
    table.rebind(W, 2)
    assert _admit(table, cap2, replanned, request_id="r2").generation == 2
    assert [g.generation for g in store.grants()] == [2]
    table.drop_worker(W)
    assert len(table) == 0 and store.grants() == []


def test_limits_are_resource_exhausted_and_expired_grants_make_room(
    store: StateStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the per-worker grant limit GrantTransfer is RESOURCE_EXHAUSTED
    naming the limit, unless expired grants can be swept to make room; the
    total of granted block ids is bounded too."""
    monkeypatch.setattr(core, "MAX_GRANTS_PER_WORKER", 2)
    clock = _Clock()
    record = _Record(_model())
    table = _table(store, clock)
    _mint(table, record, ttl_ms=10)
    _mint(table, record)
    with pytest.raises(ResourceExhausted) as raised:
        _mint(table, record)
    assert "2 grants (the limit)" in raised.value.message
    clock.now += 10 + core.EXPIRED_KEPT_MS
    _mint(table, record)
    assert len(table) == 2
    table.drop_worker(W)
    assert table.granted_blocks == 0
    monkeypatch.setattr(core, "MAX_GRANTED_BLOCKS", 4)
    with pytest.raises(ResourceExhausted) as raised:
        _mint(table, record, groups=[(0, [1, 2, 3, 4, 5])])
    assert "granted block ids in all" in raised.value.message
    assert len(table) == 0 and store.grants() == []


def test_the_workers_unread_release_word_survives_a_restart(
    store: StateStore, tmp_path: Path
) -> None:
    """Each grant keeps its worker's unread_release through a restart of its table and store;
    a value this kvmapd does not know (stored by a newer one) reads back as REFUSED, which
    never burns a grant unread; ALLOWED on a grant that is not open is INVALID_ARGUMENT and
    stores nothing."""
    record = _Record(_model())
    table = _table(store)
    for choice in core.UnreadRelease:
        _mint(table, record, request_id=choice.name, open_uses=True, unread_release=choice)
    with pytest.raises(InvalidArgument, match="ALLOWED needs open_uses"):
        _mint(table, record, request_id="fixed", unread_release=core.UnreadRelease.ALLOWED)
    _, newer = _mint(table, record, request_id="newer", open_uses=True)
    # A value from a newer kvmapd: not one of this one's UnreadRelease.
    store.save_grant(replace(newer, unread_release=3))  # type: ignore[arg-type]
    store.close()
    again = StateStore(str(tmp_path / "state"))
    stored = {g.request_id: g.unread_release for g, _, _ in _table(again).snapshot()}
    assert stored == {
        "UNSPECIFIED": core.UnreadRelease.UNSPECIFIED,
        "ALLOWED": core.UnreadRelease.ALLOWED,
        "REFUSED": core.UnreadRelease.REFUSED,
        "newer": core.UnreadRelease.REFUSED,
    }
    again.close()
