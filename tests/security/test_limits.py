"""The daemon's stated limits, each hit against live daemons with the exact
status and a message that names the limit, and each checked at the limit
too (what is allowed still works):

- 16 MiB per message on the Unix socket, every method, and on TCP each
  method's own limit (``api.limits``: what a peer legitimately sends);
- 16,384 views per worker (and 1,024 allocations, 2**24 blocks per view);
- 65,536 blocks per transfer;
- 1,024 outstanding transfers per peer (``Peer.BeginTransfer``).

Workers have 65,536 blocks so that the largest allowed transfer is real.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from security_support import Cluster, Live, expect_transfer, start_cluster

from kvmap.client.fd_handoff import sealed_memfd, send_fds
from kvmap.core.transfer_plan import MAX_BLOCKS_PER_TRANSFER
from kvmap.core.validation import (
    MAX_ALLOCATIONS,
    MAX_BLOCKS,
    MAX_DESCRIPTORS,
    MAX_VIEWS,
)
from kvmap.daemon.api.limits import SMALL_REQUEST_BYTES, TCP_REQUEST_LIMITS
from kvmap.daemon.api.server import MAX_MESSAGE_BYTES
from kvmap.daemon.engine.leases import MAX_LEASES_PER_PEER
from kvmap.v1 import (
    region_maps_pb2,
    registry_pb2,
    types_pb2,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

Code = grpc.StatusCode
ROOT = Path(__file__).resolve().parents[2]
BLOCKS = MAX_BLOCKS_PER_TRANSFER


def _documented_number(text: str) -> int:
    """A number as the docs write it: 16,384 or 2^24, optionally in MiB."""
    number, _, unit = text.partition(" ")
    base, _, exponent = number.replace(",", "").partition("^")
    value = int(base) ** int(exponent) if exponent else int(base)
    return value * {"": 1, "MiB": 1 << 20}[unit]


def _prose(path: str) -> str:
    """A document of the repository with its line breaks and indents as single spaces."""
    return " ".join((ROOT / path).read_text().split())


def test_the_limits_are_the_documented_ones() -> None:
    """The limit constants have the values the list of limits in docs/operate.md states
    (views, allocations, blocks per view, blocks per transfer, message size, outstanding
    transfers per peer), and those docs/architecture.md states for validation and transfers."""
    listed = re.search(r"Limits: ([^.]*)\.", _prose("docs/operate.md"))
    assert listed is not None, "docs/operate.md states no limits"
    operate: dict[str, int] = {}
    for item in listed.group(1).split(", "):
        found = re.fullmatch(r"([\d,^]+(?: MiB)?) (.+)", item)
        if found is not None:  # a limit not stated as "<number> <what>" is not one of these
            operate[found.group(2)] = _documented_number(found.group(1))
    constants = {
        "views": MAX_VIEWS,
        "allocations": MAX_ALLOCATIONS,
        "blocks per view": MAX_BLOCKS,
        "blocks per transfer": MAX_BLOCKS_PER_TRANSFER,
        "messages": MAX_MESSAGE_BYTES,
        "outstanding transfers per authenticated peer (not per agent name)": MAX_LEASES_PER_PEER,
    }
    assert {name: operate.get(name) for name in constants} == constants
    architecture = _prose("docs/architecture.md")
    stated = [
        (r"more than ([\d,]+) views or ([\d,]+) allocations", [MAX_VIEWS, MAX_ALLOCATIONS]),
        (r"more than (2\^\d+) blocks in a view or (2\^\d+) blocks", [MAX_BLOCKS, MAX_DESCRIPTORS]),
        (r"at most ([\d,]+) block pairs per transfer", [MAX_BLOCKS_PER_TRANSFER]),
    ]
    for pattern, values in stated:
        found = re.search(pattern, architecture)
        assert found is not None, f"docs/architecture.md no longer says {pattern!r}"
        assert [_documented_number(n) for n in found.groups()] == values, pattern


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from start_cluster(tmp_path_factory.mktemp("limits"), BLOCKS, BLOCKS)


def _code(fn: Any, req: Any, timeout: float = 60) -> tuple[Code, str, Any]:
    try:
        return Code.OK, "", fn(req, timeout=timeout)
    except grpc.RpcError as err:
        return err.code(), err.details() or "", None


# Message size ---------------------------------------------------------------------

UNIX_METHODS = [
    "/kvmap.v1.Registry/RegisterWorker", "/kvmap.v1.Registry/DeregisterWorker",
    "/kvmap.v1.RegionMaps/ListWorkers", "/kvmap.v1.RegionMaps/GetRegionMap",
    "/kvmap.v1.RegionMaps/PlanPreview", "/kvmap.v1.Admin/Replan", "/kvmap.v1.Admin/GetStats",
    "/kvmap.v1.Transfers/Release",
]  # fmt: skip
UNIX_STREAMS = ["/kvmap.v1.Registry/Attach", "/kvmap.v1.Transfers/Pull", "/kvmap.v1.Transfers/Push"]
TCP_METHODS = [
    "/kvmap.v1.RegionMaps/ListWorkers", "/kvmap.v1.RegionMaps/GetRegionMap",
    "/kvmap.v1.RegionMaps/PlanPreview", "/kvmap.v1.Peer/GetAgentMetadata",
    "/kvmap.v1.Peer/BeginTransfer", "/kvmap.v1.Peer/EndTransfer",
]  # fmt: skip
# Field 1 as a length-delimited string: a plausible start of every request.
OVERSIZED = b"\x0a" + b"\x80\x80\x80\x08" + b"x" * MAX_MESSAGE_BYTES  # 16 MiB + 5 bytes


def _raw(live: Live, method: str, tcp: bool, stream: bool, data: bytes) -> tuple[Code, str]:
    ch = live.tcp if tcp else live.unix
    try:
        if stream:
            list(ch.unary_stream(method)(data, timeout=60))
        else:
            ch.unary_unary(method)(data, timeout=60)
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
    return Code.OK, ""


@pytest.mark.parametrize(
    ("method", "stream"),
    [(m, False) for m in UNIX_METHODS] + [(m, True) for m in UNIX_STREAMS],
)
def test_a_message_over_16_mib_is_resource_exhausted(c: Cluster, method: str, stream: bool) -> None:
    """A request one past 16 MiB to any method, unary or streaming, on the Unix socket is
    RESOURCE_EXHAUSTED naming the limit, and leaves the daemon's state unchanged and healthy."""
    before = c.d.snapshot()
    code, msg = _raw(c.d, method, False, stream, OVERSIZED)
    assert code is Code.RESOURCE_EXHAUSTED, (code, msg)
    assert str(MAX_MESSAGE_BYTES) in msg, msg
    assert c.d.snapshot() == before
    c.d.assert_healthy()


