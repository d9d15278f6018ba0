"""Prefill and decode engines of different tensor-parallel sizes, against
in-process kvmapds: every rank a worker with real shared-memory KV caches in
vLLM's CPU layout holding its own heads; each decode rank pulls its heads
from the prefill rank(s) holding them (token mode); each prefill rank's
grant admits exactly as many pulls as decode ranks read it (configured with
decode_tp_size, or declared by the decode ranks of an open grant), and its
blocks are freed once, after the last of them."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from inproc_daemon import InprocDaemon, InprocNetwork

from kvmap.client.connector import (
    OPEN_GRANTS_KEY,
    READERS_TP_KEY,
    ConnectorOptions,
    RecvTask,
    RemoteSource,
    SchedulerCore,
    TransferResults,
    WorkerCore,
    rank_capability,
    tp_readers,
)
from kvmap.client.geometry import LayerSpec, export_registration, head_layout
from kvmap.core.errors import FailedPrecondition, PermissionDenied, Unimplemented
from kvmap.core.reshard import rank_heads, source_ranks, source_readers
from kvmap.v1 import registry_pb2, types_pb2

HEADS, HEAD_SIZE, BLOCK, NUM_BLOCKS = 4, 4, 16, 12
LAYERS = ("model.layers.0.attn", "model.layers.1.attn")
P_ADDR, D_ADDR = "10.0.0.1:50051", "10.0.0.2:50051"
PBLOCKS, DBLOCKS, TOKENS = [5, 1, 9], [4, 0, 7], 40


def options(addr: str, decode_tp_size: int = 0) -> ConnectorOptions:
    return ConnectorOptions(
        socket="/unused",
        transfer_timeout_s=5.0,
        lease_seconds=30.0,
        register_timeout_s=2.0,
        peer_address=addr,
        decode_tp_size=decode_tp_size,
    )


class CountingWorker(WorkerCore):
    """A worker that counts the finished-transfer events its session
    delivered (on the session's thread), so a test knows when a pull's
    event has reached the worker before it asks what was freed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.events_seen = 0
        self._seen = threading.Condition()

    def on_event(self, event: registry_pb2.AttachResponse) -> None:
        super().on_event(event)
        if event.WhichOneof("event") == "transfer_finished":
            with self._seen:
                self.events_seen += 1
                self._seen.notify_all()

    def wait_events(self, count: int) -> None:
        with self._seen:
            assert self._seen.wait_for(lambda: self.events_seen >= count, timeout=10.0)


@dataclass
class Engine:
    sched: SchedulerCore
    workers: list[CountingWorker]
    kv: list[dict[str, torch.Tensor]]  # per rank: [blocks, heads, tokens, 2 x head_size]

    def head(self, name: str, h: int) -> torch.Tensor:
        """Global KV head ``h`` of a layer as [blocks, tokens, 2 x head_size]
        bytes, from the rank holding it (the first replica)."""
        tp = len(self.workers)
        for r in range(tp):
            held = rank_heads(HEADS, tp, r)
            if h in held:
                return self.kv[r][name][:, h - held.start]
        raise AssertionError(f"no rank holds head {h}")

    def shutdown(self) -> None:
        for w in self.workers:
            w.shutdown()


def make_engine(
    net: InprocNetwork,
    addr: str,
    engine: str,
    tp: int,
    *,
    decode_tp_size: int = 0,
    features: Sequence[registry_pb2.DaemonFeature.ValueType] | None = None,
) -> Engine:
    daemon = net.daemon()
    addr = daemon.target  # what the connector's peer_address names
    if features is not None:  # an older kvmapd, which lists fewer
        daemon.listed_features = tuple(features)
    per_rank = max(HEADS // tp, 1)
    specs = {n: LayerSpec(0, types_pb2.CACHE_KIND_MHA, NUM_BLOCKS) for n in LAYERS}
    kvs = []
    for r in range(tp):
        kv = {}
        for i, name in enumerate(LAYERS):
            g = torch.Generator().manual_seed(7 + 10 * r + i + tp * 100)
            shape = (NUM_BLOCKS, per_rank, BLOCK, 2 * HEAD_SIZE)
            kv[name] = torch.randint(0, 255, shape, generator=g, dtype=torch.uint8)
        kvs.append(kv)
    return assemble(daemon, options(addr, decode_tp_size), engine, specs, kvs, kv_heads=HEADS)


def assemble(
    daemon: InprocDaemon,
    opts: ConnectorOptions,
    engine: str,
    specs: dict[str, LayerSpec],
    kvs: list[dict[str, torch.Tensor]],
    *,
    kv_heads: int = 0,
    replicated: bool = False,
) -> Engine:
    """An engine of one registered worker per rank's caches in ``kvs`` (a head layout
    published where the model has ``kv_heads``) and its scheduler, on ``daemon``."""
    tp = len(kvs)
    workers = []
    for r, kv in enumerate(kvs):
        wid = types_pb2.WorkerId(engine_id=engine, tp_rank=r)
        heads = (
            head_layout(
                kv, specs, total_kv_heads=kv_heads, head_size=HEAD_SIZE, tp_size=tp,
                block_tokens=BLOCK,
            )
            if kv_heads
            else None
        )  # fmt: skip
        req, fds = export_registration(
            wid, kv, specs, block_size_tokens=BLOCK, tp_size=tp, head_layout=heads
        )
        worker = CountingWorker(
            daemon.client(), wid, opts,
            tp_size=tp, block_size=BLOCK, kv_heads=kv_heads, replicated=replicated,
        )  # fmt: skip
        worker.register(req, fds)
        workers.append(worker)
    sched = SchedulerCore(
        engine, opts, client=daemon.client(), tp_size=tp,
        block_size=BLOCK, kv_heads=kv_heads, replicated=replicated,
    )  # fmt: skip
    return Engine(sched, workers, kvs)


@pytest.fixture
def net() -> Iterator[InprocNetwork]:
    with InprocNetwork() as network:
        yield network


def offer(p: Engine, rid: str) -> dict[str, Any]:
    """The prefill engine finishes a request and offers its blocks (every
    rank's worker sees every step's metadata, as in vLLM)."""
    params: dict[str, Any] = {"do_remote_decode": True}
    p.sched.after_alloc(rid, params, [PBLOCKS], 0)
    meta = p.sched.build_meta()
    for w in p.workers:
        w.start(meta)
    keep, kv = p.sched.request_finished(
        rid, params, finished_normally=True, block_ids=[PBLOCKS], num_computed_tokens=TOKENS
    )
    assert keep and kv is not None
    meta = p.sched.build_meta()
    for w in p.workers:
        w.start(meta)
    return kv


def load(d: Engine, rid: str, kv: dict[str, Any], ranks: list[int]) -> list[TransferResults]:
    """The decode engine schedules the request; ``ranks`` of its workers run
    their loads (the others are left for later: ``load_on``)."""
    params = dict(kv)
    d.sched.after_alloc(rid, params, [DBLOCKS], TOKENS)
    meta = d.sched.build_meta()
    return [load_on(d.workers[r], meta) for r in ranks]


def load_on(worker: WorkerCore, meta: Any) -> TransferResults:
    worker.start(meta)
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        r = worker.poll()
        if r.finished_recving:
            return r
        time.sleep(0.01)  # polling a background pull, as vLLM's steps do
    raise AssertionError("the load never finished")


def freed(p: Engine, rid: str, pulls: list[int]) -> list[int]:
    """Whether each prefill rank reported ``rid`` as sent (freed) now, once
    the events of the ``pulls`` each has served so far have reached it."""
    for w, n in zip(p.workers, pulls, strict=True):
        w.wait_events(n)
    return [int(rid in w.poll().finished_sending) for w in p.workers]


def tokens(head: torch.Tensor) -> torch.Tensor:
    """One head's [blocks, tokens, 2 x head_size] bytes as (K, V) per token:
    vLLM's CPU cache keeps per head K transposed, then V."""
    halves = head.reshape(NUM_BLOCKS, 2, BLOCK * HEAD_SIZE)
    k = halves[:, 0].reshape(NUM_BLOCKS, HEAD_SIZE, BLOCK).transpose(1, 2)
    v = halves[:, 1].reshape(NUM_BLOCKS, BLOCK, HEAD_SIZE)
    return torch.cat([k, v], dim=2)


def heads_arrived(p: Engine, d: Engine, d_rank: int) -> bool:
    """Every (layer, head of ``d_rank``, token) of the prompt equals the prefill's."""
    d_tp = len(d.workers)
    held = rank_heads(HEADS, d_tp, d_rank)
    for name in LAYERS:
        for h in held:
            src = tokens(p.head(name, h))
            dst = tokens(d.kv[d_rank][name][:, h - held.start])
            for t in range(TOKENS):
                a = src[PBLOCKS[t // BLOCK], t % BLOCK]
                b = dst[DBLOCKS[t // BLOCK], t % BLOCK]
                if not torch.equal(a, b):
                    return False
    return True


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1), (2, 4), (4, 2), (1, 4)])
def test_loads_between_tp_sizes(net: InprocNetwork, p_tp: int, d_tp: int) -> None:
    """Prefill TP ``p_tp`` -> decode TP ``d_tp``: every decode rank gets every byte of its
    heads; each prefill rank frees its blocks exactly once, only after the last decode rank
    reading it has pulled; and a replay of any rank's capability is then refused."""
    p = make_engine(net, P_ADDR, "prefill", p_tp, decode_tp_size=d_tp)
    d = make_engine(net, D_ADDR, "decode", d_tp)
    kv = offer(p, "req-p")
    assert kv[READERS_TP_KEY] == d_tp
    readers = tp_readers(HEADS, p_tp, d_tp)
    params = dict(kv)
    d.sched.after_alloc("req-d", params, [DBLOCKS], TOKENS)
    meta = d.sched.build_meta()
    pulled = [0] * p_tp
    sent = [0] * p_tp
    for r in range(d_tp):
        result = load_on(d.workers[r], meta)
        assert not result.failed_recving, d.workers[r].loads[-1].error
        assert heads_arrived(p, d, r)
        for src, _ in source_ranks(HEADS, p_tp, d_tp, r, replicated=False):
            pulled[src] += 1
        sent = [a + b for a, b in zip(sent, freed(p, "req-p", pulled), strict=True)]
        # A rank is freed once all of its readers pulled, never before.
        assert sent == [int(pulled[s] == readers[s]) for s in range(p_tp)]
    assert sent == [1] * p_tp
    assert freed(p, "req-p", pulled) == [0] * p_tp
    task = RecvTask("again", RemoteSource.parse(kv), ((DBLOCKS[0],),))
    for spec in d.workers[0].specs_for(task):
        with pytest.raises(PermissionDenied):
            d.workers[0].client.pull(spec)
    p.shutdown()
    d.shutdown()


def test_a_grant_admits_only_its_readers(net: InprocNetwork) -> None:
    """Prefill TP1 -> decode TP2: the one grant admits two pulls. A third party replaying the
    capability before the second decode rank pulls uses up the grant: the second rank's load
    then fails (vLLM recomputes) rather than reading a third time, and the prefill frees once."""
    p = make_engine(net, P_ADDR, "prefill", 1, decode_tp_size=2)
    d = make_engine(net, D_ADDR, "decode", 2)
    kv = offer(p, "req-p")
    params = dict(kv)
    d.sched.after_alloc("req-d", params, [DBLOCKS], TOKENS)
    meta = d.sched.build_meta()
    assert not load_on(d.workers[0], meta).failed_recving
    assert freed(p, "req-p", [1]) == [0]
    task = RecvTask("replay", RemoteSource.parse(kv), ((DBLOCKS[0],),))
    for spec in d.workers[0].specs_for(task):
        d.workers[0].client.pull(spec)  # the replay: the second (last) use
    assert freed(p, "req-p", [2]) == [1]
    assert load_on(d.workers[1], meta).failed_recving == {"req-d"}
    assert "PERMISSION_DENIED" in d.workers[1].loads[-1].error
    assert freed(p, "req-p", [2]) == [0]
    p.shutdown()
    d.shutdown()


def test_decode_of_another_tp_than_the_grants_is_refused(net: InprocNetwork) -> None:
    """A prefill engine that sized its grants for decode TP2 and a decode engine of TP1 (or the
    prefill's TP2 without saying so): the load fails fast naming both sizes, nothing is
    pulled, and the prefill's blocks wait for their lease."""
    p = make_engine(net, P_ADDR, "prefill", 1, decode_tp_size=2)
    d = make_engine(net, D_ADDR, "decode", 1)
    kv = offer(p, "req-p")
    (r,) = load(d, "req-d", kv, [0])
    assert r.failed_recving == {"req-d"}
    assert "expects decode engines of tensor-parallel size 2, this one runs 1" in (
        d.workers[0].loads[-1].error
    )
    assert freed(p, "req-p", [0]) == [0]
    legacy = dict(kv, tp_size=2)
    del legacy[READERS_TP_KEY]
    legacy["kvmap_capability"] = kv["kvmap_capability"] + "." + kv["kvmap_capability"]
    (r,) = load(d, "req-d2", legacy, [0])
    assert "expects decode engines of tensor-parallel size 2, this one runs 1" in (
        d.workers[0].loads[-1].error
    )
    p.shutdown()
    d.shutdown()


@pytest.mark.parametrize(
    ("tp_size", "error"),
    [
        (0, "tp_size: 0 is not a TP size"),
        (-2, "tp_size: -2 is not a TP size"),
        (65, "tp_size: 65 is not a TP size"),
        (3, "do not split evenly over tp_size 3"),
        (8, "kvmap_capability: 1 capabilities for tensor-parallel size 8"),
    ],
)
def test_hostile_prefill_tp_size_is_refused(net: InprocNetwork, tp_size: int, error: str) -> None:
    """Params naming a prefill TP size that is no TP size, that the heads do not split over, or
    that does not match its capabilities: the load fails fast naming the problem, nothing is
    pulled and the decode worker keeps serving."""
    p = make_engine(net, P_ADDR, "prefill", 1, decode_tp_size=2)
    d = make_engine(net, D_ADDR, "decode", 2)
    kv = dict(offer(p, "req-p"), tp_size=tp_size)
    kv[READERS_TP_KEY] = 2
    (r,) = load(d, "req-d", kv, [0])
    assert r.failed_recving == {"req-d"}
    assert error in d.workers[0].loads[-1].error
    assert freed(p, "req-p", [0]) == [0]
    p.shutdown()
    d.shutdown()


def test_tp_readers() -> None:
    """Readers per prefill rank: one each between equal sizes (no head count needed), the
    decode ranks sharing each rank's heads otherwise; a prefill rank no decode rank reads
    (replicated heads) or sizes the heads do not split over are refused at start-up."""
    assert tp_readers(0, 2, 2) == (1, 1)
    assert tp_readers(4, 1, 2) == (2,)
    assert tp_readers(4, 2, 1) == (1, 1)
    assert tp_readers(4, 2, 8) == (4, 4)
    assert tp_readers(1, 1, 4, replicated=True) == (4,)
    with pytest.raises(ValueError, match="prefill rank 1 of tensor-parallel size 8"):
        tp_readers(4, 8, 2)
    with pytest.raises(ValueError, match="KV head count"):
        tp_readers(0, 1, 2)
    with pytest.raises(ValueError, match="do not split evenly"):
        tp_readers(4, 1, 3)
    with pytest.raises(ValueError, match="decode_tp_size: must be in"):
        ConnectorOptions.from_extra_config({"decode_tp_size": 65})
    with pytest.raises(ValueError, match="decode_tp_size: must be in"):
        ConnectorOptions.from_extra_config({"decode_tp_size": -1})


POW2 = st.sampled_from([1, 2, 4, 8, 16])


@given(heads=POW2, p_tp=POW2, d_tp=POW2, replicated=st.booleans())
def test_tp_readers_count_every_pull(heads: int, p_tp: int, d_tp: int, replicated: bool) -> None:
    """For any power-of-two sizes: the readers sum to the pulls the decode ranks make, each
    decode rank pulls from a prefill rank at most once, and no rank is left unread."""
    pulls = [
        [s for s, _ in source_ranks(heads, p_tp, d_tp, r, replicated=replicated)]
        for r in range(d_tp)
    ]
    assert all(len(set(p)) == len(p) for p in pulls)
    counts = [sum(p.count(s) for p in pulls) for s in range(p_tp)]
    if p_tp == d_tp:
        assert tp_readers(heads, p_tp, d_tp, replicated=replicated) == (1,) * p_tp
    elif replicated:
        # A replicated cache: a rank no one reads counts 0 (granted nothing).
        assert tp_readers(heads, p_tp, d_tp, replicated=True) == tuple(counts)
    elif 0 in counts:
        with pytest.raises(ValueError, match="holds no heads"):
            tp_readers(heads, p_tp, d_tp, replicated=replicated)
    else:
        assert tp_readers(heads, p_tp, d_tp, replicated=replicated) == tuple(counts)


MLA_LAYERS = {
    "model.layers.0.attn": types_pb2.CACHE_KIND_MLA,
    "model.layers.0.attn.indexer": types_pb2.CACHE_KIND_INDEXER,
    "model.layers.1.attn": types_pb2.CACHE_KIND_MLA,
}
MLA_DIM = 24  # bytes per token of one layer's latent (or indexer) cache


def make_mla_engine(
    net: InprocNetwork, addr: str, engine: str, tp: int, *, decode_tp_size: int = 0
) -> Engine:
    """An MLA engine (latent and indexer caches, [blocks, tokens, dim], no head layout): every
    rank holds the whole cache; here each rank's bytes differ, so a decode rank's bytes tell
    which prefill rank it read."""
    specs = {n: LayerSpec(0, kind, NUM_BLOCKS) for n, kind in MLA_LAYERS.items()}
    kvs = []
    for r in range(tp):
        kv = {}
        for i, name in enumerate(MLA_LAYERS):
            g = torch.Generator().manual_seed(11 + 10 * r + i + tp * 100 + len(engine))
            shape = (NUM_BLOCKS, BLOCK, MLA_DIM)
            kv[name] = torch.randint(0, 255, shape, generator=g, dtype=torch.uint8)
        kvs.append(kv)
    daemon = net.daemon()
    opts = options(daemon.target, decode_tp_size)
    return assemble(daemon, opts, engine, specs, kvs, replicated=True)


def mla_arrived(p: Engine, p_rank: int, d: Engine, d_rank: int) -> bool:
    """Every layer's prompt blocks on decode rank ``d_rank`` equal prefill rank ``p_rank``'s."""
    return all(
        torch.equal(d.kv[d_rank][name][DBLOCKS], p.kv[p_rank][name][PBLOCKS]) for name in MLA_LAYERS
    )


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1), (4, 2), (2, 8), (1, 4)])
def test_mla_loads_between_tp_sizes(net: InprocNetwork, p_tp: int, d_tp: int) -> None:
    """MLA + indexer caches, prefill TP ``p_tp`` -> decode TP ``d_tp``: decode rank d reads all
    of its blocks, byte for byte, from prefill rank d % p_tp alone; each prefill rank read by
    someone frees exactly once, after its last reader; a rank no one reads is granted nothing
    and frees at once; and each grant admits no more pulls than its readers."""
    p = make_mla_engine(net, P_ADDR, "prefill", p_tp, decode_tp_size=d_tp)
    d = make_mla_engine(net, D_ADDR, "decode", d_tp)
    readers = tp_readers(0, p_tp, d_tp, replicated=True)
    assert readers == tuple(sum(r % p_tp == s for r in range(d_tp)) for s in range(p_tp))
    kv = offer(p, "req-p")
    assert kv[READERS_TP_KEY] == d_tp
    # Unread ranks were freed on the step the request was offered (not granted anything).
    unread = [int(n == 0) for n in readers]
    assert [int("req-p" in w.poll().finished_sending) for w in p.workers] == unread
    params = dict(kv)
    d.sched.after_alloc("req-d", params, [DBLOCKS], TOKENS)
    meta = d.sched.build_meta()
    pulled = [0] * p_tp
    sent = list(unread)
    for r in range(d_tp):
        (spec,) = d.workers[r].specs_for(RecvTask("req-d", RemoteSource.parse(kv), (DBLOCKS,)))
        assert spec.remote_worker.tp_rank == r % p_tp
        result = load_on(d.workers[r], meta)
        assert not result.failed_recving, d.workers[r].loads[-1].error
        assert mla_arrived(p, r % p_tp, d, r)
        pulled[r % p_tp] += 1
        sent = [a + b for a, b in zip(sent, freed(p, "req-p", pulled), strict=True)]
        assert sent == [int(pulled[s] == readers[s] or readers[s] == 0) for s in range(p_tp)]
    assert sent == [1] * p_tp
    assert freed(p, "req-p", pulled) == [0] * p_tp
    # Every grant is used up: a replay of each read rank's capability is refused.
    for r in range(min(p_tp, d_tp)):
        (spec,) = d.workers[r].specs_for(RecvTask("again", RemoteSource.parse(kv), (DBLOCKS,)))
        with pytest.raises(PermissionDenied):
            d.workers[r].client.pull(spec)
    p.shutdown()
    d.shutdown()


