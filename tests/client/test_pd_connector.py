"""The connector's P/D state machines (kvmap.client.connector) against in-memory
daemons: a prefill and a decode worker with real shared-memory KV caches,
the scheduler decisions of both roles, the prefill side's transfer grants
and the decode side's capability checks, lease expiry, failures, timeouts."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from inproc_daemon import InprocDaemon, InprocNetwork, InprocTransport

from kvmap.client.client import KvmapClient
from kvmap.client.connector import (
    CAPABILITY_KEY,
    WATCHDOG_GRACE_S,
    ConnectorMeta,
    ConnectorOptions,
    RecvTask,
    RemoteSource,
    SchedulerCore,
    WorkerCore,
    pair_blocks,
    rank_capability,
)
from kvmap.client.geometry import LayerSpec, export_registration
from kvmap.core.errors import PermissionDenied, Unavailable
from kvmap.v1 import registry_pb2, transfers_pb2, types_pb2

NB, PAGE = 32, 128
LAYERS = ("model.layers.0.attn", "model.layers.1.attn")
P_ADDR, D_ADDR = "10.0.0.1:50051", "10.0.0.2:50051"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def options(**kw: Any) -> ConnectorOptions:
    base: dict[str, Any] = {
        "socket": "/unused",
        "transfer_timeout_s": 5.0,
        "lease_seconds": 30.0,
        "register_timeout_s": 2.0,
        "reconnect_initial_s": 0.01,
        "reconnect_max_s": 0.05,
    }
    return ConnectorOptions(**{**base, **kw})


class RecordingTransport(InprocTransport):
    """The memory transport, keeping every GrantTransfer and RevokeTransfer
    request it carried (what the connector asked its daemon for)."""

    def __init__(self, daemon: InprocDaemon) -> None:
        super().__init__(daemon)
        self.grants: list[registry_pb2.GrantTransferRequest] = []
        self.revokes: list[registry_pb2.RevokeTransferRequest] = []

    def grant_transfer(
        self, req: registry_pb2.GrantTransferRequest, timeout: float
    ) -> registry_pb2.GrantTransferResponse:
        self.grants.append(req)
        return super().grant_transfer(req, timeout)

    def revoke_transfer(
        self, req: registry_pb2.RevokeTransferRequest, timeout: float
    ) -> registry_pb2.RevokeTransferResponse:
        self.revokes.append(req)
        return super().revoke_transfer(req, timeout)


@dataclass
class Side:
    daemon: InprocDaemon
    sched: SchedulerCore
    worker: WorkerCore
    kv: dict[str, torch.Tensor]
    clock: FakeClock
    # The scheduler's and the worker's transports (as in vLLM: two processes).
    sched_transport: RecordingTransport
    worker_transport: RecordingTransport


def make_side(net: InprocNetwork, addr: str, engine: str, fill: bool, **kw: Any) -> Side:
    daemon = net.daemon()
    addr = daemon.target  # what the connector's peer_address names
    opts = options(peer_address=addr, **kw)
    storage = torch.zeros(len(LAYERS) * NB * PAGE, dtype=torch.uint8)
    kv = {
        n: storage[i * NB * PAGE : (i + 1) * NB * PAGE].view(NB, PAGE) for i, n in enumerate(LAYERS)
    }
    if fill:
        g = torch.Generator().manual_seed(7)
        storage.copy_(torch.randint(0, 255, storage.shape, generator=g, dtype=torch.uint8))
    wid = types_pb2.WorkerId(engine_id=engine)
    clock = FakeClock()
    worker_transport, sched_transport = RecordingTransport(daemon), RecordingTransport(daemon)
    worker = WorkerCore(KvmapClient(worker_transport), wid, opts, clock=clock)
    specs = {n: LayerSpec(0, types_pb2.CACHE_KIND_MHA, NB) for n in LAYERS}
    req, fds = export_registration(wid, kv, specs, block_size_tokens=16)
    worker.register(req, fds)
    sched = SchedulerCore(engine, opts, client=KvmapClient(sched_transport))
    return Side(daemon, sched, worker, kv, clock, sched_transport, worker_transport)


@pytest.fixture
def pair() -> Iterator[tuple[Side, Side]]:
    with InprocNetwork() as net:
        p = make_side(net, P_ADDR, "prefill", fill=True)
        d = make_side(net, D_ADDR, "decode", fill=False)
        yield p, d
        for s in (p, d):
            s.worker.shutdown()


def step(side: Side, timeout: float = 5.0, want: str = "any") -> Any:
    """One engine step: scheduler meta -> worker start -> poll, until
    something finished (or ``timeout``)."""
    side.worker.start(side.sched.build_meta())
    deadline = time.monotonic() + timeout
    while True:
        r = side.worker.poll()
        if r.finished_sending or r.finished_recving or time.monotonic() > deadline:
            return r
        time.sleep(0.01)


def prefill_request(p: Side, rid: str, blocks: list[int], tokens: int) -> dict[str, Any]:
    params: dict[str, Any] = {"do_remote_decode": True}
    assert p.sched.num_new_matched_tokens(rid, params, tokens, 0) == (0, False)
    p.sched.after_alloc(rid, params, [blocks], 0)
    p.worker.start(p.sched.build_meta())
    keep, kv = p.sched.request_finished(
        rid, params, finished_normally=True, block_ids=[blocks], num_computed_tokens=tokens
    )
    assert keep and kv is not None
    p.worker.start(p.sched.build_meta())  # the step that carries the lease
    return kv


def test_full_pd_flow_moves_bytes_and_frees_prefill_blocks(pair: tuple[Side, Side]) -> None:
    """The whole P/D flow: prefill keeps its blocks under a lease and hands out kv_transfer_params;
    decode loads the whole prompt once, asynchronously, and holds the prefill blocks' exact
    bytes; the owner's event then frees the prefill blocks (no lease expiry) and both daemons
    count the blocks."""
    p, d = pair
    remote_blocks = [3, 17, 4]
    kv = prefill_request(p, "req-p", remote_blocks, tokens=40)
    assert kv["remote_target"] == p.daemon.target and kv["remote_block_ids"] == [remote_blocks]
    assert kv["remote_engine_id"] == "prefill" and kv["remote_request_id"] == "req-p"
    assert p.worker.pending_sends == 1

    # Decode: the whole prompt loads asynchronously, once.
    params = dict(kv)
    assert d.sched.num_new_matched_tokens("req-d", params, 40, 0) == (40, True)
    local_blocks = [9, 0, 30]
    d.sched.after_alloc("req-d", params, [local_blocks], 40)
    assert params["do_remote_prefill"] is False
    d.sched.after_alloc("req-d", params, [[*local_blocks, 31]], 0)  # again: nothing new
    r = step(d)
    assert r.finished_recving == {"req-d"} and not r.failed_recving
    for name in LAYERS:
        for lb, rb in zip(local_blocks, remote_blocks, strict=True):
            assert torch.equal(d.kv[name][lb], p.kv[name][rb])
    assert [x.ok for x in d.worker.loads] == [True]
    assert d.worker.load_error_blocks() == set()
    # The decode request needs nothing more from the connector.
    assert d.sched.request_finished(
        "req-d", params, finished_normally=True, block_ids=[local_blocks], num_computed_tokens=41
    ) == (False, None)

    # Prefill: the daemon's event frees the blocks at the next step.
    r = step(p)
    assert r.finished_sending == {"req-p"} and p.worker.pending_sends == 0
    assert p.worker.leases_expired == 0
    assert p.worker_transport.revokes == []  # freed by the finished pull: nothing to revoke
    assert d.daemon.get_stats().transfers.blocks == 3
    assert p.daemon.get_stats().transfers.served_blocks == 3


def test_local_prefix_hit_pulls_only_the_tail(pair: tuple[Side, Side]) -> None:
    """A decode request with a local prefix hit pulls only the remote blocks after it, into the
    blocks it allocated for them."""
    p, d = pair
    kv = prefill_request(p, "req-p", [1, 2, 3, 4], tokens=64)
    d.sched.after_alloc("req-d", dict(kv), [[20, 21]], 32)  # decode had the first 2 blocks
    assert step(d).finished_recving == {"req-d"}
    assert torch.equal(d.kv[LAYERS[0]][20], p.kv[LAYERS[0]][3])
    assert torch.equal(d.kv[LAYERS[0]][21], p.kv[LAYERS[0]][4])
    assert d.worker.loads[-1].remote_block_ids == ((3, 4),)


def test_unpulled_prefill_blocks_are_freed_when_the_lease_runs_out(
    pair: tuple[Side, Side],
) -> None:
    """With nobody pulling, the prefill blocks are freed exactly when the lease runs out on the
    worker's clock (not a moment before), reported once and counted as an expired lease."""
    p, _ = pair
    prefill_request(p, "req-p", [5], tokens=10)
    assert p.worker.poll().finished_sending == set()
    p.clock.now += 29.0
    assert p.worker.poll().finished_sending == set()
    p.clock.now += 1.5
    assert p.worker.poll().finished_sending == {"req-p"}
    assert p.worker.leases_expired == 1 and p.worker.pending_sends == 0
    assert p.worker.poll().finished_sending == set()  # reported once