@pytest.mark.parametrize("method", TCP_METHODS)
def test_a_tcp_request_over_its_methods_limit_is_resource_exhausted(
    c: Cluster, method: str
) -> None:
    """On TCP each kvmap method takes requests up to its own limit (a peer's largest; 352 KiB for
    BeginTransfer and PlanPreview, 64 KiB for the others): one byte more, from an authorized
    peer, is RESOURCE_EXHAUSTED naming that limit, and changes nothing."""
    limit = TCP_REQUEST_LIMITS[method]
    before = c.d.snapshot()
    code, msg = _raw(c.d, method, True, False, _list_workers_of_size(limit + 1))
    assert code is Code.RESOURCE_EXHAUSTED, (code, msg)
    assert str(limit) in msg, msg
    assert c.d.snapshot() == before
    c.d.assert_healthy()


def _list_workers_of_size(n: int) -> bytes:
    """A ListWorkers request of exactly ``n`` bytes: an unknown field 15
    (proto3 keeps and ignores it) holding filler."""
    length = n
    while True:
        data = _field(15, b"x" * length)
        if len(data) == n:
            return data
        length -= len(data) - n


def _field(number: int, payload: bytes) -> bytes:
    out, v = bytearray([number << 3 | 2]), len(payload)
    while v >= 0x80:
        out.append(v & 0x7F | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out) + payload


@pytest.mark.parametrize("tcp", [False, True])
def test_a_message_of_exactly_the_limit_is_accepted(c: Cluster, tcp: bool) -> None:
    """A ListWorkers request of exactly the listener's limit for it (16 MiB on the Unix socket,
    64 KiB on TCP) is served, and one byte more is RESOURCE_EXHAUSTED naming the limit."""
    limit = SMALL_REQUEST_BYTES if tcp else MAX_MESSAGE_BYTES
    data = _list_workers_of_size(limit)
    assert len(data) == limit
    method = "/kvmap.v1.RegionMaps/ListWorkers"
    assert _raw(c.d, method, tcp, False, data) == (Code.OK, "")
    code, msg = _raw(c.d, method, tcp, False, data + b"\0")
    assert code is Code.RESOURCE_EXHAUSTED, (code, msg[:200])
    assert str(limit) in msg, msg


