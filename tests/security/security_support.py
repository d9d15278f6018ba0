"""What the security tests share: workers whose memory the test itself owns,
so that every byte can be checked, and a two-daemon cluster.

A ``ShmWorker`` registers a KV cache that lives in a memfd mapped into the
test process: two allocations (an MLA row of three 64-byte layers and an
indexer row of one 32-byte layer), each row with padding bytes before and
after its layers that belong to no view, and each allocation surrounded by
guard pages that belong to no allocation. Every byte starts random (seeded
per worker), and ``expected`` is what the buffer must hold: a test updates
it for the transfers it expects to land, then ``assert_intact`` compares the
whole memfd, guards and padding included, byte for byte. A ``ShmWorker``
keeps an Attach stream open, as a live worker does, and grants transfers of
its blocks (``grant``); ``Cluster.spec`` carries the prefill worker's grant,
so that a hostile request is refused for what it is, not for a missing
capability.
"""

from __future__ import annotations

import json
import mmap
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmap.client.fd_handoff import sealed_memfd, send_fds
from kvmap.client.transports.grpc import spec_request_bytes
from kvmap.client.transports.local_calls import PULL_FIELD, PUSH_FIELD, LocalCalls, call_bytes
from kvmap.core.config import LOCAL_CALLS_SUFFIX
from kvmap.core.errors import KvmapError
from kvmap.tools.launch import DaemonProc, start_daemon
from kvmap.v1 import (
    peer_pb2,
    peer_pb2_grpc,
    region_maps_pb2,
    region_maps_pb2_grpc,
    registry_pb2,
    registry_pb2_grpc,
    transfers_pb2,
    transfers_pb2_grpc,
    types_pb2,
)

Code = grpc.StatusCode
PAGE = mmap.PAGESIZE
CALL_TIMEOUT_S = 30.0
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
]

# Row layouts: (layer name, offset in the row, length); row stride.
MLA_LAYERS = [("m0", 16, 64), ("m1", 80, 64), ("m2", 144, 64)]
MLA_STRIDE = 240  # 16 bytes of padding before the layers, 32 after
IDX_LAYERS = [("i0", 8, 32)]
IDX_STRIDE = 48  # 8 bytes of padding before, 8 after
GROUPS = {0: (MLA_LAYERS, MLA_STRIDE), 1: (IDX_LAYERS, IDX_STRIDE)}
KIND = {0: types_pb2.CACHE_KIND_MLA, 1: types_pb2.CACHE_KIND_INDEXER}


def _round_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


class Live:
    """Channels and stubs to one daemon (a thin copy of the fuzz helper: the
    two test folders do not import each other)."""

    def __init__(self, daemon: DaemonProc) -> None:
        self.daemon = daemon
        self.unix = grpc.insecure_channel(daemon.unix_target, options=CHANNEL_OPTIONS)
        self.tcp = daemon.channel(tcp=True, options=CHANNEL_OPTIONS)
        self.registry = registry_pb2_grpc.RegistryStub(self.unix)
        self.maps = region_maps_pb2_grpc.RegionMapsStub(self.unix)
        self.transfers = transfers_pb2_grpc.TransfersStub(self.unix)
        self.peer = peer_pb2_grpc.PeerStub(self.tcp)

    def close(self) -> None:
        self.unix.close()
        self.tcp.close()

    def snapshot(self) -> str:
        listed = self.maps.ListWorkers(region_maps_pb2.ListWorkersRequest(), timeout=10)
        maps = [
            json_format.MessageToDict(
                self.maps.GetRegionMap(
                    region_maps_pb2.GetRegionMapRequest(worker=w.worker), timeout=10
                ),
                preserving_proto_field_name=True,
            )
            for w in listed.workers
        ]
        return json.dumps(
            [json_format.MessageToDict(listed, preserving_proto_field_name=True), maps],
            sort_keys=True,
        )

    def assert_healthy(self) -> None:
        rc = self.daemon.proc.poll()
        assert rc is None, f"kvmapd exited {rc}:\n{self.daemon.log()[-4000:]}"
        for ch in (self.unix, self.tcp):
            got = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=10
            )
            assert got.status == health_pb2.HealthCheckResponse.SERVING

    def crashes(self) -> str:
        lines = [ln for ln in self.daemon.log().splitlines() if "rpc_crashed" in ln]
        return "\n".join(lines[-3:])