def test_aborted_prefill_request_keeps_nothing(pair: tuple[Side, Side]) -> None:
    """A prefill request that finished abnormally keeps no blocks and sends no lease: the worker
    tracks no pending send."""
    p, _ = pair
    params: dict[str, Any] = {"do_remote_decode": True}
    p.sched.after_alloc("r", params, [[1]], 0)
    p.worker.start(p.sched.build_meta())
    assert p.sched.request_finished(
        "r", params, finished_normally=False, block_ids=[[1]], num_computed_tokens=5
    ) == (False, None)
    meta = p.sched.build_meta()
    assert meta.not_processed == {"r"} and not meta.send
    p.worker.start(meta)
    assert p.worker.pending_sends == 0


def test_failed_pull_is_reported_as_a_load_failure(pair: tuple[Side, Side]) -> None:
    """A pull the daemon fails is reported as a finished and failed load, its blocks as load-error
    blocks (drained once), its memory untouched, and the owner is not told (its blocks wait for
    the lease)."""
    p, d = pair
    kv = prefill_request(p, "req-p", [1, 2], tokens=20)

    def fail(spec: transfers_pb2.TransferSpec) -> None:
        raise Unavailable("UNAVAILABLE: peer unreachable")

    d.daemon.pull_hook = fail
    d.sched.after_alloc("req-d", dict(kv), [[7, 8]], 20)
    r = step(d)
    assert r.finished_recving == r.failed_recving == {"req-d"}
    assert d.worker.load_error_blocks() == {7, 8}
    assert d.worker.load_error_blocks() == set()  # drained
    assert "peer unreachable" in d.worker.loads[-1].error
    assert torch.count_nonzero(d.kv[LAYERS[0]][7]) == 0
    # The owner was never told: its blocks wait for the lease.
    assert p.worker.poll().finished_sending == set()


