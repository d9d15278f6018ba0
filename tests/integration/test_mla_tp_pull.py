"""An MLA model (latent and indexer caches, whole on every TP rank) served by
a prefill engine of TP 2 to a decode engine of TP 1, through real kvmapd
daemons and stand-in workers (vLLM on CPU cannot run MLA prefill/decode):
the connector's scheduler grants only the prefill rank a decode rank reads,
for exactly its readers' pulls; the decode rank's pull reads that rank's
bytes through the daemons; a replay and a pull from the unread rank are
refused. Without decode_tp_size (open grants) the decode rank declares its
readers and releases the unread rank's grant, which the prefill workers hear."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from kvmap.client.client import KvmapClient
from kvmap.client.connector import (
    OPEN_GRANTS_KEY,
    ConnectorOptions,
    RecvTask,
    RemoteSource,
    SchedulerCore,
    WorkerCore,
)
from kvmap.core.errors import PermissionDenied
from kvmap.tools.launch import start_daemon, start_worker
from kvmap.v1 import transfers_pb2, types_pb2

pytestmark = pytest.mark.integration

BLOCKS, TOKENS = 16, 32
GEO = ("--blocks", str(BLOCKS), "--block-tokens", str(TOKENS))
MLA = (*GEO, "--mla-layers", "2", "--indexer-layers", "1")
PREFILL_BLOCKS = [[5, 1, 9], [5, 1, 9]]  # per transfer group: latent, indexer
DECODE_BLOCKS = [[4, 0, 7], [4, 0, 7]]


def _pull_cmd(spec: transfers_pb2.TransferSpec, rank: int) -> dict[str, Any]:
    """The demo worker's pull of ``spec``, from prefill rank ``rank``."""
    return {
        "cmd": "pull",
        "request_id": spec.request_id,
        "remote_target": spec.remote_target,
        "remote_worker": {"engine_id": "prefill", "tp_rank": rank},
        "groups": [
            {
                "group": g.transfer_group,
                "local": list(g.local_block_ids),
                "remote": list(g.remote_block_ids),
            }
            for g in spec.groups
        ],
        "capability": spec.capability,
        "verify": False,
    }


def _verify(worker: Any, seed: int) -> int:
    """Blocks of the decode worker that do not hold the prefill pattern of ``seed``."""
    return sum(
        worker.call(
            {"cmd": "verify", "group": g, "local": DECODE_BLOCKS[g],
             "remote": PREFILL_BLOCKS[g], "seed": seed}
        )["bad_blocks"]
        for g in range(2)
    )  # fmt: skip


def test_mla_prefill_tp2_serves_decode_tp1(tmp_path: Path) -> None:
    """Prefill TP2 (rank 0 filled with seed 0, rank 1 with seed 1) -> decode TP1: the offered
    capabilities hold rank 0's grant and no grant for rank 1; the decode rank's one pull reads
    rank 0 and lands byte for byte (seed 0's pattern, not seed 1's); the grant admitted one pull
    only (a replay is PERMISSION_DENIED), and rank 0's capability does not read rank 1."""
    prefill = start_daemon(tmp_path / "p", name="prefill")
    decode = start_daemon(tmp_path / "d", name="decode")
    p0 = start_worker(prefill, "prefill", *MLA, "--tp-size", "2", "--tp-rank", "0", "--fill")
    p1 = start_worker(prefill, "prefill", *MLA, "--tp-size", "2", "--tp-rank", "1")
    dw = start_worker(decode, "decode", *MLA)
    try:
        assert p1.call({"cmd": "fill", "seed": 1})["ok"]
        opts = ConnectorOptions(
            socket=prefill.socket, peer_address=prefill.tcp_target, decode_tp_size=1
        )
        sched = SchedulerCore(
            "prefill", opts, tp_size=2, client=KvmapClient.connect(prefill.socket),
            block_size=TOKENS, replicated=True,
        )  # fmt: skip
        assert sched.readers == (1, 0)
        params: dict[str, Any] = {"do_remote_decode": True}
        sched.after_alloc("req", params, PREFILL_BLOCKS, 0)
        sched.build_meta()
        keep, kv = sched.request_finished(
            "req", params, finished_normally=True, block_ids=PREFILL_BLOCKS,
            num_computed_tokens=3 * TOKENS,
        )  # fmt: skip
        assert keep and kv is not None
        assert kv["kvmap_capability"].split(".")[1] == "-"
        reader = WorkerCore(
            KvmapClient.connect(decode.socket), types_pb2.WorkerId(engine_id="decode"),
            ConnectorOptions(socket=decode.socket), tp_size=1, block_size=TOKENS,
            replicated=True,
        )  # fmt: skip
        try:
            task = RecvTask("req-d", RemoteSource.parse(kv), tuple(map(tuple, DECODE_BLOCKS)))
            (spec,) = reader.specs_for(task)
        finally:
            reader.shutdown()
        assert spec.remote_worker.tp_rank == 0
        assert _verify(dw, 0) > 0
        result = dw.call(_pull_cmd(spec, 0))
        assert result.get("ok"), result
        assert _verify(dw, 0) == 0
        assert _verify(dw, 1) > 0
        replay = dw.call(_pull_cmd(spec, 0))
        assert not replay["ok"] and replay["code"] == "PERMISSION_DENIED", replay
        other = dw.call(_pull_cmd(spec, 1))
        assert not other["ok"] and other["code"] == "PERMISSION_DENIED", other
    finally:
        for w in (dw, p1, p0):
            w.stop()
        for d in (decode, prefill):
            d.stop()


