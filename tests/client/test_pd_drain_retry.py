"""A decode pull that its own kvmapd refuses because it is draining (SIGTERM,
an upgrade: the daemon still answers, from the same instance) is issued again
until the replacement daemon serves it, instead of failing the load and
having vLLM recompute the request."""

from __future__ import annotations

import torch
from test_pd_connector import LAYERS, Side, pair, prefill_request, step

from kvmap.client.connector.worker import PULL_ATTEMPT_S
from kvmap.core.errors import SHUTTING_DOWN, Unavailable
from kvmap.v1 import transfers_pb2

__all__ = ["pair"]  # the fixture, shared with test_pd_connector


def test_a_pull_refused_by_its_draining_daemon_is_issued_again(pair: tuple[Side, Side]) -> None:
    """The first attempt meets the decode daemon draining (UNAVAILABLE "kvmapd is shutting down",
    the daemon instance unchanged): the load does not fail; the next attempt lands the right bytes
    with the same capability, and the prefill side frees its blocks on the one finished pull."""
    p, d = pair
    kv = prefill_request(p, "req-p", [2, 3], tokens=20)
    seen: list[transfers_pb2.TransferSpec] = []

    def drain_first(spec: transfers_pb2.TransferSpec) -> None:
        seen.append(spec)
        if len(seen) == 1:
            raise Unavailable(f"UNAVAILABLE: {SHUTTING_DOWN}")

    d.daemon.pull_hook = drain_first
    d.sched.after_alloc("req-d", dict(kv), [[5, 6]], 20)
    r = step(d)
    assert r.finished_recving == {"req-d"} and not r.failed_recving
    assert len(seen) == 2 and seen[0].capability == seen[1].capability
    assert torch.equal(d.kv[LAYERS[0]][5], p.kv[LAYERS[0]][2])
    assert torch.equal(d.kv[LAYERS[1]][6], p.kv[LAYERS[1]][3])
    assert step(p).finished_sending == {"req-p"}


def test_a_pull_refused_with_too_little_time_left_is_not_issued_again(
    pair: tuple[Side, Side],
) -> None:
    """The draining refusal comes when less time is left than an attempt needs
    (PULL_ATTEMPT_S): the load fails at once with that refusal (vLLM recomputes)
    instead of issuing an attempt that could only end at the deadline."""
    p, d = pair
    kv = prefill_request(p, "req-p", [2, 3], tokens=20)
    seen: list[transfers_pb2.TransferSpec] = []

    def drain_late(spec: transfers_pb2.TransferSpec) -> None:
        seen.append(spec)
        # The refusal takes all but half an attempt's time of the deadline.
        d.clock.now += spec.timeout_ms / 1000 - PULL_ATTEMPT_S / 2
        raise Unavailable(f"UNAVAILABLE: {SHUTTING_DOWN}")

    d.daemon.pull_hook = drain_late
    d.sched.after_alloc("req-d", dict(kv), [[5, 6]], 20)
    r = step(d)
    assert r.failed_recving == {"req-d"}
    assert len(seen) == 1
