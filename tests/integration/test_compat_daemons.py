"""The compatibility check between real daemons (separate processes, real
NIXL agents, real shared memory): a pull between workers that registered
different models, or the same layer with another dtype, fails with
FAILED_PRECONDITION naming the difference, is not retried and changes
nothing: the destination blocks are untouched and the owner's grant is
still good for a compatible worker of the same daemon."""

from __future__ import annotations

import re
import socket
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvmap.client.client import KvmapClient
from kvmap.client.geometry import LayerSpec, export_registration, model_identity
from kvmap.client.session import WorkerSession
from kvmap.core.errors import FailedPrecondition
from kvmap.tools.launch import DaemonProc, start_daemon
from kvmap.v1 import transfers_pb2, types_pb2

pytestmark = pytest.mark.integration

BLOCKS = 16
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
ARCH = {"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "num_hidden_layers": 3}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Worker:
    """A worker in this process: its KV tensors (in shared memory once
    registered) and the session that keeps it attached."""

    client: KvmapClient
    session: WorkerSession
    tensors: dict[str, torch.Tensor]

    @property
    def id(self) -> types_pb2.WorkerId:
        return self.session.worker

    def stop(self) -> None:
        self.session.stop(deregister=True, timeout_s=10)
        self.client.close()


def start_worker(
    daemon: DaemonProc, engine: str, *, name: str = "tiny-a", dtype: torch.dtype = torch.bfloat16
) -> Worker:
    tensors = {n: torch.zeros(BLOCKS, 64, dtype=dtype) for n in LAYERS}
    specs = {n: LayerSpec(0, types_pb2.CACHE_KIND_MHA, BLOCKS) for n in LAYERS}
    req, fds = export_registration(
        types_pb2.WorkerId(engine_id=engine),
        tensors,
        specs,
        block_size_tokens=16,
        kv_cache_layout="NHD",
        model=model_identity(name, dtype="bfloat16", kv_cache_dtype="auto", architecture=ARCH),
    )
    client = KvmapClient.connect(daemon.socket, 10)
    session = WorkerSession(client, req, fds)
    session.start(timeout_s=30)
    return Worker(client, session, tensors)


@dataclass
class Pods:
    prefill: DaemonProc
    decode: DaemonProc
    decode_metrics: int


@pytest.fixture
def pods(tmp_path: Path) -> Iterator[Pods]:
    port = _free_port()
    p = start_daemon(tmp_path / "p", name="prefill")
    try:
        d = start_daemon(tmp_path / "d", "--metrics-listen", f"127.0.0.1:{port}", name="decode")
    except BaseException:
        p.kill()
        raise
    yield Pods(p, d, port)
    for daemon in (d, p):
        assert daemon.terminate() == 0, daemon.log()


def pull(pods: Pods, owner: Worker, reader: Worker, capability: str) -> None:
    spec = transfers_pb2.TransferSpec(
        request_id="req-1",
        local_worker=reader.id,
        remote_target=pods.prefill.tcp_target,
        remote_worker=owner.id,
        groups=[
            transfers_pb2.GroupBlocks(
                transfer_group=0, local_block_ids=[0, 1, 2], remote_block_ids=[5, 9, 3]
            )
        ],
        capability=capability,
        timeout_ms=20_000,
    )
    reader.client.pull(spec, timeout_s=30)


def _scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def _retries(port: int) -> float:
    found = re.findall(r"^kvmap_transfer_retries_total\{[^}]*\} (\S+)$", _scrape(port), re.M)
    return sum(float(v) for v in found)


def _peer_outcomes(port: int, peer: str) -> dict[str, float]:
    """kvmap_peer_transfers_total of pulls from ``peer``, by code."""
    return {
        sample.labels["code"]: sample.value
        for family in text_string_to_metric_families(_scrape(port))
        for sample in family.samples
        if sample.name == "kvmap_peer_transfers_total"
        and sample.labels["direction"] == "pull"
        and sample.labels["peer"] == peer
    }


def _refused_then_fine(pods: Pods, owner: Worker, wrong: Worker, expected: str) -> None:
    """``wrong`` is refused with ``expected`` in the status; its blocks stay
    zero, nothing is retried, and the same grant then serves a compatible
    worker of the same decode daemon, byte for byte."""
    for i, t in enumerate(owner.tensors.values()):
        t.copy_(torch.arange(BLOCKS * 64).reshape(BLOCKS, 64).to(t.dtype) + i)
    grant = owner.client.grant_transfer(owner.id, "req-1", {0: [5, 9, 3]}, ttl_ms=60_000)
    with pytest.raises(FailedPrecondition) as caught:
        pull(pods, owner, wrong, grant.capability)
    assert expected in caught.value.message, caught.value.message
    assert all(not t.any() for t in wrong.tensors.values())
    assert _retries(pods.decode_metrics) == 0
    fine = start_worker(pods.decode, "decode-ok")
    try:
        pull(pods, owner, fine, grant.capability)
        for name, t in fine.tensors.items():
            assert torch.equal(t[[0, 1, 2]], owner.tensors[name][[5, 9, 3]])
        # The decode daemon's per-peer metrics saw both, by status.
        outcomes = _peer_outcomes(pods.decode_metrics, pods.prefill.tcp_target)
        assert outcomes == {"FAILED_PRECONDITION": 1.0, "OK": 1.0}
    finally:
        fine.stop()


def test_different_models_fail_naming_the_model(pods: Pods) -> None:
    """Workers of two models: FAILED_PRECONDITION naming the model name on
    both sides, nothing changed, not retried."""
    owner = start_worker(pods.prefill, "prefill")
    wrong = start_worker(pods.decode, "decode", name="tiny-b")
    try:
        _refused_then_fine(pods, owner, wrong, "model name: 'tiny-b' here, 'tiny-a' at the peer")
    finally:
        wrong.stop()
        owner.stop()


def test_different_kv_dtype_fails_naming_the_layer(pods: Pods) -> None:
    """The same model with float16 KV tensors against bfloat16 ones (equal
    byte sizes, different meaning): the first layer is named with both dtypes."""
    owner = start_worker(pods.prefill, "prefill")
    wrong = start_worker(pods.decode, "decode", dtype=torch.float16)
    try:
        _refused_then_fine(
            pods, owner, wrong, f"layer {LAYERS[0]!r}: dtype float16 here, bfloat16 at the peer"
        )
    finally:
        wrong.stop()
        owner.stop()
