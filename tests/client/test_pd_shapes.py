"""Engines that cut the KV cache differently, against in-process kvmapds: real
shared-memory KV caches laid out as vLLM's CPU backend lays them out
([blocks, heads, tokens, 2 x head_size]: per head, K transposed, then V),
as HND or as NHD; the head layout each worker publishes in its region map;
token-mode pulls between block grids byte for byte, by hand and by the
decode connector (a local prefix hit that ends inside a prefill block
included); and what the connector refuses (other TP sizes)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from inproc_daemon import InprocDaemon, InprocNetwork

from kvmap.client.connector import ConnectorOptions, SchedulerCore, WorkerCore, map_token_ranges
from kvmap.client.geometry import (
    GeometryError,
    LayerSpec,
    export_registration,
    head_layout,
    token_layout,
)
from kvmap.core.errors import InvalidArgument
from kvmap.v1 import registry_pb2, transfers_pb2, types_pb2

HEADS, HEAD_SIZE, CAPACITY = 2, 4, 192  # tokens of KV cache per worker
LAYERS = ("model.layers.0.attn", "model.layers.1.attn")
P_ADDR, D_ADDR = "10.0.0.1:50051", "10.0.0.2:50051"


def options(addr: str) -> ConnectorOptions:
    return ConnectorOptions(
        socket="/unused",
        transfer_timeout_s=5.0,
        lease_seconds=30.0,
        register_timeout_s=2.0,
        peer_address=addr,
    )


@dataclass
class Side:
    daemon: InprocDaemon
    sched: SchedulerCore
    worker: WorkerCore
    kv: dict[str, torch.Tensor]  # as SHAPES[layout]
    block: int
    layout: str


SHAPES = {
    "hnd": lambda nb, block: (2, nb, HEADS, block, HEAD_SIZE),
    "nhd": lambda nb, block: (2, nb, block, HEADS, HEAD_SIZE),
    # vLLM's CPU cache: per head, K transposed, then V.
    "cpu": lambda nb, block: (nb, HEADS, block, 2 * HEAD_SIZE),
}


def make_side(
    net: InprocNetwork,
    addr: str,
    engine: str,
    *,
    block: int,
    layout: str = "cpu",
    tp_size: int = 1,
    features: Sequence[registry_pb2.DaemonFeature.ValueType] | None = None,
) -> Side:
    daemon = net.daemon()
    addr = daemon.target  # what the connector's peer_address names
    if features is not None:  # an older kvmapd, which lists fewer
        daemon.listed_features = tuple(features)
    nb = CAPACITY // block
    shape = SHAPES[layout](nb, block)
    kv: dict[str, torch.Tensor] = {}
    for i, name in enumerate(LAYERS):
        g = torch.Generator().manual_seed(11 + i + block)
        kv[name] = torch.randint(0, 255, shape, generator=g, dtype=torch.uint8)
    specs = {n: LayerSpec(0, types_pb2.CACHE_KIND_MHA, nb) for n in LAYERS}
    wid = types_pb2.WorkerId(engine_id=engine)
    heads = head_layout(
        kv, specs, total_kv_heads=HEADS, head_size=HEAD_SIZE, tp_size=tp_size, block_tokens=block
    )
    req, fds = export_registration(
        wid, kv, specs, block_size_tokens=block, tp_size=tp_size, head_layout=heads
    )
    opts = options(addr)
    worker = WorkerCore(daemon.client(), wid, opts, block_size=block, tp_size=tp_size)
    worker.register(req, fds)
    sched = SchedulerCore(
        engine, opts, client=daemon.client(), block_size=block,
        tp_size=tp_size,
    )  # fmt: skip
    return Side(daemon, sched, worker, kv, block, layout)


def hnd(side: Side, name: str) -> torch.Tensor:
    """The layer as [2, blocks, heads, tokens, head_size] (a view)."""
    t = side.kv[name]
    if side.layout == "cpu":
        # Per head: K transposed [head_size, tokens], then V [tokens, head_size].
        nb, b = t.shape[0], side.block
        halves = t.view(nb, HEADS, 2, b * HEAD_SIZE)
        k = halves[:, :, 0].view(nb, HEADS, HEAD_SIZE, b).transpose(2, 3)
        v = halves[:, :, 1].view(nb, HEADS, b, HEAD_SIZE)
        return torch.stack([k, v])
    return t if side.layout == "hnd" else t.transpose(2, 3)


@pytest.fixture
def net() -> Iterator[InprocNetwork]:
    with InprocNetwork() as network:
        yield network


def offer(p: Side, rid: str, blocks: list[int], tokens: int) -> dict[str, Any]:
    """The prefill side finishes a request and offers its blocks."""
    params: dict[str, Any] = {"do_remote_decode": True}
    p.sched.after_alloc(rid, params, [blocks], 0)
    p.worker.start(p.sched.build_meta())
    keep, kv = p.sched.request_finished(
        rid, params, finished_normally=True, block_ids=[blocks], num_computed_tokens=tokens
    )
    assert keep and kv is not None
    p.worker.start(p.sched.build_meta())
    return kv


def load(d: Side, rid: str, kv: dict[str, Any], blocks: list[int], tokens: int) -> Any:
    params = dict(kv)
    d.sched.after_alloc(rid, params, [blocks], tokens)
    d.worker.start(d.sched.build_meta())
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        r = d.worker.poll()
        if r.finished_recving:
            return r
        time.sleep(0.01)  # polling a background pull, as vLLM's steps do
    raise AssertionError("the load never finished")


def same_tokens(p: Side, pblocks: list[int], d: Side, dblocks: list[int], tokens: range) -> bool:
    for name in LAYERS:
        pv, dv = hnd(p, name), hnd(d, name)
        for t in tokens:
            a = pv[:, pblocks[t // p.block], :, t % p.block]
            b = dv[:, dblocks[t // d.block], :, t % d.block]
            if not torch.equal(a, b):
                return False
    return True


def token_pull(kv: dict[str, Any], dblocks: list[int], tokens: int) -> transfers_pb2.TransferSpec:
    """A token-mode pull (GroupBlocks.num_tokens) of the offered request into
    ``dblocks``, as a client of kvmapd would issue it."""
    spec = transfers_pb2.TransferSpec(
        request_id=kv["remote_request_id"],
        local_worker=types_pb2.WorkerId(engine_id="decode"),
        remote_target=kv["remote_target"],
        remote_worker=types_pb2.WorkerId(engine_id=kv["remote_engine_id"]),
        capability=kv["kvmap_capability"],
    )
    spec.groups.add(
        transfer_group=0,
        local_block_ids=dblocks,
        remote_block_ids=kv["remote_block_ids"][0],
        num_tokens=tokens,
    )
    return spec


@pytest.mark.parametrize(
    ("p_block", "d_block", "p_layout", "d_layout"),
    [
        (16, 32, "cpu", "cpu"),
        (32, 16, "cpu", "cpu"),
        (16, 32, "hnd", "hnd"),
        (16, 32, "nhd", "hnd"),
        (32, 16, "hnd", "nhd"),
        (32, 16, "nhd", "nhd"),
    ],
)
def test_token_mode_pull_maps_the_block_grids(
    net: InprocNetwork, p_block: int, d_block: int, p_layout: str, d_layout: str
) -> None:
    """Through the in-process kvmapd, with the head layouts the workers published: a token-mode
    pull of a 40-token prompt (a partial last block on both sides) from blocks of 16 tokens into
    blocks of 32 and back, vLLM's CPU layout, HND or NHD on either side, moves every (K/V, head,
    token) and leaves the decode's other tokens untouched."""
    p = make_side(net, P_ADDR, "prefill", block=p_block, layout=p_layout)
    d = make_side(net, D_ADDR, "decode", block=d_block, layout=d_layout)
    pblocks = [5, 1, 9][: -(-40 // p_block)]
    dblocks = [4, 0, 7][: -(-40 // d_block)]
    before = {n: hnd(d, n).clone() for n in LAYERS}
    kv = offer(p, "req-p", pblocks, 40)
    assert kv["remote_block_size"] == p_block
    result = d.daemon.client().pull(token_pull(kv, dblocks, 40))
    assert result.bytes == 40 * len(LAYERS) * 2 * HEADS * HEAD_SIZE
    assert same_tokens(p, pblocks, d, dblocks, range(40))
    for name in LAYERS:
        after, was = hnd(d, name), before[name]
        mask = torch.ones(was.shape[1], was.shape[3], dtype=torch.bool)  # (block, token)
        for t in range(40):
            mask[dblocks[t // d_block], t % d_block] = False
        assert torch.equal(after.permute(1, 3, 0, 2, 4)[mask], was.permute(1, 3, 0, 2, 4)[mask])
    p.worker.shutdown()
    d.worker.shutdown()


def test_connector_loads_from_smaller_prefill_blocks(net: InprocNetwork) -> None:
    """The decode connector loads from a prefill engine of smaller blocks (vLLM's CPU layout on
    both sides, 16 -> 32): every (K/V, head, token) of a 40-token prompt arrives and the load
    record names the prefill blocks read."""
    p = make_side(net, P_ADDR, "prefill", block=16)
    d = make_side(net, D_ADDR, "decode", block=32)
    kv = offer(p, "req-p", [5, 1, 9], 40)
    r = load(d, "req-d", kv, [4, 0], 40)
    assert not r.failed_recving
    assert same_tokens(p, [5, 1, 9], d, [4, 0], range(40))
    record = d.worker.loads[-1]
    assert record.ok and record.remote_block_ids == ((5, 1, 9),)
    p.worker.shutdown()
    d.worker.shutdown()


def test_connector_loads_from_larger_prefill_blocks(net: InprocNetwork) -> None:
    """From a prefill engine of larger blocks (vLLM's CPU layout, 32 -> 16): every (K/V, head,
    token) of a 40-token prompt (a partial last block on both grids) arrives, the decode's
    fourth block (past the prompt) is untouched, and the record names the prefill blocks."""
    p = make_side(net, P_ADDR, "prefill", block=32)
    d = make_side(net, D_ADDR, "decode", block=16)
    kv = offer(p, "req-p", [3, 1], 40)
    spare = {n: d.kv[n][4].clone() for n in LAYERS}
    r = load(d, "req-d", kv, [1, 2, 3], 40)
    assert not r.failed_recving
    assert same_tokens(p, [3, 1], d, [1, 2, 3], range(40))
    assert all(torch.equal(d.kv[n][4], spare[n]) for n in LAYERS)
    assert d.worker.loads[-1].ok and d.worker.loads[-1].remote_block_ids == ((3, 1),)
    p.worker.shutdown()
    d.worker.shutdown()


@pytest.mark.parametrize(("p_block", "d_block", "hit"), [(32, 16, 16), (64, 32, 32), (64, 16, 48)])
def test_prefix_hit_inside_a_prefill_block_loads_the_rest(
    net: InprocNetwork, p_block: int, d_block: int, hit: int
) -> None:
    """Decode blocks smaller than the prefill's, the decode's first ``hit`` tokens cached
    locally (whole decode blocks, ending inside a prefill block; vLLM's CPU layout): the pull
    starts at that token inside the prefill block (GroupBlocks.remote_first_token), every
    (K/V, head, token) after the hit arrives and only those bytes move, the cached tokens'
    blocks and the slots past the prompt are untouched, and the record names the prefill
    blocks read."""
    p = make_side(net, P_ADDR, "prefill", block=p_block)
    d = make_side(net, D_ADDR, "decode", block=d_block)
    prompt = p_block + 8  # a partial last block on both grids
    pblocks = [2, 1]
    kv = offer(p, "req-p", pblocks, prompt)
    dblocks = list(range(1, 1 + -(-(prompt - hit) // d_block)))
    before = {n: hnd(d, n).clone() for n in LAYERS}
    r = load(d, "req-d", kv, dblocks, prompt - hit)
    assert not r.failed_recving
    placed = [-1] * (hit // d_block) + dblocks  # the cached blocks are not read here
    assert same_tokens(p, pblocks, d, placed, range(hit, prompt))
    record = d.worker.loads[-1]
    assert record.ok and record.remote_block_ids == ((2, 1),)
    assert record.bytes == (prompt - hit) * len(LAYERS) * 2 * HEADS * HEAD_SIZE
    for name in LAYERS:
        after, was = hnd(d, name), before[name]
        mask = torch.ones(was.shape[1], was.shape[3], dtype=torch.bool)  # (block, token)
        for t in range(hit, prompt):
            mask[placed[t // d_block], t % d_block] = False
        assert torch.equal(after.permute(1, 3, 0, 2, 4)[mask], was.permute(1, 3, 0, 2, 4)[mask])
    p.worker.shutdown()
    d.worker.shutdown()


@pytest.mark.parametrize(
    ("features", "missing"),
    [
        ((registry_pb2.DAEMON_FEATURE_TOKEN_MODE,), "DAEMON_FEATURE_REMOTE_FIRST_TOKEN"),
        ((), "DAEMON_FEATURE_TOKEN_MODE"),
    ],
)
def test_an_older_decode_kvmapd_is_not_sent_fields_it_would_drop(
    net: InprocNetwork, features: tuple[registry_pb2.DaemonFeature.ValueType, ...], missing: str
) -> None:
    """A decode kvmapd that does not list a field the pull needs (token mode between block
    grids, a start inside a prefill block) would drop it and move the wrong tokens: the load
    fails naming the feature (vLLM recomputes), and no byte of the decode cache changes."""
    p = make_side(net, P_ADDR, "prefill", block=64)
    d = make_side(net, D_ADDR, "decode", block=32, features=features)
    kv = offer(p, "req-p", [2, 1], 72)
    before = {n: t.clone() for n, t in d.kv.items()}
    r = load(d, "req-d", kv, [1, 2], 40)  # a 32-token local hit: the pull starts at token 32
    assert r.failed_recving == {"req-d"}
    assert missing in d.worker.loads[-1].error
    assert all(torch.equal(before[n], d.kv[n]) for n in LAYERS)
    p.worker.shutdown()
    d.worker.shutdown()


def test_prefix_hit_loads_the_tail(net: InprocNetwork) -> None:
    """Decode blocks of 32 with its first 32 tokens cached locally, prefill blocks of 16: the
    pull skips the first two prefill blocks and loads tokens 32..63."""
    p = make_side(net, P_ADDR, "prefill", block=16)
    d = make_side(net, D_ADDR, "decode", block=32)
    kv = offer(p, "req-p", [3, 1, 7, 8], 64)
    r = load(d, "req-d", kv, [5], 32)
    assert not r.failed_recving
    assert same_tokens(p, [3, 1, 7, 8], d, [-1, 5], range(32, 64))
    assert d.worker.loads[-1].remote_block_ids == ((7, 8),)
    p.worker.shutdown()
    d.worker.shutdown()


def test_other_tp_size_is_refused_with_a_clear_message(net: InprocNetwork) -> None:
    """A prefill engine of another TP size whose grants were not sized for this one's (no
    kvmap_decode_tp_size nor open grants: it expects its own TP size): the load fails fast
    naming both sizes (recompute). Loads between TP sizes: tests/client/test_pd_tp.py."""
    p = make_side(net, P_ADDR, "prefill", block=16)
    d = make_side(net, D_ADDR, "decode", block=16)
    kv = offer(p, "req-p", [3, 1], 20)
    kv["tp_size"] = 2
    del kv["kvmap_open_grants"]  # grants of fixed uses (open ones fit any TP size)
    kv["kvmap_capability"] = kv["kvmap_capability"] + "." + kv["kvmap_capability"]
    r = load(d, "req-d", kv, [1, 2], 20)
    assert r.failed_recving == {"req-d"}
    assert "tensor-parallel size 2, this one runs 1" in d.worker.loads[-1].error
    p.worker.shutdown()
    d.worker.shutdown()


def test_region_map_publishes_the_head_layout(net: InprocNetwork) -> None:
    """The registered head layout is in the worker's region map (what a peer plans with); a bad
    one is INVALID_ARGUMENT naming the field."""
    p = make_side(net, P_ADDR, "prefill", block=16, layout="nhd")
    rm = p.daemon.get_region_map(types_pb2.WorkerId(engine_id="prefill"))
    assert rm.head_layout == types_pb2.HeadLayout(
        total_kv_heads=2, kv_heads_per_rank=2, head_size=4, head_bytes=4,
        token_layout=types_pb2.TOKEN_LAYOUT_TOKENS_OUTER,
        replicated_kinds=[types_pb2.CACHE_KIND_MLA, types_pb2.CACHE_KIND_INDEXER],
    )  # fmt: skip
    assert rm.block_size_tokens == 16 and rm.tp_size == 1
    kv = {LAYERS[0]: torch.zeros(2, 12, 2, 16, 4, dtype=torch.uint8)}
    specs = {LAYERS[0]: LayerSpec(0, types_pb2.CACHE_KIND_MHA, 12)}
    bad = types_pb2.HeadLayout(total_kv_heads=3, head_size=4, head_bytes=4, token_layout=1)
    req, fds = export_registration(
        types_pb2.WorkerId(engine_id="x"), kv, specs, block_size_tokens=16, tp_size=2,
        head_layout=bad,
    )  # fmt: skip
    with pytest.raises(InvalidArgument, match=r"head_layout.total_kv_heads: 3 KV heads do not"):
        p.daemon.client().register(req, fds)
    p.worker.shutdown()


def test_token_layout_is_read_from_strides() -> None:
    """HND and NHD blocks (K/V outside or inside the block) are told apart by stride; one head
    per rank is tokens-outer; a block that is not tokens x heads is refused; vLLM's CPU cache
    ([blocks, heads, tokens, 2 x head_size]) is published as heads / transposed K / V."""
    hnd_t = torch.zeros(2, 12, 2, 16, 4)
    nhd_t = torch.zeros(2, 12, 16, 2, 4)
    inner = torch.zeros(12, 2, 16, 2, 4)  # [blocks, K/V, tokens, heads, head]

    def layout(t: torch.Tensor, heads: int = 2) -> int:
        return token_layout(t.shape, t.stride(), num_blocks=12, block_tokens=16, heads=heads)

    assert layout(hnd_t) == types_pb2.TOKEN_LAYOUT_HEADS_OUTER
    assert layout(nhd_t) == types_pb2.TOKEN_LAYOUT_TOKENS_OUTER
    assert layout(inner) == types_pb2.TOKEN_LAYOUT_TOKENS_OUTER
    assert layout(nhd_t.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)) == (
        types_pb2.TOKEN_LAYOUT_HEADS_OUTER
    )
    assert layout(torch.zeros(2, 12, 1, 16, 4), heads=1) == types_pb2.TOKEN_LAYOUT_TOKENS_OUTER
    with pytest.raises(GeometryError, match="does not hold 16 tokens x 3 KV heads"):
        layout(hnd_t, heads=3)
    cpu = {"l": torch.zeros(12, 2, 16, 8, dtype=torch.float16)}
    published = head_layout(
        cpu, {"l": LayerSpec(0, types_pb2.CACHE_KIND_MHA, 12)}, total_kv_heads=4, head_size=4,
        tp_size=2, block_tokens=16,
    )  # fmt: skip
    assert published is not None
    assert published.token_layout == types_pb2.TOKEN_LAYOUT_HEADS_KT_V
    assert (published.head_bytes, published.kv_heads_per_rank) == (8, 2)


def test_map_token_ranges() -> None:
    """Trailing block lists of two block grids are cut to a common start on both grids; a start
    inside a remote block keeps that block and names the token (remote_first_token); a start
    inside a local block, a prompt the blocks cannot end with, and a missing token count are
    refused."""
    assert map_token_ranges(
        ((1, 2),), ((5, 6, 7),), num_tokens=40, local_tokens=32, remote_tokens=16
    ) == [((1, 2), (5, 6, 7), 40, 0)]
    assert map_token_ranges(
        ((2, 3),), ((8, 9),), num_tokens=64, local_tokens=16, remote_tokens=32
    ) == [((2, 3), (9,), 32, 0)]
    assert map_token_ranges(
        ((1, 2, 3),), ((8, 9),), num_tokens=64, local_tokens=16, remote_tokens=32
    ) == [((1, 2, 3), (8, 9), 48, 16)]
    assert map_token_ranges(
        ((4,),), ((8, 9),), num_tokens=40, local_tokens=16, remote_tokens=32
    ) == [((4,), (9,), 8, 0)]
    with pytest.raises(ValueError, match="starts at token 16, inside a local block of 32 tokens"):
        map_token_ranges(((1, 2),), ((8, 9, 7),), num_tokens=64, local_tokens=32, remote_tokens=16)
    with pytest.raises(ValueError, match="do not end with a 20-token prompt"):
        map_token_ranges(((1, 2, 3),), ((8,),), num_tokens=20, local_tokens=16, remote_tokens=32)
    with pytest.raises(ValueError, match="remote_num_tokens: needed"):
        map_token_ranges(((1,),), ((8,),), num_tokens=0, local_tokens=16, remote_tokens=32)
