"""A prefill worker that is not listening when its blocks were pulled still
learns of it, even across a ``kill -9`` of its daemon: the notification is in
the state store until an Attach stream has sent it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmap.tools.launch import start_daemon, start_worker
from kvmap.v1 import registry_pb2, registry_pb2_grpc, types_pb2

pytestmark = pytest.mark.integration

BLOCKS, TOKENS, LAYERS = 16, 32, 3
PAGE = TOKENS * 656  # the demo worker's MLA page
GEO = ("--blocks", str(BLOCKS), "--block-tokens", str(TOKENS), "--mla-layers", str(LAYERS))


def registration(kv_file: Path) -> registry_pb2.RegisterWorkerRequest:
    req = registry_pb2.RegisterWorkerRequest(
        worker=types_pb2.WorkerId(engine_id="prefill"), kv_cache_layout="BLHNC",
        block_size_tokens=TOKENS,
    )  # fmt: skip
    req.allocations.add(
        id="kv",
        size_bytes=BLOCKS * LAYERS * PAGE,
        shm_path=types_pb2.ShmPathHandle(path=str(kv_file)),
    )
    for i in range(LAYERS):
        req.views.add(
            layer_name=f"model.layers.{i}.self_attn.attn", allocation_id="kv", transfer_group=0,
            cache_kind=types_pb2.CACHE_KIND_MLA, dtype="uint8", offset_bytes=i * PAGE,
            block_len_bytes=PAGE, block_stride_bytes=LAYERS * PAGE, num_blocks=BLOCKS,
        )  # fmt: skip
    return req


def test_finished_notification_survives_daemon_kill(tmp_path: Path) -> None:
    """A transfer_finished event for a worker that was not attached survives a SIGKILL of its
    daemon: after restart from the state dir, Attach yields the restored generation and then that
    pull's event."""
    kv_file = tmp_path / "kv.bin"
    kv_file.write_bytes(bytes(range(256)) * (BLOCKS * LAYERS * PAGE // 256))
    state = tmp_path / "state"
    prefill = start_daemon(tmp_path / "p", "--state-dir", str(state), name="prefill")
    with prefill.channel() as ch:  # registered, but never attached
        registry_pb2_grpc.RegistryStub(ch).RegisterWorker(registration(kv_file), timeout=10)
    decode = start_daemon(tmp_path / "q", name="decode")
    dw = start_worker(decode, "decode", *GEO, "--indexer-layers", "1")
    restarted = None
    try:
        out = dw.call(
            {
                "cmd": "pull",
                "request_id": "while-away",
                "remote_target": prefill.tcp_target,
                "remote_worker": {"engine_id": "prefill"},
                "groups": [{"group": 0, "local": [0, 1], "remote": [5, 6]}],
                "verify": False,
            }
        )
        assert out["ok"], out
        prefill.kill()
        restarted = start_daemon(
            tmp_path / "p", "--state-dir", str(state), name="prefill", listen=prefill.tcp_target
        )
        with restarted.channel() as ch:
            stream = registry_pb2_grpc.RegistryStub(ch).Attach(
                registry_pb2.AttachRequest(worker=types_pb2.WorkerId(engine_id="prefill")),
                timeout=10,
            )
            first, second = next(stream), next(stream)
            stream.cancel()
        assert first.WhichOneof("event") == "attached"
        assert first.attached.generation == 2  # restored from the state store
        assert second.transfer_finished.request_id == "while-away"
        assert second.transfer_finished.direction == registry_pb2.TRANSFER_DIRECTION_PULLED_FROM
    finally:
        dw.stop()
        assert decode.terminate() == 0, decode.log()
        if restarted is not None:
            assert restarted.terminate() == 0, restarted.log()