def test_mla_grant_admits_only_its_readers(net: InprocNetwork) -> None:
    """MLA, prefill TP1 -> decode TP2: the one grant admits two pulls; a replay before the
    second decode rank pulls uses it up, so that rank's load fails (vLLM recomputes) and the
    prefill frees once."""
    p = make_mla_engine(net, P_ADDR, "prefill", 1, decode_tp_size=2)
    d = make_mla_engine(net, D_ADDR, "decode", 2)
    kv = offer(p, "req-p")
    d.sched.after_alloc("req-d", dict(kv), [DBLOCKS], TOKENS)
    meta = d.sched.build_meta()
    assert not load_on(d.workers[0], meta).failed_recving
    assert freed(p, "req-p", [1]) == [0]
    (spec,) = d.workers[0].specs_for(RecvTask("replay", RemoteSource.parse(kv), (DBLOCKS,)))
    d.workers[0].client.pull(spec)  # the replay: the second (last) use
    assert freed(p, "req-p", [2]) == [1]
    assert load_on(d.workers[1], meta).failed_recving == {"req-d"}
    assert "PERMISSION_DENIED" in d.workers[1].loads[-1].error
    assert freed(p, "req-p", [2]) == [0]
    p.shutdown()
    d.shutdown()


def test_mla_unread_rank_capability_is_refused(net: InprocNetwork) -> None:
    """MLA, prefill TP2 -> decode TP1: rank 1 is read by no one, so its place in the
    capabilities holds no grant; params that would send a decode rank there fail fast."""
    p = make_mla_engine(net, P_ADDR, "prefill", 2, decode_tp_size=1)
    kv = offer(p, "req-p")
    first, second = kv["kvmap_capability"].split(".")
    assert first != "-" and second == "-"
    with pytest.raises(ValueError, match="prefill rank 1 granted no transfer"):
        rank_capability(kv["kvmap_capability"], 2, 1)
    assert rank_capability(kv["kvmap_capability"], 2, 0) == first
    p.shutdown()


