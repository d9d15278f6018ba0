"""The connector's decode side against in-process kvmapds (which mirror
kvmapd's compatibility check): a pull from a worker of another model is a
failed load (vLLM recomputes), counted under FAILED_PRECONDITION in the
connector's stats; a good pull is counted with its bytes and descriptors."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from inproc_daemon import InprocNetwork

from kvmap.client.connector import ConnectorOptions, SchedulerCore, WorkerCore
from kvmap.client.connector.stats import BYTES, DESCRIPTORS, FAILED
from kvmap.client.geometry import LayerSpec, export_registration, model_identity
from kvmap.v1 import types_pb2

NB, PAGE = 16, 64
LAYERS = ("model.layers.0.attn", "model.layers.1.attn")
P_ADDR, D_ADDR = "10.0.0.1:50051", "10.0.0.2:50051"


@dataclass
class Side:
    sched: SchedulerCore
    worker: WorkerCore
    kv: dict[str, torch.Tensor]


def make_side(net: InprocNetwork, addr: str, engine: str, model: str) -> Side:
    daemon = net.daemon()
    addr = daemon.target  # what the connector's peer_address names
    opts = ConnectorOptions(socket="/unused", peer_address=addr, transfer_timeout_s=5.0)
    kv = {n: torch.randint(0, 255, (NB, PAGE), dtype=torch.uint8) for n in LAYERS}
    wid = types_pb2.WorkerId(engine_id=engine)
    worker = WorkerCore(daemon.client(), wid, opts)
    specs = {n: LayerSpec(0, types_pb2.CACHE_KIND_MHA, NB) for n in LAYERS}
    req, fds = export_registration(
        wid, kv, specs, block_size_tokens=16, model=model_identity(model, dtype="bfloat16")
    )
    worker.register(req, fds)
    return Side(SchedulerCore(engine, opts, client=daemon.client()), worker, kv)


@pytest.fixture
def net() -> Iterator[InprocNetwork]:
    with InprocNetwork() as network:
        yield network


def load(p: Side, d: Side, rid: str) -> tuple[set[str], set[str]]:
    """Prefill offers blocks [3, 4]; decode loads them into [7, 8]: (finished, failed)."""
    params: dict[str, object] = {"do_remote_decode": True}
    p.sched.after_alloc(rid, params, [[3, 4]], 0)
    p.worker.start(p.sched.build_meta())
    _, kv = p.sched.request_finished(
        rid, params, finished_normally=True, block_ids=[[3, 4]], num_computed_tokens=32
    )
    assert kv is not None
    d.sched.after_alloc(rid, dict(kv), [[7, 8]], 32)
    d.worker.start(d.sched.build_meta())
    pending = d.worker._loading[rid].future
    assert pending is not None
    concurrent.futures.wait([pending], timeout=30)  # the pull thread's end
    r = d.worker.poll()
    return r.finished_recving, r.failed_recving


def test_other_model_is_a_failed_load_counted_by_code(net: InprocNetwork) -> None:
    """Decode of model B loading from prefill of model A: reported finished
    and failed (vLLM recomputes), blocks untouched, counted as one
    FAILED_PRECONDITION failure in the stats vLLM takes."""
    p = make_side(net, P_ADDR, "prefill", "model-a")
    d = make_side(net, D_ADDR, "decode", "model-b")
    before = {n: t.clone() for n, t in d.kv.items()}
    assert load(p, d, "r1") == ({"r1"}, {"r1"})
    assert "model name: 'model-b' here, 'model-a' at the peer" in d.worker.loads[-1].error
    assert all(torch.equal(before[n], d.kv[n]) for n in LAYERS)
    book = d.worker.stats.take()
    assert book is not None and book.data[FAILED] == ["FAILED_PRECONDITION"]
    assert book.num_successful_transfers == 0
    for s in (p, d):
        s.worker.shutdown()


def test_good_load_is_counted_with_bytes_and_descriptors(net: InprocNetwork) -> None:
    """A load between workers of one model: its bytes and descriptors are in
    the stats, and the blocks hold the prefill bytes."""
    p = make_side(net, P_ADDR, "prefill", "model-a")
    d = make_side(net, D_ADDR, "decode", "model-a")
    assert load(p, d, "r1") == ({"r1"}, set())
    assert torch.equal(d.kv[LAYERS[1]][7], p.kv[LAYERS[1]][3])
    book = d.worker.stats.take()
    assert book is not None
    assert book.data[BYTES] == [2 * 2 * PAGE] and book.data[FAILED] == []
    assert book.data[DESCRIPTORS][0] >= 1
    assert d.worker.stats.is_empty()
    for s in (p, d):
        s.worker.shutdown()


def _vllm_config(**text: object) -> SimpleNamespace:
    hf = SimpleNamespace(architectures=["LlamaForCausalLM"], hidden_size=256, head_dim=64, **text)
    return SimpleNamespace(
        model_config=SimpleNamespace(
            model="org/tiny", revision=None, dtype=torch.bfloat16, hf_text_config=hf
        ),
        cache_config=SimpleNamespace(cache_dtype="auto"),
    )


def test_model_identity_of_a_vllm_config() -> None:
    """The connector's model identity: name, dtype without "torch.", the KV
    cache dtype, and a digest that changes with a KV-shaping config field
    and not with one the digest does not read."""
    from kvmap.client.vllm_connector import model_identity_of

    base = model_identity_of(_vllm_config())
    assert (base.name, base.revision, base.dtype, base.kv_cache_dtype) == (
        "org/tiny",
        "",
        "bfloat16",
        "auto",
    )
    assert len(base.config_digest) == 32
    other_heads = model_identity_of(_vllm_config(num_key_value_heads=4))
    assert other_heads.config_digest != base.config_digest
    unread = model_identity_of(_vllm_config(vocab_size=5))
    assert unread.config_digest == base.config_digest