def test_a_rejection_of_a_huge_request_has_a_bounded_message_and_log_line(c: Cluster) -> None:
    """A near-16 MiB request for an unknown worker is answered NOT_FOUND with a message under 4 KiB,
    and grows the daemon's log by less than 64 KiB."""
    req = region_maps_pb2.GetRegionMapRequest(
        worker=types_pb2.WorkerId(engine_id="e" * (MAX_MESSAGE_BYTES - 64))
    )
    log_before = c.d.daemon.log_path.stat().st_size
    code, msg = _raw(
        c.d, "/kvmap.v1.RegionMaps/GetRegionMap", False, False, req.SerializeToString()
    )
    grown = c.d.daemon.log_path.stat().st_size - log_before
    assert grown < 64 * 1024, f"one rejected request grew the daemon's log by {grown} bytes"
    assert code is Code.NOT_FOUND, (code, msg[:200])
    assert len(msg) < 4096


# Views, allocations, blocks -------------------------------------------------------------


def views_request(
    n: int, engine: str = "wide", name_bytes: int = 8, blocks: int = 1
) -> registry_pb2.RegisterWorkerRequest:
    """``n`` adjacent one-byte MLA views side by side in one row of ``n`` bytes."""
    req = registry_pb2.RegisterWorkerRequest(
        worker=types_pb2.WorkerId(engine_id=engine), kv_cache_layout="BLHNC", block_size_tokens=16
    )
    req.allocations.add(
        id="a",
        size_bytes=n * blocks,
        device=types_pb2.Device(type=types_pb2.DEVICE_TYPE_CPU),
        none=types_pb2.NoHandle(),
    )
    for i in range(n):
        req.views.add(
            layer_name=f"{i:0{name_bytes}d}",
            allocation_id="a",
            transfer_group=0,
            cache_kind=types_pb2.CACHE_KIND_MLA,
            dtype="uint8",
            offset_bytes=i,
            block_len_bytes=1,
            block_stride_bytes=n,
            num_blocks=blocks,
        )
    return req


def _with_memory(c: Cluster, req: registry_pb2.RegisterWorkerRequest) -> int:
    """Back the request's allocation with a fresh memfd; returns the fd."""
    fd = sealed_memfd("wide", req.allocations[0].size_bytes)
    token = send_fds(c.d.daemon.socket + ".fds", [fd], 10)
    req.allocations[0].shm_fd.CopyFrom(types_pb2.ShmFdHandle(token=token, index=0))
    return fd


def test_16384_views_plan_and_register_and_16385_are_refused(c: Cluster) -> None:
    """16,384 adjacent views plan into one region and register; 16,385 are INVALID_ARGUMENT naming
    MAX_VIEWS in both PlanPreview and RegisterWorker, and the refused registration changes
    nothing."""
    ok = views_request(MAX_VIEWS)
    code, msg, resp = _code(
        c.d.maps.PlanPreview, region_maps_pb2.PlanPreviewRequest(spec=ok, planner="coalesce")
    )
    assert code is Code.OK, msg
    assert resp.region_map.view_count == MAX_VIEWS
    assert len(resp.region_map.regions) == 1  # all adjacent: one coalesced region

    too_many = views_request(MAX_VIEWS + 1)
    code, msg, _ = _code(c.d.maps.PlanPreview, region_maps_pb2.PlanPreviewRequest(spec=too_many))
    assert code is Code.INVALID_ARGUMENT
    assert msg == f"spec.views: too many ({MAX_VIEWS + 1} > MAX_VIEWS = {MAX_VIEWS})", msg

    before = c.d.snapshot()
    fd = _with_memory(c, too_many)
    try:
        code, msg, _ = _code(c.d.registry.RegisterWorker, too_many)
        assert code is Code.INVALID_ARGUMENT
        assert msg == f"views: too many ({MAX_VIEWS + 1} > MAX_VIEWS = {MAX_VIEWS})", msg
        assert c.d.snapshot() == before

        fd2 = _with_memory(c, ok)
        try:
            code, msg, resp = _code(c.d.registry.RegisterWorker, ok)
            assert code is Code.OK, msg
            assert resp.region_map.view_count == MAX_VIEWS
        finally:
            os.close(fd2)
        c.d.registry.DeregisterWorker(
            registry_pb2.DeregisterWorkerRequest(worker=ok.worker), timeout=30
        )
        assert c.d.snapshot() == before
    finally:
        os.close(fd)


