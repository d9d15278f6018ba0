"""Push mode between engines that cut the KV cache differently, against
in-process kvmapds: other tensor-parallel sizes (each prefill rank writes
the heads it holds into every decode rank that holds them, token mode) and
other block sizes both ways (16 <-> 32), in vLLM's CPU layout; every byte of
every head and token arrives, each decode rank reports its load only once
every prefill rank writing it is done, and every prefill rank frees once."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import test_pd_shapes as shapes
import test_pd_tp as tp
from inproc_daemon import InprocNetwork

from kvmap.client.connector import WorkerCore

PUSH_KEYS = {"transfer_mode": "push"}


@pytest.fixture
def net() -> Iterator[InprocNetwork]:
    with InprocNetwork() as network:
        yield network


def _params(target: str) -> tuple[dict[str, Any], dict[str, Any]]:
    push_id = secrets.token_urlsafe(18)
    pre = {"do_remote_decode": True, "kvmap_push_id": push_id, **PUSH_KEYS}
    dec = {
        "do_remote_prefill": True,
        "kvmap_push_id": push_id,
        "kvmap_push_target": target,
        "remote_engine_id": "prefill",
        **PUSH_KEYS,
    }
    return pre, dec


def _step_all(workers: list[WorkerCore], done: Callable[[], bool], seen: dict[int, Any]) -> None:
    deadline = time.monotonic() + 15
    while not done():
        assert time.monotonic() < deadline, "the pushes never finished"
        for w in workers:
            r = w.poll()
            got = seen.setdefault(id(w), {"sent": set(), "loaded": set(), "failed": set()})
            got["sent"] |= r.finished_sending
            got["loaded"] |= r.finished_recving
            got["failed"] |= r.failed_recving
        time.sleep(0.01)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1), (2, 4), (4, 2)])
def test_push_between_tp_sizes(net: InprocNetwork, p_tp: int, d_tp: int) -> None:
    """Prefill TP ``p_tp`` pushes into decode TP ``d_tp``: every decode rank
    gets every byte of its heads, no load fails, every prefill rank frees."""
    p = tp.make_engine(net, tp.P_ADDR, "prefill", p_tp)
    d = tp.make_engine(net, tp.D_ADDR, "decode", d_tp)
    target = p.workers[0].options.peer_address
    pre, dec = _params(target)
    assert d.sched.num_new_matched_tokens("req-d", dec, tp.TOKENS, 0) == (tp.TOKENS, True)
    d.sched.after_alloc("req-d", dec, [tp.DBLOCKS], tp.TOKENS)
    meta = d.sched.build_meta()
    for w in d.workers:
        w.start(meta)
    p.sched.after_alloc("req-p", pre, [tp.PBLOCKS], 0)
    keep, _ = p.sched.request_finished(
        "req-p", pre, finished_normally=True, block_ids=[tp.PBLOCKS], num_computed_tokens=tp.TOKENS
    )
    assert keep
    meta = p.sched.build_meta()
    for w in p.workers:
        w.start(meta)
    seen: dict[int, Any] = {}
    workers = [*p.workers, *d.workers]
    _step_all(
        workers,
        lambda: (
            all("req-d" in seen.get(id(w), {}).get("loaded", ()) for w in d.workers)
            and all("req-p" in seen.get(id(w), {}).get("sent", ()) for w in p.workers)
        ),
        seen,
    )
    assert not any(seen[id(w)]["failed"] for w in d.workers)
    for r in range(d_tp):
        assert tp.heads_arrived(p, d, r), f"decode rank {r}"
    # Each prefill rank pushed into exactly the decode ranks that read it, per layer group.
    pushes = sum(w.push_send.pushed for w in p.workers)
    readers = sum(
        len(tp.source_ranks(tp.HEADS, p_tp, d_tp, r, replicated=False)) for r in range(d_tp)
    )
    assert pushes == readers * 2  # two layers: two layer groups
    p.shutdown()
    d.shutdown()


@pytest.mark.parametrize(
    ("p_block", "d_block", "pblocks", "dblocks"),
    [(16, 32, [5, 1, 9], [4, 0]), (32, 16, [3, 1], [1, 2, 3])],
)
def test_push_between_block_sizes(
    net: InprocNetwork, p_block: int, d_block: int, pblocks: list[int], dblocks: list[int]
) -> None:
    """Prefill blocks of ``p_block`` tokens pushed into decode blocks of
    ``d_block``: every (K/V, head, token) of a 40-token prompt arrives."""
    p = shapes.make_side(net, shapes.P_ADDR, "prefill", block=p_block)
    d = shapes.make_side(net, shapes.D_ADDR, "decode", block=d_block)
    pre, dec = _params(p.worker.options.peer_address)
    d.sched.after_alloc("req-d", dec, [dblocks], 40)
    d.worker.start(d.sched.build_meta())
    p.sched.after_alloc("req-p", pre, [pblocks], 0)
    p.sched.request_finished(
        "req-p", pre, finished_normally=True, block_ids=[pblocks], num_computed_tokens=40
    )
    p.worker.start(p.sched.build_meta())
    seen: dict[int, Any] = {}
    _step_all(
        [p.worker, d.worker],
        lambda: (
            "req-d" in seen.get(id(d.worker), {}).get("loaded", ())
            and "req-p" in seen.get(id(p.worker), {}).get("sent", ())
        ),
        seen,
    )
    assert not seen[id(d.worker)]["failed"]
    assert shapes.same_tokens(p, pblocks, d, dblocks, range(40))
    p.worker.shutdown()
    d.worker.shutdown()