class ShmWorker:
    """A worker whose KV cache is a memfd the test maps and checks byte for byte."""

    def __init__(
        self, live: Live, engine_id: str, blocks: int, seed: int, tp: tuple[int, int] = (0, 1)
    ) -> None:
        """``tp``: its tensor-parallel rank and size (what a grant's readers
        are checked against)."""
        self.live = live
        self.engine_id = engine_id
        self.tp_rank, self.tp_size = tp
        self.blocks = blocks
        sizes = {0: blocks * MLA_STRIDE, 1: blocks * IDX_STRIDE}
        # [guard page][group 0 allocation][guard pages][group 1 allocation][guard page]
        self.offsets = {0: PAGE, 1: PAGE + _round_up(sizes[0]) + PAGE}
        self.sizes = sizes
        self.file_size = self.offsets[1] + _round_up(sizes[1]) + PAGE
        self.fd = sealed_memfd(f"kv-{engine_id}", self.file_size)
        self._mm = mmap.mmap(self.fd, self.file_size, flags=mmap.MAP_SHARED)
        self.buf: npt.NDArray[np.uint8] = np.frombuffer(self._mm, dtype=np.uint8)
        self.buf[:] = np.random.default_rng(seed).integers(0, 256, self.file_size, np.uint8)
        self.expected = self.buf.copy()
        self.region_map: types_pb2.RegionMap | None = None
        self._attach: Any = None

    @property
    def worker_id(self) -> types_pb2.WorkerId:
        return types_pb2.WorkerId(engine_id=self.engine_id, tp_rank=self.tp_rank)

    def request(self, token: str) -> registry_pb2.RegisterWorkerRequest:
        req = registry_pb2.RegisterWorkerRequest(
            worker=self.worker_id,
            kv_cache_layout="BLHNC",
            block_size_tokens=16,
            tp_size=self.tp_size,
        )
        for g, (layers, stride) in GROUPS.items():
            alloc = f"g{g}"
            req.allocations.add(
                id=alloc,
                size_bytes=self.sizes[g],
                device=types_pb2.Device(type=types_pb2.DEVICE_TYPE_CPU),
                shm_fd=types_pb2.ShmFdHandle(token=token, index=0, offset_bytes=self.offsets[g]),
            )
            for name, off, ln in layers:
                req.views.add(
                    layer_name=name,
                    allocation_id=alloc,
                    transfer_group=g,
                    cache_kind=KIND[g],
                    dtype="uint8",
                    offset_bytes=off,
                    block_len_bytes=ln,
                    block_stride_bytes=stride,
                    num_blocks=self.blocks,
                )
        return req

    def register(self) -> types_pb2.RegionMap:
        token = send_fds(self.live.daemon.socket + ".fds", [self.fd], 10)
        resp = self.live.registry.RegisterWorker(self.request(token), timeout=CALL_TIMEOUT_S)
        self.region_map = resp.region_map
        return resp.region_map

    def attach(self) -> None:
        """Open the worker's Attach stream (the daemon grants transfers of
        attached workers only) and drain its events on a thread."""
        self._attach = self.live.registry.Attach(registry_pb2.AttachRequest(worker=self.worker_id))
        assert next(self._attach).HasField("attached")
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        try:
            for _ in self._attach:
                pass
        except grpc.RpcError:
            return  # cancelled, or the daemon went away

    def grant(
        self,
        request_id: str,
        blocks: Mapping[int, Sequence[int]],
        *,
        ttl_ms: int = 0,
        max_uses: int = 0,
        open_uses: bool = False,
        unread_release: registry_pb2.UnreadRelease.ValueType = (
            registry_pb2.UNREAD_RELEASE_UNSPECIFIED
        ),
        access: registry_pb2.GrantAccess.ValueType = registry_pb2.GRANT_ACCESS_READ,
    ) -> str:
        """The capability for a peer to transfer exactly ``blocks`` (ids per
        transfer group) of this worker for ``request_id`` (``open_uses``: its
        first claim fixes the count; ``unread_release``: the worker's word on
        a release declaring no readers; ``access``: read them, or write them)."""
        return str(
            self._granted(
                request_id,
                blocks,
                ttl_ms=ttl_ms,
                max_uses=max_uses,
                open_uses=open_uses,
                unread_release=unread_release,
                access=access,
            ).capability
        )

    def expired_grant(self, request_id: str, blocks: Mapping[int, Sequence[int]]) -> str:
        """A capability for ``blocks`` of ``request_id`` whose expiry, as the
        daemon stated it, the wall clock has passed."""
        resp = self._granted(request_id, blocks, ttl_ms=1)
        while time.time_ns() // 1_000_000 <= resp.expires_unix_ms:
            time.sleep(0.001)  # the wall clock passing the stated expiry, not synchronisation
        return str(resp.capability)

    def _granted(
        self,
        request_id: str,
        blocks: Mapping[int, Sequence[int]],
        *,
        ttl_ms: int,
        max_uses: int = 0,
        open_uses: bool = False,
        unread_release: registry_pb2.UnreadRelease.ValueType = (
            registry_pb2.UNREAD_RELEASE_UNSPECIFIED
        ),
        access: registry_pb2.GrantAccess.ValueType = registry_pb2.GRANT_ACCESS_READ,
    ) -> registry_pb2.GrantTransferResponse:
        resp = self.live.registry.GrantTransfer(
            registry_pb2.GrantTransferRequest(
                worker=self.worker_id,
                request_id=request_id,
                groups=[
                    types_pb2.BlockGrant(transfer_group=g, block_ids=list(ids))
                    for g, ids in blocks.items()
                ],
                ttl_ms=ttl_ms,
                max_uses=max_uses,
                open_uses=open_uses,
                unread_release=unread_release,
                access=access,
            ),
            timeout=CALL_TIMEOUT_S,
        )
        assert resp.unread_release == unread_release, "the grant must keep the worker's word"
        assert resp.access == access, "the grant must keep its direction"
        return resp

    def grantable(self, groups: Sequence[dict[str, Any]]) -> dict[int, list[int]]:
        """The ``remote`` ids of ``groups`` this worker has, per group, each
        once; block 0 of group 0 when there are none (a hostile request still
        carries a real capability, so the check under test is what refuses it)."""
        out: dict[int, dict[int, None]] = {}
        for g in groups:
            if g["group"] in GROUPS:
                ids = (b for b in g["remote"] if 0 <= b < self.blocks)
                out.setdefault(g["group"], {}).update(dict.fromkeys(ids))
        blocks = {group: list(ids) for group, ids in out.items() if ids}
        return blocks or {0: [0]}

    def close(self) -> None:
        if self._attach is not None:
            self._attach.cancel()
        del self.buf, self.expected
        self._mm.close()
        os.close(self.fd)

    # Bytes ------------------------------------------------------------------

    def span(self, group: int, block: int, layer: str) -> slice:
        layers, stride = GROUPS[group]
        off, ln = next((o, n) for name, o, n in layers if name == layer)
        start = self.offsets[group] + block * stride + off
        return slice(start, start + ln)

    def layer_names(self, group: int) -> list[str]:
        return [name for name, _, _ in GROUPS[group][0]]

    def zone(self, offset: int) -> str:
        """What byte ``offset`` of the memfd is: guard, padding or a layer's block."""
        for g, (layers, stride) in GROUPS.items():
            start = self.offsets[g]
            if start <= offset < start + self.sizes[g]:
                block, col = divmod(offset - start, stride)
                for name, off, ln in layers:
                    if off <= col < off + ln:
                        return f"group {g} block {block} layer {name} byte {col - off}"
                return f"group {g} block {block} padding byte {col}"
        return f"guard byte {offset} (outside every allocation)"

    def diff(self) -> str:
        bad = np.flatnonzero(self.buf != self.expected)
        if not bad.size:
            return ""
        zones = sorted({self.zone(int(i)).rsplit(" byte", 1)[0] for i in bad[:4096]})
        return f"{bad.size} bytes differ from the expected contents, in: {zones[:12]}"

    def assert_intact(self, what: str) -> None:
        d = self.diff()
        assert not d, f"{self.engine_id}: {what}: {d}"