def test_prefill_grants_exactly_the_kept_blocks_and_revokes_when_the_lease_runs_out(
    pair: tuple[Side, Side],
) -> None:
    """The prefill scheduler asks its daemon for one open grant of exactly the request's kept
    blocks, for the lease's time, and hands the capability out in kv_transfer_params; when the
    lease runs out with nobody pulling, the worker revokes the grant as it frees the blocks, and a
    decode that presents the capability afterwards reads nothing (a failed load, memory
    untouched)."""
    p, d = pair
    kv = prefill_request(p, "req-p", [3, 17, 4], tokens=40)
    assert p.sched.wait_for_grants(10)  # made off the scheduler's thread
    [grant] = p.sched_transport.grants
    assert grant.worker == types_pb2.WorkerId(engine_id="prefill")
    assert grant.request_id == "req-p"
    assert [(g.transfer_group, list(g.block_ids)) for g in grant.groups] == [(0, [3, 17, 4])]
    # Open: the first pull fixes its use count (no decode TP size configured).
    assert (grant.ttl_ms, grant.max_uses, grant.open_uses) == (30_000, 0, True)
    # Rank 0 is read by every decode: no one may burn its grant by releasing it unread.
    assert grant.unread_release == registry_pb2.UNREAD_RELEASE_REFUSED
    assert rank_capability(kv[CAPABILITY_KEY], 1, 0) == kv[CAPABILITY_KEY]
    p.clock.now += 29.0
    assert p.worker.poll().finished_sending == set()
    assert p.worker_transport.revokes == []
    p.clock.now += 1.5
    assert p.worker.poll().finished_sending == {"req-p"}
    assert [(r.worker.engine_id, r.request_id) for r in p.worker_transport.revokes] == [
        ("prefill", "req-p")
    ]
    d.sched.after_alloc("req-d", dict(kv), [[7, 8, 9]], 40)
    r = step(d)
    assert r.finished_recving == r.failed_recving == {"req-d"}
    assert torch.count_nonzero(d.kv[LAYERS[0]][7:10]) == 0


