"""vLLM's scheduler thread does not wait on kvmapd (SchedulerCore._grant and
connector.granter), against in-process daemons: ``request_finished`` hands
its capabilities on at once and the grants are made on the granter's
thread; the decode side loads exactly the blocks as before. A grant that
fails there frees the kept blocks at once. A kvmapd that draws its own
capabilities costs one request, then every grant is made in place."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from inproc_daemon import InprocNetwork
from test_pd_connector import (
    D_ADDR,
    LAYERS,
    P_ADDR,
    RecordingTransport,
    Side,
    make_side,
    prefill_request,
    step,
)

from kvmap.core.errors import Unavailable
from kvmap.v1 import registry_pb2


class GatedGrants:
    """Wraps a side's scheduler transport: records which thread made each
    grant, holds grants of ``held`` requests until ``release``, fails those
    of ``failing``, and (``own_capability``) answers as an older kvmapd."""

    def __init__(self, transport: RecordingTransport) -> None:
        self.made: list[tuple[str, str]] = []
        self.held: set[str] = set()
        self.failing: set[str] = set()
        self.own_capability = False
        self.release = threading.Event()
        self._grant = transport.grant_transfer
        transport.grant_transfer = self.grant  # type: ignore[method-assign]

    def grant(
        self, req: registry_pb2.GrantTransferRequest, timeout: float
    ) -> registry_pb2.GrantTransferResponse:
        if req.request_id in self.held:
            assert self.release.wait(10), "the test never released the held grant"
        if req.request_id in self.failing:
            raise Unavailable("kvmapd is not there")
        if self.own_capability:
            req.capability = ""  # an older kvmapd does not read the field
        resp = self._grant(req, timeout)
        self.made.append((req.request_id, threading.current_thread().name))
        return resp


@pytest.fixture
def pair() -> Iterator[tuple[Side, Side]]:
    with InprocNetwork() as net:
        p = make_side(net, P_ADDR, "prefill", fill=True)
        d = make_side(net, D_ADDR, "decode", fill=False)
        yield p, d
        for s in (p, d):
            s.worker.shutdown()
        p.sched.shutdown()


def decode(d: Side, rid: str, kv: dict[str, Any], local: list[int], tokens: int) -> None:
    params = dict(kv)
    assert d.sched.num_new_matched_tokens(rid, params, tokens, 0) == (tokens, True)
    d.sched.after_alloc(rid, params, [local], tokens)
    r = step(d)
    assert r.finished_recving == {rid} and not r.failed_recving, r


def same(p: Side, d: Side, local: list[int], remote: list[int]) -> bool:
    return all(
        torch.equal(d.kv[n][lb], p.kv[n][rb])
        for n in LAYERS
        for lb, rb in zip(local, remote, strict=True)
    )


def test_request_finished_does_not_wait_on_kvmapd(pair: tuple[Side, Side]) -> None:
    """``request_finished`` returns while kvmapd still holds the request's
    grant (it would never return if it waited, the first request included);
    the grant is then made on the granter's thread under the capability
    already handed on, and decode loads the blocks."""
    p, d = pair
    gates = GatedGrants(p.sched_transport)
    gates.held |= {"req-1", "req-2"}
    kv1 = prefill_request(p, "req-1", [3, 4], 20)  # returns with the grant held
    kv2 = prefill_request(p, "req-2", [5, 6], 20)
    assert gates.made == []
    gates.release.set()
    decode(d, "dec-2", kv2, [10, 11], 20)
    decode(d, "dec-1", kv1, [12, 13], 20)
    assert gates.made == [("req-1", "kvmap-granter"), ("req-2", "kvmap-granter")]
    assert same(p, d, [10, 11], [5, 6]) and same(p, d, [12, 13], [3, 4])


def test_a_background_grant_that_fails_frees_the_blocks_at_once(pair: tuple[Side, Side]) -> None:
    """A grant that fails on the granter's thread was offered already: the
    scheduler tells its workers at the next step, and the worker frees the
    kept blocks then, not at the end of their lease."""
    p, _ = pair
    gates = GatedGrants(p.sched_transport)
    prefill_request(p, "req-1", [3, 4], 20)
    gates.failing.add("req-2")
    prefill_request(p, "req-2", [5, 6], 20)
    assert p.worker.pending_sends == 2
    assert p.sched._granter is not None and p.sched._granter.idle(10)
    r = step(p)
    assert r.finished_sending == {"req-2"}, r
    assert p.worker.leases_expired == 0 and p.worker.pending_sends == 1


def test_a_kvmapd_that_draws_its_own_capabilities_is_granted_in_place_after_one(
    pair: tuple[Side, Side],
) -> None:
    """A kvmapd that predates caller capabilities answers with one it drew:
    the first request's capability, handed on already, will never work, so
    its grant is revoked and its blocks freed (its decode recomputes); from
    then on every grant is made on the calling thread and the daemon's own
    capability is offered, which decode loads with."""
    p, d = pair
    gates = GatedGrants(p.sched_transport)
    gates.own_capability = True
    prefill_request(p, "req-0", [1, 2], 20)
    assert p.sched._granter is not None and p.sched._granter.idle(10)
    assert step(p).finished_sending == {"req-0"}
    kvs = [prefill_request(p, f"req-{i}", [3 + 2 * i, 4 + 2 * i], 20) for i in (1, 2)]
    me = threading.current_thread().name
    assert gates.made == [("req-0", "kvmap-granter"), ("req-1", me), ("req-2", me)]
    decode(d, "dec-2", kvs[1], [20, 21], 20)
    assert same(p, d, [20, 21], [7, 8])