def expect_transfer(
    dest: ShmWorker,
    src: ShmWorker,
    group: int,
    dest_ids: Sequence[int],
    src_ids: Sequence[int],
    *,
    layers: Sequence[str] = (),
) -> None:
    """Record in ``dest.expected`` what an accepted transfer wrote."""
    for d, s in zip(dest_ids, src_ids, strict=True):
        for layer in layers or dest.layer_names(group):
            dest.expected[dest.span(group, d, layer)] = src.buf[src.span(group, s, layer)]


@dataclass
class Cluster:
    """A prefill daemon (coalesce) and a decode daemon (baseline), one
    test-owned worker each (by default 32 prefill blocks, 24 decode blocks)."""

    p: Live
    d: Live
    pw: ShmWorker
    dw: ShmWorker

    def __repr__(self) -> str:
        return "Cluster()"

    def spec(
        self,
        groups: Sequence[dict[str, Any]],
        *,
        request_id: str = "sec",
        target: str | None = None,
        remote_engine: str = "prefill",
        local_engine: str = "decode",
        remote_generation: int = 0,
        timeout_ms: int = 0,
        capability: str | None = None,
        write: bool = False,
    ) -> transfers_pb2.TransferSpec:
        """A transfer between decode (local) and prefill (remote) with, unless
        ``capability`` is given, the prefill worker's grant of the remote ids
        it has (``ShmWorker.grantable``): a read grant, or (``write``: a push
        into them) a write grant."""
        if capability is None:
            access = registry_pb2.GRANT_ACCESS_WRITE if write else registry_pb2.GRANT_ACCESS_READ
            capability = self.pw.grant(request_id, self.pw.grantable(groups), access=access)
        spec = transfers_pb2.TransferSpec(
            request_id=request_id,
            local_worker=types_pb2.WorkerId(engine_id=local_engine),
            remote_target=target or self.p.daemon.tcp_target,
            remote_worker=types_pb2.WorkerId(engine_id=remote_engine),
            remote_generation=remote_generation,
            timeout_ms=timeout_ms,
            capability=capability,
        )
        for g in groups:
            spec.groups.add(
                transfer_group=g["group"],
                local_block_ids=g["local"],
                remote_block_ids=g["remote"],
                layer_names=g.get("layers", []),
            )
        return spec

    def transfer(
        self, spec: transfers_pb2.TransferSpec, write: bool, *, local: bool = False
    ) -> tuple[Code, str]:
        """Run a pull (or push) on the decode daemon, over gRPC or (``local``)
        its local calls socket; (status, details)."""
        if local:
            return self._local_transfer(spec, write)
        try:
            if write:
                out = list(
                    self.d.transfers.Push(
                        transfers_pb2.PushRequest(spec=spec), timeout=CALL_TIMEOUT_S
                    )
                )
            else:
                out = list(
                    self.d.transfers.Pull(
                        transfers_pb2.PullRequest(spec=spec), timeout=CALL_TIMEOUT_S
                    )
                )
        except grpc.RpcError as err:
            return self._failed(err.code(), err.details() or "")
        assert out and out[-1].status.state == transfers_pb2.TRANSFER_STATE_DONE, out
        return Code.OK, ""

    def _local_transfer(self, spec: transfers_pb2.TransferSpec, write: bool) -> tuple[Code, str]:
        calls = LocalCalls(self.d.daemon.socket + LOCAL_CALLS_SUFFIX)
        frame = call_bytes(PUSH_FIELD if write else PULL_FIELD, spec_request_bytes(spec), "")
        try:
            out = calls.call(frame, CALL_TIMEOUT_S)
        except KvmapError as err:
            status, _, details = str(err).partition(": ")
            return self._failed(Code[status], details)
        finally:
            calls.close()
        assert out and out[-1].state == transfers_pb2.TRANSFER_STATE_DONE, out
        return Code.OK, ""

    def _failed(self, code: Code, details: str) -> tuple[Code, str]:
        assert code not in (Code.UNKNOWN, Code.INTERNAL), (
            f"{code.name}: {details}\n{self.d.crashes()}"
        )
        assert not (code is Code.DEADLINE_EXCEEDED and "no completion" not in details), (
            "the transfer hung past the client deadline"
        )
        return code, details

    def assert_all_intact(self, what: str) -> None:
        self.pw.assert_intact(what)
        self.dw.assert_intact(what)