def test_a_refused_grant_frees_the_offered_blocks_at_the_next_step(
    pair: tuple[Side, Side], caplog: pytest.LogCaptureFixture
) -> None:
    """When the daemon refuses a grant (here the second of two tensor-parallel ranks, which is not
    registered), the capabilities were handed on already (grants are made off vLLM's scheduler
    thread): the first rank's grant is revoked, the error is logged, and the next step tells the
    workers the request is ungranted, so they free its blocks at once (its decode side's pull is
    refused and recomputes)."""
    p, _ = pair
    sched = SchedulerCore("prefill", p.sched.options, tp_size=2, client=p.sched.client)
    params: dict[str, Any] = {"do_remote_decode": True}
    sched.after_alloc("r", params, [[1, 2]], 0)
    with caplog.at_level(logging.ERROR, logger="kvmap.client.connector"):
        keep, kv = sched.request_finished(
            "r", params, finished_normally=True, block_ids=[[1, 2]], num_computed_tokens=20
        )
        assert keep is True and kv is not None and kv[CAPABILITY_KEY]
        assert sched.wait_for_grants(10)
    meta = sched.build_meta()
    assert meta.ungranted == {"r"} and set(meta.send) == {"r"}
    assert "did not grant" in caplog.text
    assert [g.worker.tp_rank for g in p.sched_transport.grants] == [0, 1]
    assert [(r.worker.tp_rank, r.request_id) for r in p.sched_transport.revokes] == [(0, "r")]
    sched.shutdown()


@pytest.mark.parametrize(
    ("capability", "why"),
    [
        (None, "missing"),
        ("", "missing"),
        (42, "missing"),
        ("not a token!", "malformed"),
        ("a" * 9000, "malformed"),
        ("abc.def", "2 capabilities for tensor-parallel size 1"),
    ],
)
def test_params_without_a_valid_capability_never_become_a_pull(
    pair: tuple[Side, Side], capability: Any, why: str
) -> None:
    """kv_transfer_params whose kvmap_capability is missing, not a string, malformed, too long or
    for another tensor-parallel size are still planned as a remote load, but the worker sends no
    pull: the load fails at once (recompute), saying why, and the decode memory is untouched."""
    p, d = pair
    params = dict(prefill_request(p, "req-p", [1, 2], tokens=20))
    if capability is None:
        del params[CAPABILITY_KEY]
    else:
        params[CAPABILITY_KEY] = capability
    sent: list[transfers_pb2.TransferSpec] = []
    d.daemon.pull_hook = sent.append
    assert d.sched.num_new_matched_tokens("req-d", params, 20, 0) == (20, True)
    d.sched.after_alloc("req-d", params, [[7, 8]], 20)
    d.worker.start(d.sched.build_meta())
    r = d.worker.poll()
    assert r.finished_recving == r.failed_recving == {"req-d"}
    assert why in d.worker.loads[-1].error
    assert sent == [] and d.daemon.get_stats().transfers.pulls_done == 0
    assert torch.count_nonzero(d.kv[LAYERS[0]][7:9]) == 0