# Open grants (no decode_tp_size on the prefill engine) ------------------------


def events_after(
    p_tp: int, d_tp: int, readers: tuple[int, ...], upto: int, *, replicated: bool = False
) -> list[int]:
    """Finished-transfer events each prefill rank has had once decode ranks 0..``upto`` ran
    their loads: a pull per reader, and (decode rank 0's) a release per unread rank."""
    pulled = [0] * p_tp
    for r in range(upto + 1):
        for src, _ in source_ranks(HEADS, p_tp, d_tp, r, replicated=replicated):
            pulled[src] += 1
    return [n if readers[s] else 1 for s, n in enumerate(pulled)]


def pulled_heads_arrived(p: Engine, d: Engine, d_rank: int) -> bool:
    """Every (layer, head of ``d_rank``, token) of the prompt equals the bytes of the prefill
    rank ``source_ranks`` reads it from (replicated heads: each replica's bytes differ here)."""
    p_tp, d_tp = len(p.workers), len(d.workers)
    held = rank_heads(HEADS, d_tp, d_rank)
    for src, heads in source_ranks(HEADS, p_tp, d_tp, d_rank, replicated=False):
        src_held = rank_heads(HEADS, p_tp, src)
        for name in LAYERS:
            for h in heads:
                a = tokens(p.kv[src][name][:, h - src_held.start])
                b = tokens(d.kv[d_rank][name][:, h - held.start])
                for t in range(TOKENS):
                    if not torch.equal(
                        a[PBLOCKS[t // BLOCK], t % BLOCK], b[DBLOCKS[t // BLOCK], t % BLOCK]
                    ):
                        return False
    return True


def check_open_loads(
    p: Engine, d: Engine, arrived: Any, *, replicated: bool = False
) -> dict[str, Any]:
    """Offer one request and load it on every decode rank in turn: each rank's bytes arrive;
    each prefill rank frees its blocks exactly once, right after its last reader (a rank no
    one reads right after decode rank 0 released it); and every grant is then used up."""
    p_tp, d_tp = len(p.workers), len(d.workers)
    kv = offer(p, "req-p")
    assert READERS_TP_KEY not in kv and kv[OPEN_GRANTS_KEY] is True
    readers = source_readers(HEADS, p_tp, d_tp, replicated=replicated)
    assert freed(p, "req-p", [0] * p_tp) == [0] * p_tp  # nothing before any decode rank
    params = dict(kv)
    d.sched.after_alloc("req-d", params, [DBLOCKS], TOKENS)
    meta = d.sched.build_meta()
    sent = [0] * p_tp
    for r in range(d_tp):
        result = load_on(d.workers[r], meta)
        assert not result.failed_recving, d.workers[r].loads[-1].error
        assert arrived(r)
        seen = events_after(p_tp, d_tp, readers, r, replicated=replicated)
        sent = [a + b for a, b in zip(sent, freed(p, "req-p", seen), strict=True)]
        assert sent == [int(seen[s] == max(readers[s], 1)) for s in range(p_tp)]
    assert sent == [1] * p_tp
    assert freed(p, "req-p", seen) == [0] * p_tp
    for w in p.workers:
        assert w.pending_sends == 0
    return kv


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (2, 8), (8, 2)])
def test_open_grants_between_tp_sizes(net: InprocNetwork, p_tp: int, d_tp: int) -> None:
    """No decode_tp_size: prefill TP ``p_tp`` grants every rank openly; decode TP ``d_tp``
    declares each prefill rank's readers. Every decode rank gets every byte of its heads, each
    prefill rank frees once after its last reader, one no one reads (8 -> 2: replicated heads)
    right after decode rank 0 released it, and no capability admits a further pull."""
    p = make_engine(net, P_ADDR, "prefill", p_tp)
    d = make_engine(net, D_ADDR, "decode", d_tp)
    kv = check_open_loads(p, d, lambda r: pulled_heads_arrived(p, d, r))
    task = RecvTask("again", RemoteSource.parse(kv), ((DBLOCKS[0],),))
    for spec in d.workers[0].specs_for(task):
        with pytest.raises(PermissionDenied):
            d.workers[0].client.pull(spec)
    for spec in d.workers[0].release_specs(task, pulling=True):  # the unread ranks'
        with pytest.raises(PermissionDenied):
            d.workers[0].client.pull(spec)
    p.shutdown()
    d.shutdown()


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1), (4, 2), (2, 8), (1, 4)])
def test_mla_open_grants_between_tp_sizes(net: InprocNetwork, p_tp: int, d_tp: int) -> None:
    """MLA + indexer caches without decode_tp_size: decode rank d reads prefill rank d % p_tp
    byte for byte; each read prefill rank frees once after its last reader, and an unread one
    as soon as decode rank 0 released its grant (not at lease expiry)."""
    p = make_mla_engine(net, P_ADDR, "prefill", p_tp)
    d = make_mla_engine(net, D_ADDR, "decode", d_tp)
    check_open_loads(p, d, lambda r: mla_arrived(p, r % p_tp, d, r), replicated=True)
    p.shutdown()
    d.shutdown()