def test_allocations_and_blocks_per_view_limits(c: Cluster) -> None:
    """One allocation past MAX_ALLOCATIONS and one block past MAX_BLOCKS per view are
    INVALID_ARGUMENT naming the limit; exactly MAX_BLOCKS plans."""
    req = views_request(1)
    for i in range(MAX_ALLOCATIONS):
        req.allocations.add(id=f"x{i}", size_bytes=1, none=types_pb2.NoHandle())
    code, msg, _ = _code(c.d.maps.PlanPreview, region_maps_pb2.PlanPreviewRequest(spec=req))
    assert code is Code.INVALID_ARGUMENT
    assert f"({MAX_ALLOCATIONS + 1} > MAX_ALLOCATIONS = {MAX_ALLOCATIONS})" in msg, msg

    req = views_request(1, blocks=MAX_BLOCKS + 1)
    code, msg, _ = _code(c.d.maps.PlanPreview, region_maps_pb2.PlanPreviewRequest(spec=req))
    assert code is Code.INVALID_ARGUMENT
    assert msg == (
        f"spec.views[0].num_blocks: too many blocks ({MAX_BLOCKS + 1} > MAX_BLOCKS = {MAX_BLOCKS})"
    ), msg
    req = views_request(1, blocks=MAX_BLOCKS)
    code, msg, _ = _code(c.d.maps.PlanPreview, region_maps_pb2.PlanPreviewRequest(spec=req))
    assert code is Code.OK, msg


def test_a_region_map_too_big_to_send_is_refused_by_plan_preview(c: Cluster) -> None:
    """Long layer names: the request fits in 16 MiB, its region map (every
    name twice) does not."""
    req = views_request(MAX_VIEWS, name_bytes=600)
    assert req.ByteSize() < MAX_MESSAGE_BYTES
    code, msg, _ = _code(c.d.maps.PlanPreview, region_maps_pb2.PlanPreviewRequest(spec=req))
    assert code is Code.RESOURCE_EXHAUSTED, (code, msg)
    assert str(MAX_MESSAGE_BYTES) in msg, msg
    c.d.assert_healthy()


def test_a_registration_whose_region_map_cannot_be_sent_is_refused_and_changes_nothing(
    c: Cluster,
) -> None:
    """A registration that fits in 16 MiB but whose region map would not is refused
    (INVALID_ARGUMENT or RESOURCE_EXHAUSTED), the worker is not registered and the daemon's state
    is unchanged."""
    req = views_request(MAX_VIEWS, engine="long-names", name_bytes=600)
    before = c.d.snapshot()
    fd = _with_memory(c, req)
    try:
        code, msg, _ = _code(c.d.registry.RegisterWorker, req)
    finally:
        os.close(fd)
    listed = c.d.maps.ListWorkers(region_maps_pb2.ListWorkersRequest(), timeout=10)
    registered = any(w.worker.engine_id == "long-names" for w in listed.workers)
    if registered:  # leave the module's daemon as it was, whatever the outcome
        c.d.registry.DeregisterWorker(
            registry_pb2.DeregisterWorkerRequest(worker=req.worker), timeout=30
        )
    assert code in (Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED), (code, msg)
    assert not registered, f"refused with {code.name} ({msg}) but the worker was registered"
    assert c.d.snapshot() == before


# Blocks per transfer -----------------------------------------------------------------------


def test_65536_blocks_in_one_pull_work_and_65537_are_refused(c: Cluster) -> None:
    """A pull of 65,536 blocks moves the right bytes; 65,537 block pairs across two groups are
    INVALID_ARGUMENT naming the limit for pull and push, and memory is left intact."""
    every = list(range(BLOCKS))
    reverse = every[::-1]
    code, msg = c.transfer(
        c.spec([{"group": 1, "local": every, "remote": reverse}], timeout_ms=120_000),
        write=False,
    )
    assert code is Code.OK, msg
    expect_transfer(c.dw, c.pw, 1, every, reverse)
    c.assert_all_intact(f"after a pull of {BLOCKS} blocks")

    over = [
        {"group": 1, "local": every, "remote": every},
        {"group": 0, "local": [0], "remote": [0]},
    ]
    for write in (False, True):
        code, msg = c.transfer(c.spec(over), write=write)
        assert code is Code.INVALID_ARGUMENT, (code, msg)
        assert msg == f"groups: {BLOCKS + 1} block pairs exceed the limit of {BLOCKS}", msg
        c.assert_all_intact(f"after a refused transfer of {BLOCKS + 1} blocks")


# Outstanding transfers per peer: counted per authenticated peer, not per
# declared agent name, so two peer addresses are needed
# (tests/security/test_peer_identity.py).