def announcement(c: Cluster, capability: str, **kw: Any) -> peer_pb2.BeginTransferRequest:
    """A BeginTransfer of block 1 of group 0 of the prefill worker by agent
    "mallory" for request "req", unless ``kw`` says otherwise."""
    fields: dict[str, Any] = {
        "request_id": "req",
        "worker": types_pb2.WorkerId(engine_id="prefill"),
        "generation": c.pw.region_map.generation if c.pw.region_map else 1,
        "peer_agent": "mallory",
        "lease_ms": 60_000,
        "blocks": 1,
        "groups": [types_pb2.BlockGrant(transfer_group=0, block_ids=[1])],
        "capability": capability,
    }
    fields.update(kw)
    return peer_pb2.BeginTransferRequest(**fields)


def start_cluster(
    tmp: Path,
    p_blocks: int = 32,
    d_blocks: int = 24,
    prefill_listen: str = "127.0.0.1:0",
    decode_flags: tuple[str, ...] = (),
) -> Iterator[Cluster]:
    """Generator body of a module fixture: yields a cluster (the decode
    daemon started with ``decode_flags`` too), then stops it."""
    p = start_daemon(tmp / "p", "--planner", "coalesce", name="p", listen=prefill_listen)
    d = None
    workers: list[ShmWorker] = []
    try:
        d = start_daemon(tmp / "d", "--planner", "baseline", *decode_flags, name="d")
        pl, dl = Live(p), Live(d)
        pw = ShmWorker(pl, "prefill", p_blocks, seed=1)
        workers.append(pw)
        dw = ShmWorker(dl, "decode", d_blocks, seed=2)
        workers.append(dw)
        pw.register()
        dw.register()
        pw.attach()
        dw.attach()
        yield Cluster(pl, dl, pw, dw)
        for live in (pl, dl):
            live.assert_healthy()
            live.close()
        for proc in (d, p):
            assert proc.terminate() == 0, proc.log()[-4000:]
    finally:
        p.kill()
        if d is not None:
            d.kill()
        for w in workers:
            w.close()