def test_a_declared_count_other_than_the_first_is_refused(net: InprocNetwork) -> None:
    """Prefill TP1, open grant: decode rank 0 of a TP2 engine fixes it at 2 readers; a pull
    declaring 1 (a TP1 decode engine given the same params) is FAILED_PRECONDITION and the
    prefill keeps the blocks for the second reader."""
    p = make_engine(net, P_ADDR, "prefill", 1)
    d = make_engine(net, D_ADDR, "decode", 2)
    kv = offer(p, "req-p")
    d.sched.after_alloc("req-d", dict(kv), [DBLOCKS], TOKENS)
    assert not load_on(d.workers[0], d.sched.build_meta()).failed_recving
    assert freed(p, "req-p", [1]) == [0]
    (spec,) = d.workers[0].specs_for(RecvTask("x", RemoteSource.parse(kv), ((DBLOCKS[0],),)))
    spec.readers = 1
    with pytest.raises(FailedPrecondition, match="admits 2 readers; the caller declared 1"):
        d.workers[0].client.pull(spec)
    assert freed(p, "req-p", [1]) == [0]
    p.shutdown()
    d.shutdown()


def release_everywhere(d: Engine, kv: dict[str, Any], *, scheduled: bool = True) -> None:
    """The decode engine needs none of the request's blocks: its scheduler allocates none to
    load (a full prefix-cache hit) or the request ends before it is scheduled; every worker
    runs the step's releases."""
    params = dict(kv)
    if scheduled:
        d.sched.after_alloc("req-d", params, [DBLOCKS], 0)
    else:
        d.sched.request_finished(
            "req-d", params, finished_normally=False, block_ids=[], num_computed_tokens=0
        )
    meta = d.sched.build_meta()
    assert [t.request_id for t in meta.release] == ["req-d"] and not meta.recv
    for w in d.workers:
        w.start(meta)
        assert not w.poll().finished_recving


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "decode_tp_size", "scheduled"),
    [(1, 2, 0, True), (2, 4, 0, False), (4, 2, 0, True), (1, 2, 2, True), (2, 2, 0, True)],
)
def test_a_decode_needing_no_block_releases_its_uses(
    net: InprocNetwork, p_tp: int, d_tp: int, decode_tp_size: int, scheduled: bool
) -> None:
    """A decode engine that loads none of the blocks (all in its prefix cache, or the request
    ended unscheduled): each rank releases its use of every prefill rank it would have read,
    open grants or ones sized by decode_tp_size alike; each prefill rank frees its blocks
    once, when the last release arrives, without waiting for its lease; no byte moved."""
    p = make_engine(net, P_ADDR, "prefill", p_tp, decode_tp_size=decode_tp_size)
    d = make_engine(net, D_ADDR, "decode", d_tp)
    before = [{n: t.clone() for n, t in kv.items()} for kv in d.kv]
    kv = offer(p, "req-p")
    release_everywhere(d, kv, scheduled=scheduled)
    readers = source_readers(HEADS, p_tp, d_tp, replicated=False)
    assert freed(p, "req-p", list(readers)) == [1] * p_tp
    assert freed(p, "req-p", list(readers)) == [0] * p_tp
    assert all(w.pending_sends == 0 for w in p.workers)
    assert all(torch.equal(before[r][n], d.kv[r][n]) for r in range(d_tp) for n in LAYERS)
    p.shutdown()
    d.shutdown()


