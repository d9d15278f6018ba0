"""Push mode of the connector's P/D state machines (kvmap.client.connector)
against in-process daemons: the decode worker grants a write of its
allocated blocks and offers them through its kvmapd to the prefill engine's
kvmapd; the prefill worker pushes its KV into them, whole at finish or layer
group by layer group as its layers are saved; decode sees the KV only once
every push landed; failures on either side end in a recompute, never in
wrong or partial KV."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from inproc_daemon import InprocDaemon, InprocNetwork, InprocTransport

from kvmap.client.client import KvmapClient
from kvmap.client.connector import ConnectorOptions, SchedulerCore, WorkerCore
from kvmap.client.geometry import LayerSpec, export_registration
from kvmap.core.errors import PermissionDenied
from kvmap.v1 import transfers_pb2, types_pb2

NB, PAGE = 32, 128
BLOCK = 16
LAYERS = tuple(f"model.layers.{i}.attn" for i in range(4))


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
        "push_timeout_s": 20.0,
        "push_layer_groups": 2,
    }
    return ConnectorOptions(**{**base, **kw})


@dataclass
class Side:
    daemon: InprocDaemon
    sched: SchedulerCore
    worker: WorkerCore
    kv: dict[str, torch.Tensor]
    clock: FakeClock
    # What the worker reported so far (vLLM's get_finished, every step).
    sent: set[str] = field(default_factory=set)
    loaded: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)

    def poll(self) -> None:
        r = self.worker.poll()
        for have, new in ((self.sent, r.finished_sending), (self.loaded, r.finished_recving),
                          (self.failed, r.failed_recving)):  # fmt: skip
            assert not have & new, f"reported twice: {have & new}"
            have.update(new)


def make_side(net: InprocNetwork, engine: str, fill: bool, **kw: Any) -> Side:
    daemon = net.daemon()
    opts = options(peer_address=daemon.target, **kw)
    storage = torch.zeros(len(LAYERS) * NB * PAGE, dtype=torch.uint8)
    kv = {
        n: storage[i * NB * PAGE : (i + 1) * NB * PAGE].view(NB, PAGE) for i, n in enumerate(LAYERS)
    }
    if fill:
        g = torch.Generator().manual_seed(11)
        storage.copy_(torch.randint(1, 255, storage.shape, generator=g, dtype=torch.uint8))
    wid = types_pb2.WorkerId(engine_id=engine)
    clock = FakeClock()
    worker = WorkerCore(
        KvmapClient(InprocTransport(daemon)), wid, opts, clock=clock, block_size=BLOCK
    )
    specs = {n: LayerSpec(0, types_pb2.CACHE_KIND_MHA, NB) for n in LAYERS}
    req, fds = export_registration(wid, kv, specs, block_size_tokens=BLOCK)
    worker.register(req, fds)
    sched = SchedulerCore(
        engine, opts, client=KvmapClient(InprocTransport(daemon)), block_size=BLOCK
    )
    return Side(daemon, sched, worker, kv, clock)


@pytest.fixture
def pair() -> Iterator[tuple[Side, Side]]:
    with InprocNetwork() as net:
        p = make_side(net, "prefill", fill=True)
        d = make_side(net, "decode", fill=False)
        yield p, d
        for s in (p, d):
            s.worker.shutdown()


def push_params(p: Side, push_id: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """What the router sends: (prefill's params, decode's params)."""
    prefill = {"do_remote_decode": True, "transfer_mode": "push", "kvmap_push_id": push_id}
    decode = {
        "do_remote_prefill": True,
        "transfer_mode": "push",
        "kvmap_push_id": push_id,
        "kvmap_push_target": p.daemon.target,
        "remote_engine_id": "prefill",
    }
    return prefill, decode


def decode_offers(d: Side, rid: str, params: dict[str, Any], blocks: list[int], tokens: int,
                  *, computed: int = 0) -> None:  # fmt: skip
    assert d.sched.num_new_matched_tokens(rid, params, tokens, computed) == (
        tokens - computed,
        True,
    )
    d.sched.after_alloc(rid, params, [blocks], tokens - computed)
    d.worker.start(d.sched.build_meta())


def until(p: Side, d: Side, done: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Step both engines' workers (as vLLM polls them every step) until
    ``done()`` or ``timeout``; whether it came true."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            return False
        p.poll()
        d.poll()
        time.sleep(0.01)
    return True


def finish_prefill(p: Side, rid: str, params: dict[str, Any], blocks: list[int], tokens: int,
                   *, normally: bool = True) -> tuple[bool, Any]:  # fmt: skip
    keep, kv = p.sched.request_finished(
        rid, params, finished_normally=normally, block_ids=[blocks], num_computed_tokens=tokens
    )
    p.worker.start(p.sched.build_meta())
    return keep, kv


def same_bytes(p: Side, d: Side, pairs: list[tuple[int, int]], layers: tuple[str, ...]) -> bool:
    return all(torch.equal(d.kv[n][db], p.kv[n][pb]) for n in layers for pb, db in pairs)


def test_push_at_finish_writes_the_whole_request(pair: tuple[Side, Side]) -> None:
    """Whole-request push: decode offers first, prefill pushes when it
    finishes; decode then holds exactly the prefill blocks' bytes, reports the
    load once, and prefill frees its blocks once its pushes are done."""
    p, d = pair
    pre, dec = push_params(p, secrets.token_urlsafe(18))
    decode_offers(d, "req-d", dec, [9, 0, 30], tokens=40)
    p.sched.after_alloc("req-p", pre, [[3, 17, 4]], 0)
    p.worker.start(p.sched.build_meta())
    keep, kv = finish_prefill(p, "req-p", pre, [3, 17, 4], 40)
    assert keep and kv is not None and kv["transfer_mode"] == "push"
    assert until(p, d, lambda: "req-d" in d.loaded and "req-p" in p.sent)
    assert not d.failed
    assert same_bytes(p, d, [(3, 9), (17, 0), (4, 30)], LAYERS)
    assert p.worker.push_send.pushed == 2  # two layer groups, one push each
    assert p.worker.pending_sends == 0 and d.worker.pending_loads == 0


def test_layer_groups_go_as_layers_are_saved_and_decode_waits_for_the_last(
    pair: tuple[Side, Side],
) -> None:
    """Layer-group push: in the step where the prompt completes, the first
    group's bytes land as soon as its last layer is saved, before the second
    group is computed; decode reports nothing until the last group landed."""
    p, d = pair
    pre, dec = push_params(p, secrets.token_urlsafe(18))
    decode_offers(d, "req-d", dec, [5, 6], tokens=32)
    p.sched.after_alloc("req-p", pre, [[1, 2]], 0)
    assert p.sched.layer_push_wanted("req-p")
    p.sched.prompt_scheduled("req-p", [[1, 2]], 32)
    p.worker.start(p.sched.build_meta())
    assert p.worker.pushing_layers
    assert until(p, d, lambda: p.worker.push_send._waiting == {} and _offered(p))
    p.worker.layer_saved(LAYERS[0])
    p.worker.layer_saved(LAYERS[1])  # the first group ends here
    assert until(p, d, lambda: same_bytes(p, d, [(1, 5), (2, 6)], LAYERS[:2]))
    assert not same_bytes(p, d, [(1, 5)], LAYERS[2:3])  # not computed yet: not pushed
    assert not until(p, d, lambda: bool(d.loaded), timeout=0.5)
    p.worker.layer_saved(LAYERS[2])
    p.worker.layer_saved(LAYERS[3])
    assert until(p, d, lambda: d.loaded == {"req-d"})
    assert same_bytes(p, d, [(1, 5), (2, 6)], LAYERS)
    # Prefill frees only once it has finished (vLLM's request_finished).
    assert not p.sent
    finish_prefill(p, "req-p", pre, [1, 2], 32)
    assert until(p, d, lambda: p.sent == {"req-p"})
    assert p.worker.push_send.pushed == 2


def _offered(p: Side) -> bool:
    """Whether the prefill worker holds an offer for one of its requests."""
    return any(push.offers for push in p.worker.push_send._pushes.values())


def test_an_offer_after_prefill_finished_is_pushed_then(pair: tuple[Side, Side]) -> None:
    """Prefill finishes before decode allocates: its blocks wait, and the
    late offer is served at once."""
    p, d = pair
    pre, dec = push_params(p, secrets.token_urlsafe(18))
    p.sched.after_alloc("req-p", pre, [[7]], 0)
    finish_prefill(p, "req-p", pre, [7], 10)
    assert not until(p, d, lambda: bool(p.sent), timeout=0.3)
    assert p.worker.pending_sends == 1
    decode_offers(d, "req-d", dec, [12], tokens=10)
    assert until(p, d, lambda: d.loaded == {"req-d"} and p.sent == {"req-p"})
    assert same_bytes(p, d, [(7, 12)], LAYERS)


def test_a_decode_prefix_hit_receives_only_the_tail(pair: tuple[Side, Side]) -> None:
    """Decode's prefix cache holds the first 2 blocks: only the last 2 prefill
    blocks are written, into the blocks decode allocated for them."""
    p, d = pair
    pre, dec = push_params(p, secrets.token_urlsafe(18))
    decode_offers(d, "req-d", dec, [20, 21], tokens=64, computed=32)
    p.sched.after_alloc("req-p", pre, [[1, 2, 3, 4]], 0)
    finish_prefill(p, "req-p", pre, [1, 2, 3, 4], 64)
    assert until(p, d, lambda: d.loaded == {"req-d"})
    assert not d.failed
    assert same_bytes(p, d, [(3, 20), (4, 21)], LAYERS)
    assert torch.count_nonzero(d.kv[LAYERS[0]][0]) == 0


def test_no_prefill_means_a_timeout_a_revoked_grant_and_a_recompute(
    pair: tuple[Side, Side],
) -> None:
    """No prefill ever pushes: after push_timeout_s decode reports a failed
    load (vLLM recomputes) and its write grant is revoked, so a late push
    with the offered capability writes nothing."""
    p, d = pair
    _, dec = push_params(p, secrets.token_urlsafe(18))
    decode_offers(d, "req-d", dec, [3], tokens=10)
    assert until(p, d, lambda: dec["kvmap_push_id"] in p.worker.push_send._waiting)
    assert not d.loaded
    (offer,) = p.worker.push_send._waiting[dec["kvmap_push_id"]]
    d.clock.now += 21
    d.poll()
    assert d.loaded == d.failed == {"req-d"}
    late = transfers_pb2.TransferSpec(
        request_id=offer.request_id,
        local_worker=p.worker.worker,
        remote_target=offer.decode_target,
        remote_worker=offer.decode_worker,
        capability=offer.capability,
        timeout_ms=3000,
    )
    late.groups.add(transfer_group=0, local_block_ids=[1], remote_block_ids=[3])
    with pytest.raises(PermissionDenied):
        p.worker.client.push(late, timeout_s=5)
    assert torch.count_nonzero(d.kv[LAYERS[0]][3]) == 0


def test_an_offer_prefill_cannot_serve_fails_decode_at_once(pair: tuple[Side, Side]) -> None:
    """Prefill's prompt is not the one decode expects (another token count):
    prefill pushes nothing, releases its use of decode's grant, and decode
    reports the failure without waiting for its timeout."""
    p, d = pair
    pre, dec = push_params(p, secrets.token_urlsafe(18))
    decode_offers(d, "req-d", dec, [3, 4], tokens=32)
    p.sched.after_alloc("req-p", pre, [[1, 2, 5]], 0)
    finish_prefill(p, "req-p", pre, [1, 2, 5], 40)
    assert until(p, d, lambda: d.failed == {"req-d"} and p.sent == {"req-p"})
    assert torch.count_nonzero(d.kv[LAYERS[0]][3]) == 0
    assert p.worker.push_send.pushed == 0


def test_an_aborted_prefill_request_fails_decode_at_once(pair: tuple[Side, Side]) -> None:
    """The prefill request is aborted after decode offered: prefill keeps
    nothing, tells decode (a released use), and decode recomputes now."""
    p, d = pair
    pre, dec = push_params(p, secrets.token_urlsafe(18))
    decode_offers(d, "req-d", dec, [3], tokens=10)
    p.sched.after_alloc("req-p", pre, [[1]], 0)
    p.sched.prompt_scheduled("req-p", [[1]], 10)
    p.worker.start(p.sched.build_meta())
    assert until(p, d, lambda: _offered(p))
    keep, _ = finish_prefill(p, "req-p", pre, [1], 10, normally=False)
    assert not keep
    assert until(p, d, lambda: d.failed == {"req-d"})
    assert p.worker.pending_sends == 0 and not p.sent


def test_someone_elses_push_id_is_never_served(pair: tuple[Side, Side]) -> None:
    """An offer for a push id no request of this prefill engine carries is
    kept aside and never acted on: the prefill request with another id
    waits for its own offer."""
    p, d = pair
    pre, _ = push_params(p, secrets.token_urlsafe(18))
    _, other = push_params(p, secrets.token_urlsafe(18))
    decode_offers(d, "req-d", other, [3], tokens=10)
    p.sched.after_alloc("req-p", pre, [[1]], 0)
    finish_prefill(p, "req-p", pre, [1], 10)
    assert until(p, d, lambda: other["kvmap_push_id"] in p.worker.push_send._waiting)
    assert not until(p, d, lambda: bool(p.sent or d.loaded), timeout=0.5)
    assert p.worker.push_send.pushed == 0
    assert torch.count_nonzero(d.kv[LAYERS[0]][3]) == 0


def test_push_params_are_checked_before_anything_is_offered(pair: tuple[Side, Side]) -> None:
    """Hostile push params (short push id, bad target, missing engine) load
    nothing: the request is computed locally."""
    p, d = pair
    _, good = push_params(p, secrets.token_urlsafe(18))
    for bad in (
        {**good, "kvmap_push_id": "short"},
        {**good, "kvmap_push_target": "nohost"},
        {k: v for k, v in good.items() if k != "remote_engine_id"},
        {**good, "kvmap_push_id": 12345678901234567890},
    ):
        assert d.sched.num_new_matched_tokens("r", bad, 10, 0) == (0, False)


def test_decode_gone_mid_push_lets_prefill_finish_and_free(pair: tuple[Side, Side]) -> None:
    """The decode side's kvmapd is gone after it offered: prefill's pushes
    fail, it stops, and it frees its blocks (finished_sending) well before
    its lease, instead of holding them."""
    p, d = pair
    pre, dec = push_params(p, secrets.token_urlsafe(18))
    decode_offers(d, "req-d", dec, [3, 4], tokens=32)
    p.sched.after_alloc("req-p", pre, [[1, 2]], 0)
    p.worker.start(p.sched.build_meta())
    assert until(p, d, lambda: dec["kvmap_push_id"] in p.worker.push_send._waiting)
    d.daemon.stop()
    finish_prefill(p, "req-p", pre, [1, 2], 32)
    deadline = time.monotonic() + 15
    while "req-p" not in p.sent and time.monotonic() < deadline:
        p.poll()
        time.sleep(0.02)
    assert p.sent == {"req-p"} and p.worker.push_send.failed == 1
    assert p.clock.now < 1000.0 + p.worker.options.lease_seconds  # not the lease


@pytest.mark.parametrize("which", ["prefill", "decode"])
def test_a_sidecar_restarted_mid_push_loads_or_recomputes(
    pair: tuple[Side, Side], which: str
) -> None:
    """Either side's kvmapd restarts between the offer and the push: the
    request either loads with exactly the prefill bytes or is reported
    failed (recomputed), never loaded with other bytes; prefill frees."""
    p, d = pair
    pre, dec = push_params(p, secrets.token_urlsafe(18))
    decode_offers(d, "req-d", dec, [3, 4], tokens=32)
    p.sched.after_alloc("req-p", pre, [[1, 2]], 0)
    p.worker.start(p.sched.build_meta())
    assert until(p, d, lambda: dec["kvmap_push_id"] in p.worker.push_send._waiting)
    (p if which == "prefill" else d).daemon.restart()
    finish_prefill(p, "req-p", pre, [1, 2], 32)
    loaded_or_failed = until(p, d, lambda: "req-d" in d.loaded, timeout=8)
    if not loaded_or_failed:
        d.clock.now += 21  # the push timeout: revoked and recomputed
        assert until(p, d, lambda: "req-d" in d.loaded)
        assert d.failed == {"req-d"}
    if "req-d" not in d.failed:
        assert same_bytes(p, d, [(1, 3), (2, 4)], LAYERS)
    p.clock.now += 31  # at the latest, the lease frees
    assert until(p, d, lambda: p.sent == {"req-p"})