def _finished(worker: Any, timeout: float = 30) -> dict[str, Any]:
    """The worker's first TransferFinished event (its fields as JSON), once it arrived."""
    deadline = time.monotonic() + timeout
    while True:
        events = worker.call({"cmd": "events"})["events"]
        done = [e["transfer_finished"] for e in events if "transfer_finished" in e]
        if done or time.monotonic() > deadline:
            assert done, "no TransferFinished event arrived"
            return done[0]
        time.sleep(0.05)  # polling another process's event list


def _offer_open(prefill: Any) -> dict[str, Any]:
    """A prefill scheduler of TP2 with no decode_tp_size offers one request: open grants."""
    opts = ConnectorOptions(socket=prefill.socket, peer_address=prefill.tcp_target)
    sched = SchedulerCore(
        "prefill", opts, tp_size=2, client=KvmapClient.connect(prefill.socket),
        block_size=TOKENS, replicated=True,
    )  # fmt: skip
    params: dict[str, Any] = {"do_remote_decode": True}
    sched.after_alloc("req", params, PREFILL_BLOCKS, 0)
    sched.build_meta()
    keep, kv = sched.request_finished(
        "req", params, finished_normally=True, block_ids=PREFILL_BLOCKS,
        num_computed_tokens=3 * TOKENS,
    )  # fmt: skip
    assert keep and kv is not None
    return kv


def test_mla_prefill_tp2_serves_decode_tp1_with_open_grants(tmp_path: Path) -> None:
    """Prefill TP2 without decode_tp_size grants both ranks openly; the decode rank (TP1)
    pulls rank 0 declaring 1 reader and releases rank 1 declaring none, through the real
    daemons: the bytes land (seed 0), rank 0's worker hears its grant used up (1 of 1) and
    rank 1's hears it released and used up, so both free their blocks at once; a replay of
    either is PERMISSION_DENIED."""
    prefill = start_daemon(tmp_path / "p", name="prefill")
    decode = start_daemon(tmp_path / "d", name="decode")
    p0 = start_worker(prefill, "prefill", *MLA, "--tp-size", "2", "--tp-rank", "0", "--fill")
    p1 = start_worker(prefill, "prefill", *MLA, "--tp-size", "2", "--tp-rank", "1")
    dw = start_worker(decode, "decode", *MLA)
    reader = WorkerCore(
        KvmapClient.connect(decode.socket), types_pb2.WorkerId(engine_id="decode"),
        ConnectorOptions(socket=decode.socket), tp_size=1, block_size=TOKENS, replicated=True,
    )  # fmt: skip
    try:
        assert p1.call({"cmd": "fill", "seed": 1})["ok"]
        kv = _offer_open(prefill)
        assert kv[OPEN_GRANTS_KEY] is True and "-" not in kv["kvmap_capability"].split(".")
        task = RecvTask("req-d", RemoteSource.parse(kv), tuple(map(tuple, DECODE_BLOCKS)))
        (spec,) = reader.specs_for(task)
        (release,) = reader.release_specs(task, pulling=True)
        assert (spec.remote_worker.tp_rank, spec.readers) == (0, 1)
        assert (release.remote_worker.tp_rank, release.readers, release.release) == (1, 0, True)
        reader.client.pull(spec)
        assert _verify(dw, 0) == 0 and _verify(dw, 1) > 0
        assert reader.client.pull(release).bytes == 0
        pulled, released = _finished(p0), _finished(p1)
        assert (pulled.get("uses"), pulled.get("max_uses"), pulled.get("exhausted")) == (1, 1, True)
        assert not pulled.get("released")
        assert released.get("released") and released.get("exhausted"), released
        for again in (spec, release):
            with pytest.raises(PermissionDenied):
                reader.client.pull(again)
    finally:
        reader.shutdown()
        for w in (dw, p1, p0):
            w.stop()
        for d in (decode, prefill):
            d.stop()