def test_mla_decode_needing_no_block_releases_unread_ranks_too(net: InprocNetwork) -> None:
    """MLA, prefill TP2 -> decode TP1 needing no block: decode rank 0 releases its use of
    prefill rank 0 and the grant of rank 1 (no one reads it): both free at once, once."""
    p = make_mla_engine(net, P_ADDR, "prefill", 2)
    d = make_mla_engine(net, D_ADDR, "decode", 1)
    kv = offer(p, "req-p")
    release_everywhere(d, kv)
    assert freed(p, "req-p", [1, 1]) == [1, 1]
    assert freed(p, "req-p", [1, 1]) == [0, 0]
    p.shutdown()
    d.shutdown()


@given(heads=POW2, p_tp=POW2, d_tp=POW2, replicated=st.booleans())
def test_source_readers_count_every_pull(
    heads: int, p_tp: int, d_tp: int, replicated: bool
) -> None:
    """For any power-of-two sizes, each prefill rank's reader count is the number of decode
    ranks pulling from it (0 for a rank no one reads), the counts sum to the pulls, and they
    are tp_readers' wherever that accepts the sizes (the explicit decode_tp_size)."""
    pulls = [
        [s for s, _ in source_ranks(heads, p_tp, d_tp, r, replicated=replicated)]
        for r in range(d_tp)
    ]
    counts = source_readers(heads, p_tp, d_tp, replicated=replicated)
    if p_tp == d_tp:
        assert counts == (1,) * p_tp
        return
    assert counts == tuple(sum(p.count(s) for p in pulls) for s in range(p_tp))
    assert sum(counts) == sum(len(p) for p in pulls)
    if replicated or 0 not in counts:
        assert tp_readers(heads, p_tp, d_tp, replicated=replicated) == counts