def test_rank_capability_picks_the_rank_and_refuses_anything_odd() -> None:
    """rank_capability returns the capability of the puller's rank (one per prefill rank, joined by
    ".") and refuses missing, malformed, over-long ones and a count that is not the TP size."""
    assert rank_capability("tok_-9", 1, 0) == "tok_-9"
    assert rank_capability("aaa.bbb", 2, 1) == "bbb"
    for value, tp_size, why in [
        ("", 1, "missing"),
        ("a b", 1, "malformed"),
        ("a..b", 2, "malformed"),
        (".a", 1, "malformed"),
        ("x" * 129, 1, "malformed"),
        ("a.b", 1, "2 capabilities for tensor-parallel size 1"),
        ("a", 2, "1 capabilities for tensor-parallel size 2"),
    ]:
        with pytest.raises(ValueError, match=why):
            rank_capability(value, tp_size, 0)


@pytest.fixture
def serial_pair() -> Iterator[tuple[Side, Side]]:
    """Like ``pair``, but the decode worker runs one pull at a time: a pull
    submitted later starts only once the earlier one has returned."""
    with InprocNetwork() as net:
        p = make_side(net, P_ADDR, "prefill", fill=True)
        d = make_side(net, D_ADDR, "decode", fill=False, max_parallel_pulls=1)
        yield p, d
        for s in (p, d):
            s.worker.shutdown()


def test_pull_that_never_answers_is_given_up_by_the_watchdog(
    serial_pair: tuple[Side, Side],
) -> None:
    """A pull with no answer fails (as a load failure) exactly when the
    watchdog's deadline passes on the worker's clock, not before; when its
    answer does arrive later, it changes nothing: no second report, the load
    stays failed."""
    p, d = serial_pair
    stuck = prefill_request(p, "req-p", [1], tokens=8)
    later = prefill_request(p, "req-p2", [2], tokens=8)
    release = threading.Event()

    def hold_the_first(spec: transfers_pb2.TransferSpec) -> None:
        if spec.request_id == "req-p":
            assert release.wait(30), "never released"

    d.daemon.pull_hook = hold_the_first
    d.sched.after_alloc("req-d", dict(stuck), [[3]], 8)
    d.worker.start(d.sched.build_meta())
    assert d.worker.poll().finished_recving == set()
    d.clock.now += 5.0 + WATCHDOG_GRACE_S - 0.1
    assert d.worker.poll().finished_recving == set()
    d.clock.now += 0.2
    r = d.worker.poll()
    assert r.finished_recving == r.failed_recving == {"req-d"}
    assert "within" in d.worker.loads[-1].error
    # Queued behind the stuck pull (one at a time): once this one finishes,
    # the late answer has provably come back to the worker.
    d.sched.after_alloc("req-d2", dict(later), [[4]], 8)
    d.worker.start(d.sched.build_meta())
    release.set()
    r = step(d, timeout=30)
    assert r.finished_recving == {"req-d2"} and not r.failed_recving
    assert d.daemon.get_stats().transfers.pulls_done == 2  # the late pull did complete
    assert d.worker.poll().finished_recving == set()  # a late answer changes nothing
    assert [(x.request_id, x.ok) for x in d.worker.loads] == [("req-d", False), ("req-d2", True)]
    assert d.worker.load_error_blocks() == {3}


def test_unusable_params_fail_fast_or_are_ignored(pair: tuple[Side, Side]) -> None:
    """Malformed kv_transfer_params are ignored by the scheduler (no remote load); a tensor-parallel
    size mismatch fails the load at once without sending a pull."""
    _, d = pair
    # Malformed params: not a remote prefill at all.
    bad = {"do_remote_prefill": True, "remote_block_ids": [[1]]}
    assert d.sched.num_new_matched_tokens("x", bad, 10, 0) == (0, False)
    # Different TP sizes: the load fails at once (recompute), no pull is sent.
    task = RecvTask(
        "req-d",
        RemoteSource(P_ADDR, "prefill", "req-p", ((1,),), tp_size=2),
        ((4,),),
    )
    d.worker.start(ConnectorMeta(recv=[task]))
    r = d.worker.poll()
    assert r.failed_recving == {"req-d"}
    assert "tensor-parallel size 2" in d.worker.loads[-1].error
    assert d.daemon.get_stats().transfers.pulls_done == 0


