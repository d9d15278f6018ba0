"""A prefill worker that is not listening when its blocks were pulled still
learns of it, even across a ``kill -9`` of its daemon: the notification is in
the state store until an Attach stream has sent it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvmap.client.fd_handoff import credential_metadata
from kvmap.tools.launch import DaemonProc, start_daemon, start_worker
from kvmap.v1 import admin_pb2, admin_pb2_grpc, registry_pb2, registry_pb2_grpc, types_pb2

pytestmark = pytest.mark.integration

BLOCKS, TOKENS, LAYERS = 16, 32, 3
PAGE = TOKENS * 656  # the demo worker's MLA page
HANG_GUARD_POLLS = 1200  # 60 s
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


def _attach(ch: grpc.Channel, metadata: Any) -> Any:
    """An Attach stream of the prefill worker, once its ``attached`` event is in."""
    stream = registry_pb2_grpc.RegistryStub(ch).Attach(
        registry_pb2.AttachRequest(worker=types_pb2.WorkerId(engine_id="prefill")),
        timeout=30, metadata=metadata,
    )  # fmt: skip
    assert next(stream).WhichOneof("event") == "attached"
    return stream


def test_finished_notification_survives_daemon_kill(tmp_path: Path) -> None:
    """A transfer_finished event for a worker that was not attached survives a SIGKILL of its
    daemon. The worker was attached when it granted the pull (grants need a live worker); its
    daemon was then killed and restarted from the state dir (the worker restored, the grant kept,
    nobody attached) and the pull lands; after a second kill and restart, Attach yields the
    restored generation and then that pull's event."""
    kv_file = tmp_path / "kv.bin"
    kv_file.write_bytes(bytes(range(256)) * (BLOCKS * LAYERS * PAGE // 256))
    state = tmp_path / "state"
    # The KV file is a path registration: its directory must be an allowed prefix.
    shm = ("--shm-path-prefix", str(tmp_path))
    prefill = start_daemon(tmp_path / "p", "--state-dir", str(state), *shm, name="prefill")
    with prefill.channel() as ch:
        registry = registry_pb2_grpc.RegistryStub(ch)
        # The registering uid's credentials: a path registration needs them, and the
        # worker's Attach and grants are then honoured from that uid only.
        me = credential_metadata(prefill.socket)
        registry.RegisterWorker(registration(kv_file), timeout=10, metadata=me)
        attach = _attach(ch, me)
        # The owner grants the pull, as the vLLM connector does.
        grant = registry.GrantTransfer(
            registry_pb2.GrantTransferRequest(
                worker=types_pb2.WorkerId(engine_id="prefill"),
                request_id="while-away",
                groups=[types_pb2.BlockGrant(transfer_group=0, block_ids=[5, 6])],
            ),
            timeout=10, metadata=me,
        )  # fmt: skip
        prefill.kill()  # the Attach stream dies with it: nobody is attached now
        attach.cancel()
    restarts: list[DaemonProc] = []

    def restart() -> DaemonProc:
        restarts.append(
            start_daemon(
                tmp_path / "p", "--state-dir", str(state), *shm, name="prefill",
                listen=prefill.tcp_target,
            )
        )  # fmt: skip
        return restarts[-1]

    decode = start_daemon(tmp_path / "q", name="decode")
    dw = start_worker(decode, "decode", *GEO, "--indexer-layers", "0")
    try:
        away = restart()
        out = dw.call(
            {
                "cmd": "pull",
                "request_id": "while-away",
                "remote_target": away.tcp_target,
                "remote_worker": {"engine_id": "prefill"},
                "groups": [{"group": 0, "local": [0, 1], "remote": [5, 6]}],
                "capability": grant.capability,
                "verify": False,
            }
        )
        assert out["ok"], out
        # The puller is done once its notification is sent; the owner ends the
        # lease (and stores the event) when its progress loop takes it in.
        _wait_until_no_lease(away)
        away.kill()
        with restart().channel() as ch:
            stream = _attach_events(ch)
            first, second = next(stream), next(stream)
            stream.cancel()
        assert first.WhichOneof("event") == "attached"
        assert first.attached.generation == 3  # restored from the state store, twice
        assert second.transfer_finished.request_id == "while-away"
        assert second.transfer_finished.direction == registry_pb2.TRANSFER_DIRECTION_PULLED_FROM
    finally:
        dw.stop()
        assert decode.terminate() == 0, decode.log()
        if restarts and restarts[-1].proc.poll() is None:
            assert restarts[-1].terminate() == 0, restarts[-1].log()
        for d in restarts:
            d.kill()


def _wait_until_no_lease(daemon: DaemonProc) -> None:
    """Bounded wait until the owner has taken in the pull's notification (its
    lease is gone: the event is in the state store by then)."""
    with daemon.channel() as ch:
        admin = admin_pb2_grpc.AdminStub(ch)
        for _ in range(HANG_GUARD_POLLS):
            if admin.GetStats(admin_pb2.GetStatsRequest(), timeout=10).leases == 0:
                return
            time.sleep(0.05)  # polling a condition; the bound is only a hang guard
    raise AssertionError("the owner never took in the pull's notification")


def _attach_events(ch: grpc.Channel) -> Any:
    return registry_pb2_grpc.RegistryStub(ch).Attach(
        registry_pb2.AttachRequest(worker=types_pb2.WorkerId(engine_id="prefill")), timeout=10
    )
