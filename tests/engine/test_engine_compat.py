"""The compatibility check inside the transfer engine (two daemons in this
process over the fake NIXL): a pull between workers of different models is
refused before anything is planned, posted or announced, is never retried,
and the check runs once per (local generation, remote generation)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from harness import BLOCKS, Cluster, VirtualClock, Worker, cluster, run, run_spec, spec

from kvmap.core import compat
from kvmap.core.compat import Incompatible
from kvmap.daemon.engine import prepared
from kvmap.v1 import registry_pb2, types_pb2

pytestmark = pytest.mark.timeout(60)


@dataclass
class ModelWorker(Worker):
    """A harness worker that registers as serving ``model``."""

    model: str = "model-a"

    def request(self, token: str) -> registry_pb2.RegisterWorkerRequest:
        req = super().request(token)
        req.model.CopyFrom(types_pb2.ModelIdentity(name=self.model, dtype="bfloat16"))
        return req


def test_other_model_is_refused_before_anything_and_not_retried() -> None:
    """Decode of model-b pulling from model-a: Incompatible naming the model,
    no retry pause, nothing posted, no lease or prepared list, blocks as they
    were; the same decode worker re-registered as model-a then pulls."""

    async def main() -> None:
        clock = VirtualClock()
        async with cluster() as c:
            a, b = await c.node("a", pacing=clock.pacing()), await c.node("b")
            wa, wb = ModelWorker("decode", model="model-b"), ModelWorker("prefill")
            c.workers.extend([wa, wb])  # the cluster closes them
            wb.fill(3)
            await a.register(wa)
            await b.register(wb)
            before = [wa.block(i) for i in range(BLOCKS)]
            with pytest.raises(Incompatible, match="model name: 'model-b' here, 'model-a'"):
                [s async for s in run_spec(a.app, spec(wa, b, wb, [(0, 1)]), write=False)]
            assert clock.sleeps == [] and a.agent.network.posts == 0
            assert len(b.app.leases) == 0 and a.app.engine.cache_sizes()["prepared"] == 0
            assert [wa.block(i) for i in range(BLOCKS)] == before
            wa.model = "model-a"
            await a.register(wa)
            await a.transfer(spec(wa, b, wb, [(0, 1)], request_id="req-2"))
            assert wa.block(0) == wb.block(1)

    run(main())


def test_check_runs_once_per_generation_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two pulls with different layer selections (two prepared entries) are
    checked once; the owner's re-registration (a new generation) is checked again."""
    calls: list[tuple[int, int]] = []

    def counting(here: Any, peer: Any) -> None:
        calls.append((here.generation, peer.generation))
        compat.check_compatible(here, peer)

    monkeypatch.setattr(prepared, "check_compatible", counting)

    async def main() -> None:
        async with cluster() as c:
            await _pulls(c)

    run(main())
    assert calls == [(1, 1), (1, 2)]


async def _pulls(c: Cluster) -> None:
    a, b = await c.node("a"), await c.node("b")
    wa, wb = ModelWorker("decode"), ModelWorker("prefill")
    c.workers.extend([wa, wb])  # the cluster closes them
    await a.register(wa)
    await b.register(wb)
    await a.transfer(spec(wa, b, wb, [(0, 1)]))
    await a.transfer(spec(wa, b, wb, [(2, 3)], request_id="req-2", layers=("layer.0",)))
    await b.register(wb)
    await a.transfer(spec(wa, b, wb, [(4, 5)], request_id="req-3"))