def test_decode_request_aborted_before_scheduling_asks_nothing(pair: tuple[Side, Side]) -> None:
    """A decode request aborted before it was scheduled clears its remote-prefill flag and asks for
    no load."""
    p, d = pair
    kv = prefill_request(p, "req-p", [1], tokens=8)
    params = dict(kv)
    assert d.sched.request_finished(
        "req-d", params, finished_normally=False, block_ids=[[]], num_computed_tokens=0
    ) == (False, None)
    assert params["do_remote_prefill"] is False
    assert d.sched.build_meta().recv == []


def test_restarted_decode_daemon_is_rejoined_and_pulls_work_again(
    pair: tuple[Side, Side],
) -> None:
    """After its daemon restarts, the decode worker registers again by itself (the test waits for
    that event) and the next pull moves the right bytes."""
    p, d = pair
    d.daemon.restart(forget_state=True)
    assert d.worker.session is not None
    deadline = time.monotonic() + 5
    while d.worker.session.registrations < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    kv = prefill_request(p, "req-p", [6], tokens=8)
    d.sched.after_alloc("req-d", dict(kv), [[2]], 8)
    r = step(d)
    assert r.finished_recving == {"req-d"} and not r.failed_recving
    assert torch.equal(d.kv[LAYERS[1]][2], p.kv[LAYERS[1]][6])


def test_pair_blocks() -> None:
    """pair_blocks aligns local and remote block lists per group, the remote tail when the remote
    side has more blocks, and refuses a longer local list or a different number of groups."""
    assert pair_blocks(((1, 2),), ((7, 8, 9),)) == (((1, 2),), ((8, 9),))
    assert pair_blocks(((),), ((7,),)) == (((),), ((),))
    with pytest.raises(ValueError, match="group 0"):
        pair_blocks(((1, 2, 3),), ((7,),))
    with pytest.raises(ValueError, match="groups"):
        pair_blocks(((1,), (2,)), ((7,),))


def test_options_from_extra_config() -> None:
    """ConnectorOptions.from_extra_config reads known keys with their types, defaults the socket
    path, and refuses unknown keys, wrong types, non-positive timeouts, bad or missing peer
    addresses."""
    o = ConnectorOptions.from_extra_config(
        {"socket": "/run/kvmap/kvmapd.sock", "peer_address": "10.1.2.3:50051", "lease_seconds": 5},
        producer=True,
    )
    assert (o.socket, o.peer_address, o.lease_seconds) == (
        "/run/kvmap/kvmapd.sock",
        "10.1.2.3:50051",
        5.0,
    )
    assert ConnectorOptions.from_extra_config({}, producer=False).socket.endswith("kvmapd.sock")
    for extra, message in [
        ({"sockett": "/x"}, "unknown keys"),
        ({"lease_seconds": "long"}, "lease_seconds: expected float"),
        ({"transfer_timeout_s": 0}, "transfer_timeout_s: must be positive"),
        ({"peer_address": "nohost"}, "peer_address: expected HOST:PORT"),
        ({}, "peer_address: required"),
    ]:
        with pytest.raises(ValueError, match=message):
            ConnectorOptions.from_extra_config(extra, producer=True)


