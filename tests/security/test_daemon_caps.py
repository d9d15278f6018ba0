"""What one daemon lets itself be made to hold, against real daemons: the
caps on workers and registered bytes, the release of a registration whose
worker never attaches, and one daemon per socket path."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmap.client.fd_handoff import sealed_memfd, send_fds
from kvmap.tools.launch import DaemonProc, local_env, start_daemon
from kvmap.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    region_maps_pb2,
    region_maps_pb2_grpc,
    registry_pb2,
    registry_pb2_grpc,
    types_pb2,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

Code = grpc.StatusCode
SPARSE = 100 * 10**9  # a 100 GB memfd, never touched
BLOCKS = 1 << 16


def _register(daemon: DaemonProc, engine: str, size: int) -> tuple[Code, str]:
    """Register a worker whose one allocation is a fresh sparse memfd of ``size`` bytes."""
    fd = sealed_memfd(f"kv-{engine}", size)
    try:
        token = send_fds(daemon.socket + ".fds", [fd], 10)
        req = registry_pb2.RegisterWorkerRequest(
            worker=types_pb2.WorkerId(engine_id=engine), kv_cache_layout="BLHNC",
            block_size_tokens=16,
        )  # fmt: skip
        req.allocations.add(
            id="kv", size_bytes=size, device=types_pb2.Device(type=types_pb2.DEVICE_TYPE_CPU),
            shm_fd=types_pb2.ShmFdHandle(token=token, index=0),
        )  # fmt: skip
        req.views.add(
            layer_name="l0", allocation_id="kv", transfer_group=0,
            cache_kind=types_pb2.CACHE_KIND_MLA, dtype="uint8", offset_bytes=0,
            block_len_bytes=size // BLOCKS, block_stride_bytes=size // BLOCKS, num_blocks=BLOCKS,
        )  # fmt: skip
        with grpc.insecure_channel(daemon.unix_target) as ch:
            try:
                registry_pb2_grpc.RegistryStub(ch).RegisterWorker(req, timeout=60)
            except grpc.RpcError as err:
                return err.code(), err.details() or ""
        return Code.OK, ""
    finally:
        os.close(fd)


def _listed(daemon: DaemonProc) -> set[str]:
    with grpc.insecure_channel(daemon.unix_target) as ch:
        resp = region_maps_pb2_grpc.RegionMapsStub(ch).ListWorkers(
            region_maps_pb2.ListWorkersRequest(), timeout=10
        )
    return {w.worker.engine_id for w in resp.workers}


def test_caps_on_registered_bytes_and_workers(tmp_path: Path) -> None:
    """40 registrations of sparse 100 GB memfds against a 300 GB (+1 MiB) cap: 3 are registered,
    the other 37 RESOURCE_EXHAUSTED naming max_registered_bytes and its value, and the daemon maps
    300 GB; small workers then fill max_workers (5) and the 6th is RESOURCE_EXHAUSTED naming it."""
    cap = 3 * SPARSE + (1 << 20)
    d = start_daemon(
        tmp_path / "d", "--max-registered-bytes", str(cap), "--max-workers", "5", name="d"
    )
    try:
        outcomes = [_register(d, f"big{i}", SPARSE) for i in range(40)]
        assert [code for code, _ in outcomes[:3]] == [Code.OK] * 3, outcomes[:3]
        refused = outcomes[3:]
        assert {code for code, _ in refused} == {Code.RESOURCE_EXHAUSTED}, refused[:3]
        assert {msg for _, msg in refused} == {
            f"max_registered_bytes ({cap}) would be exceeded: {3 * SPARSE} bytes are registered "
            f"and this worker asks for {SPARSE}"
        }
        with grpc.insecure_channel(d.unix_target) as ch:
            stats = admin_pb2_grpc.AdminStub(ch).GetStats(admin_pb2.GetStatsRequest(), timeout=10)
        assert stats.mapped_bytes == 3 * SPARSE and stats.workers == 3

        small = [_register(d, f"small{i}", BLOCKS) for i in range(3)]
        assert [code for code, _ in small[:2]] == [Code.OK] * 2, small
        assert small[2] == (
            Code.RESOURCE_EXHAUSTED, "max_workers (5) would be exceeded: 5 workers are registered"
        )  # fmt: skip
        assert _register(d, "small0", BLOCKS) == (Code.OK, "")  # a worker may register again
        assert len(_listed(d)) == 5
    finally:
        d.stop()


def test_a_registration_that_never_attaches_is_released(tmp_path: Path) -> None:
    """With attach_grace_s 3, a worker that registered and never attached disappears from
    ListWorkers, while one that attached stays registered."""
    d = start_daemon(tmp_path / "d", "--attach-grace-s", "3", name="d")
    try:
        assert _register(d, "attached", BLOCKS) == (Code.OK, "")
        with grpc.insecure_channel(d.unix_target) as ch:
            stream = registry_pb2_grpc.RegistryStub(ch).Attach(
                registry_pb2.AttachRequest(worker=types_pb2.WorkerId(engine_id="attached"))
            )
            assert next(stream).WhichOneof("event") == "attached"
            assert _register(d, "abandoned", BLOCKS) == (Code.OK, "")
            deadline = time.monotonic() + 60
            while "abandoned" in _listed(d):
                assert time.monotonic() < deadline, "the abandoned registration was never released"
                time.sleep(0.2)
            assert _listed(d) == {"attached"}
            stream.cancel()
        assert "registered_worker_never_attached" in d.log()
    finally:
        d.stop()


def _serving(daemon: DaemonProc) -> bool:
    with grpc.insecure_channel(daemon.unix_target) as ch:
        got = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return got.status == health_pb2.HealthCheckResponse.SERVING


def test_a_second_daemon_on_the_same_socket_is_refused(tmp_path: Path) -> None:
    """A second kvmapd on a live daemon's socket path exits 2 with one line naming the path and
    the first daemon's PID, and no traceback; the first still serves on its Unix socket."""
    first = start_daemon(tmp_path / "d", name="k")
    try:
        second = subprocess.run(
            [
                sys.executable, "-m", "kvmap.daemon.cli.kvmapd", "serve",
                "--socket", first.socket, "--listen", "127.0.0.1:0",
            ],
            check=False, capture_output=True, text=True, timeout=120, env=local_env(tmp_path),
        )  # fmt: skip
        assert second.returncode == 2, second.stderr[-2000:]
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1, second.stderr[-2000:]
        assert first.socket in lines[0] and f"pid {first.proc.pid}" in lines[0], lines[0]
        assert _serving(first)
    finally:
        first.stop()


def test_a_killed_daemons_socket_is_taken_over(tmp_path: Path) -> None:
    """After kill -9, the socket file stays behind; a new daemon on the same path starts and
    serves on it."""
    first = start_daemon(tmp_path / "d", name="k")
    first.kill()
    assert Path(first.socket).exists()
    second = start_daemon(tmp_path / "d", name="k")
    try:
        assert second.socket == first.socket
        assert _serving(second)
    finally:
        second.stop()