def test_a_decode_kvmapd_without_the_release_rpc_gets_the_deprecated_flag(
    net: InprocNetwork, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decode engine's kvmapd is of the release before Transfers.Release (it
    lists every feature but DAEMON_FEATURE_RELEASE_RPC): a decode needing no
    block releases through a pull with the deprecated release flag, never the
    RPC that kvmapd would not know, and each prefill rank frees its blocks once,
    just as through the RPC."""
    older = [
        f
        for f in registry_pb2.DaemonFeature.values()
        if f
        not in (registry_pb2.DAEMON_FEATURE_UNSPECIFIED, registry_pb2.DAEMON_FEATURE_RELEASE_RPC)
    ]
    p = make_engine(net, P_ADDR, "prefill", 2)
    d = make_engine(net, D_ADDR, "decode", 1, features=older)

    def no_release_rpc(*args: object, **kwargs: object) -> None:
        raise Unimplemented("this kvmapd has no Transfers.Release")

    for w in d.workers:
        monkeypatch.setattr(w.client, "release", no_release_rpc)
    kv = offer(p, "req-p")
    release_everywhere(d, kv)
    for w in d.workers:  # every background call the step made has ended
        w._pool.shutdown(wait=True)
    assert sum(w.released for w in d.workers) == 2
    assert freed(p, "req-p", [1, 1]) == [1, 1]
    assert freed(p, "req-p", [1, 1]) == [0, 0]
    p.shutdown()
    d.shutdown()


def test_an_older_decode_kvmapd_gets_no_release(net: InprocNetwork) -> None:
    """The decode engine's kvmapd lists no features (a release before it was
    one: it would take it for a pull of nothing): a decode needing no block
    sends no release, and the prefill ranks keep their blocks for their lease."""
    p = make_engine(net, P_ADDR, "prefill", 1)
    d = make_engine(net, D_ADDR, "decode", 2, features=())
    kv = offer(p, "req-p")
    release_everywhere(d, kv)
    for w in d.workers:  # every background call the step made has ended
        w._pool.shutdown(wait=True)
    assert all(w.released == 0 for w in d.workers)
    assert p.workers[0].events_seen == 0
    assert [int("req-p" in w.poll().finished_sending) for w in p.workers] == [0]
    assert all(w.pending_sends == 1 for w in p.workers)
    p.shutdown()
    d.shutdown()


def test_an_older_decode_kvmapd_does_not_declare_readers(net: InprocNetwork) -> None:
    """Prefill TP1 -> decode TP2 (two readers of the one prefill rank) through
    a decode kvmapd that lists token mode but not open grants: it would drop the
    declared count, so each rank's load fails naming the feature (vLLM
    recomputes) and no byte moves."""
    p = make_engine(net, P_ADDR, "prefill", 1)
    d = make_engine(net, D_ADDR, "decode", 2, features=(registry_pb2.DAEMON_FEATURE_TOKEN_MODE,))
    before = [{n: t.clone() for n, t in kv.items()} for kv in d.kv]
    kv = offer(p, "req-p")
    d.sched.after_alloc("req-d", dict(kv), [DBLOCKS], TOKENS)
    assert load_on(d.workers[0], d.sched.build_meta()).failed_recving == {"req-d"}
    assert "DAEMON_FEATURE_OPEN_GRANTS" in d.workers[0].loads[-1].error
    assert all(torch.equal(before[0][n], d.kv[0][n]) for n in LAYERS)
    p.shutdown()
    d.shutdown()