def test_a_pull_broken_by_its_own_daemon_restarting_is_issued_again(
    pair: tuple[Side, Side],
) -> None:
    """The decode daemon goes down while a pull runs (its stream breaks UNAVAILABLE): the load is
    not failed; once the daemon is back (restarted, the worker registered again by its session)
    the pull is issued again with the same capability and the right bytes land, the load counts
    as received, and the prefill side frees its blocks on the one transfer_finished."""
    p, d = pair
    kv = prefill_request(p, "req-p", [4, 5], tokens=20)
    seen: list[transfers_pb2.TransferSpec] = []
    broke = threading.Event()

    def break_first(spec: transfers_pb2.TransferSpec) -> None:
        seen.append(spec)
        if len(seen) == 1:
            d.daemon.stop()
            broke.set()
            raise Unavailable("UNAVAILABLE: Socket closed")

    d.daemon.pull_hook = break_first
    d.sched.after_alloc("req-d", dict(kv), [[9, 10]], 20)
    d.worker.start(d.sched.build_meta())
    assert broke.wait(5)
    r = d.worker.poll()
    assert not r.finished_recving and d.worker.pending_loads == 1
    d.daemon.restart(forget_state=True)
    r = step(d)
    assert r.finished_recving == {"req-d"} and not r.failed_recving
    # The real daemon may see the pull more than once more: an attempt that
    # reaches it before the session registered the worker again is refused
    # (NOT_FOUND while re-registering) and issued again too.
    assert len(seen) >= 2 and {s.capability for s in seen} == {seen[0].capability}
    assert torch.equal(d.kv[LAYERS[0]][9], p.kv[LAYERS[0]][4])
    assert torch.equal(d.kv[LAYERS[1]][10], p.kv[LAYERS[1]][5])
    assert step(p).finished_sending == {"req-p"}
    assert d.worker.session is not None and d.worker.session.registrations == 2


def test_a_daemon_that_stays_down_fails_the_load_at_its_timeout(pair: tuple[Side, Side]) -> None:
    """When the decode daemon goes down under a pull and does not come back, the pull is issued
    again only until the load's transfer_timeout_s has passed (the test moves the worker's
    clock past it): then the load fails with the daemon's UNAVAILABLE, before the watchdog."""
    p, d = pair
    kv = prefill_request(p, "req-p", [3], tokens=8)
    tries: list[int] = []
    broke = threading.Event()

    def break_it(spec: transfers_pb2.TransferSpec) -> None:
        tries.append(1)
        d.daemon.stop()
        # Past the load's timeout before the worker sees the failure.
        d.clock.now += d.worker.options.transfer_timeout_s
        broke.set()
        raise Unavailable("UNAVAILABLE: Socket closed")

    d.daemon.pull_hook = break_it
    d.sched.after_alloc("req-d", dict(kv), [[6]], 8)
    d.worker.start(d.sched.build_meta())
    assert broke.wait(5)
    r = step(d)
    assert r.finished_recving == r.failed_recving == {"req-d"}
    assert "UNAVAILABLE" in d.worker.loads[-1].error and len(tries) == 1
    assert "no answer from kvmapd" not in d.worker.loads[-1].error


def test_a_refused_pull_is_not_issued_again(pair: tuple[Side, Side]) -> None:
    """A pull its daemon refuses (PERMISSION_DENIED) fails the load after one attempt, and so does
    a peer's UNAVAILABLE reported by a daemon that did not restart."""
    p, d = pair
    tries: list[str] = []

    def refuse(spec: transfers_pb2.TransferSpec) -> None:
        tries.append(spec.request_id)
        if spec.request_id == "req-p1":
            raise PermissionDenied("PERMISSION_DENIED: capability does not allow this transfer")
        raise Unavailable("UNAVAILABLE: remote daemon unreachable")

    d.daemon.pull_hook = refuse
    for i in (1, 2):
        kv = prefill_request(p, f"req-p{i}", [i], tokens=8)
        d.sched.after_alloc(f"req-d{i}", dict(kv), [[i]], 8)
        r = step(d)
        assert r.finished_recving == r.failed_recving == {f"req-d{i}"}
    assert tries == ["req-p1", "req-p2"]


def test_a_second_shutdown_does_nothing(pair: tuple[Side, Side]) -> None:
    """vLLM may shut a worker's connector down twice (an explicit shutdown,
    then the engine's finalizer): the first deregisters the worker, the
    second finds its channel to kvmapd closed and does nothing."""
    p, _ = pair
    check = InprocTransport(p.daemon)
    try:
        assert check.get_stats(5).workers == 1
        p.worker.shutdown()
        p.worker.shutdown()
        assert check.get_stats(5).workers == 0
    finally:
        check.close()
