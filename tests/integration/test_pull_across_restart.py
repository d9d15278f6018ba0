"""A pull that starts while the owner's kvmapd is down (``kill -9`` or a
graceful SIGTERM, as in an upgrade) lands once the daemon is back on the same
state dir and port: the puller's daemon retries with backoff (and counts the
retries in its metrics), the restarted owner still has the worker and the
grant, and the owner's worker hears of the pull exactly once."""

from __future__ import annotations

import re
import socket
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from test_pending_events import GEO, HANG_GUARD_POLLS, _attach, _wait_until_no_lease, registration

from kvmap.client.fd_handoff import credential_metadata
from kvmap.tools.launch import DaemonProc, start_daemon, start_worker
from kvmap.v1 import registry_pb2, registry_pb2_grpc, types_pb2

pytestmark = pytest.mark.integration

PREFILL = types_pb2.WorkerId(engine_id="prefill")


def _grant(registry: Any, request_id: str, blocks: list[int], metadata: Any) -> str:
    grant = registry.GrantTransfer(
        registry_pb2.GrantTransferRequest(
            worker=PREFILL,
            request_id=request_id,
            groups=[types_pb2.BlockGrant(transfer_group=0, block_ids=blocks)],
        ),
        metadata=metadata,
        timeout=10,
    )
    capability: str = grant.capability
    return capability


def _pull(
    request_id: str, target: str, capability: str, local: list[int], remote: list[int]
) -> dict[str, Any]:
    return {
        "cmd": "pull",
        "request_id": request_id,
        "remote_target": target,
        "remote_worker": {"engine_id": "prefill"},
        "groups": [{"group": 0, "local": local, "remote": remote}],
        "capability": capability,
        "verify": False,
    }


def _wait_for_retry(daemon: DaemonProc) -> None:
    """Bounded wait until the daemon has logged a transfer retry (the pull
    met the owner down and is waiting to try again)."""
    for _ in range(HANG_GUARD_POLLS):
        if "transfer_retry" in daemon.log():
            return
        time.sleep(0.05)  # polling a condition; the bound is only a hang guard
    raise AssertionError(f"the pull was never retried\n{daemon.log()}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def _retries(metrics_port: int) -> float:
    """The daemon's kvmap_transfer_retries for pulls that met UNAVAILABLE."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
    found = re.search(
        r'^kvmap_transfer_retries_total\{code="UNAVAILABLE",direction="pull"\} (\S+)$',
        text.decode(),
        re.M,
    )
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize("stop", ["kill -9", "SIGTERM"])
def test_a_pull_started_while_the_owner_is_down_lands_after_its_restart(
    tmp_path: Path, stop: str
) -> None:
    """Grant, then stop the prefill daemon (``kill -9``, or SIGTERM: it drains and exits 0 but
    keeps the worker and grant in its state store); the decode's pull starts during the gap and
    is retried (its daemon logs transfer_retry and counts it in kvmap_transfer_retries) until the
    prefill daemon restarts on the same state dir and port; the pull then succeeds with the grant
    minted before the stop. The prefill worker, attaching to the restarted daemon, hears that
    pull's transfer_finished once: the next event is a later pull's, not a repeat; and the spent
    capability admits nothing more. (Pins: the decode daemon's retry and its metric, the
    persisted grant, one notification per completed pull.)"""
    kv_file = tmp_path / "kv.bin"
    kv_file.write_bytes(bytes(range(256)) * (16 * 3 * 32 * 656 // 256))
    state = tmp_path / "state"
    # The KV file is a path registration: its directory must be an allowed prefix, and the
    # registering uid's credentials go with it (the worker's calls are honoured from it only).
    shm = ("--shm-path-prefix", str(tmp_path))
    prefill = start_daemon(tmp_path / "p", "--state-dir", str(state), *shm, name="prefill")
    with prefill.channel() as ch:
        registry = registry_pb2_grpc.RegistryStub(ch)
        me = credential_metadata(prefill.socket)
        registry.RegisterWorker(registration(kv_file), timeout=10, metadata=me)
        attach = _attach(ch, me)
        capability = _grant(registry, "gap", [5, 6], me)
        if stop == "SIGTERM":
            assert prefill.terminate() == 0, prefill.log()
        else:
            prefill.kill()
        attach.cancel()
    metrics_port = _free_port()
    decode = start_daemon(
        tmp_path / "q", "--metrics-listen", f"127.0.0.1:{metrics_port}", name="decode"
    )
    assert _retries(metrics_port) == 0
    dw = start_worker(decode, "decode", *GEO, "--indexer-layers", "0")
    restarted: list[DaemonProc] = []
    result: dict[str, Any] = {}
    puller = threading.Thread(
        target=lambda: result.update(
            dw.call(_pull("gap", prefill.tcp_target, capability, [0, 1], [5, 6]))
        ),
        daemon=True,
    )
    try:
        puller.start()
        _wait_for_retry(decode)
        restarted.append(
            start_daemon(
                tmp_path / "p", "--state-dir", str(state), *shm, name="prefill",
                listen=prefill.tcp_target,
            )
        )  # fmt: skip
        puller.join(60)
        assert result.get("ok"), result
        assert result["stats"]["bytes"] > 0
        assert _retries(metrics_port) >= 1
        _wait_until_no_lease(restarted[0])
        with restarted[0].channel() as ch:
            registry = registry_pb2_grpc.RegistryStub(ch)
            me = credential_metadata(restarted[0].socket)  # the restart forgot the old token
            stream = _attach(ch, me)
            first = next(stream)
            assert first.transfer_finished.request_id == "gap"
            assert first.transfer_finished.direction == registry_pb2.TRANSFER_DIRECTION_PULLED_FROM
            again = dw.call(_pull("gap", restarted[0].tcp_target, capability, [2, 3], [5, 6]))
            assert not again["ok"] and again["code"] == "PERMISSION_DENIED", again
            later = _grant(registry, "later", [7], me)
            assert dw.call(_pull("later", restarted[0].tcp_target, later, [4], [7]))["ok"]
            assert next(stream).transfer_finished.request_id == "later"
            stream.cancel()
    finally:
        dw.stop()
        assert decode.terminate() == 0, decode.log()
        for d in restarted:
            d.stop()
