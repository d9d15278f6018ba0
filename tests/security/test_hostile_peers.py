"""What a hostile or lying peer can and cannot do.

The decode daemon never takes a region map on trust from its caller: it
fetches it from the remote daemon's Peer port itself. But the remote daemon
may lie (compromised, or a fake that a local worker points the daemon at).
A fake Peer server here proxies the real prefill daemon and tampers with
what it answers: sizes, block counts, addresses, agent names. Whatever it
claims, no byte of the decode worker outside the requested blocks and
layers changes, and no byte of the prefill worker changes on a pull.

A stranger with its own NIXL agent (``nixl_attacker.py``) who loads the
prefill daemon's agent metadata cannot touch a byte outside the registered
allocations: NIXL refuses every descriptor that is not inside one. That
check runs in the *initiator's* NIXL library, so it binds every NIXL peer
(a kvmapd fed a corrupt map included), not a hand-made UCX client; inside
the registrations NIXL cannot tell a stranger from a peer at all. What
protects registered memory from strangers is access to the Peer port (the
metadata carries the UCX address and memory keys) and to UCX's listener.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from security_support import Cluster, expect_transfer, start_cluster

from kvmap.tools.launch import DaemonProc, local_env
from kvmap.v1 import peer_pb2, peer_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

Code = grpc.StatusCode
Tamper = Callable[[peer_pb2.GetAgentMetadataResponse], None]


class FakePeer(peer_pb2_grpc.PeerServicer):
    """A Peer server that answers with the real prefill daemon's answers,
    after ``tamper`` has edited the handshake."""

    def __init__(self, real: DaemonProc, tamper: Tamper) -> None:
        # It holds the peer secret: a peer that is authorized and lies.
        self.channel = real.channel(tcp=True)
        self.real = peer_pb2_grpc.PeerStub(self.channel)
        self.tamper = tamper
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        peer_pb2_grpc.add_PeerServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop(0)
        self.channel.close()

    def GetAgentMetadata(  # noqa: N802
        self, request: peer_pb2.GetAgentMetadataRequest, context: grpc.ServicerContext
    ) -> peer_pb2.GetAgentMetadataResponse:
        resp = self.real.GetAgentMetadata(request, timeout=10)
        self.tamper(resp)
        return resp

    def BeginTransfer(  # noqa: N802
        self, request: peer_pb2.BeginTransferRequest, context: grpc.ServicerContext
    ) -> peer_pb2.BeginTransferResponse:
        try:
            return self.real.BeginTransfer(request, timeout=10)
        except grpc.RpcError as err:
            context.abort(err.code(), err.details() or "")
            raise

    def EndTransfer(  # noqa: N802
        self, request: peer_pb2.EndTransferRequest, context: grpc.ServicerContext
    ) -> peer_pb2.EndTransferResponse:
        return self.real.EndTransfer(request, timeout=10)


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from start_cluster(tmp_path_factory.mktemp("hostile"))


@pytest.fixture
def fake(c: Cluster) -> Iterator[Callable[[Tamper], FakePeer]]:
    made: list[FakePeer] = []

    def make(tamper: Tamper) -> FakePeer:
        made.append(FakePeer(c.p.daemon, tamper))
        return made[-1]

    yield make
    for f in made:
        f.stop()


# Lies about the prefill worker's map (group 0: one coalesced region of three
# 64-byte layers at row offset 16, stride 240, 32 blocks, in allocation g0).


def longer_layers(r: peer_pb2.GetAgentMetadataResponse) -> None:
    """Self-consistent, but every MLA layer is twice as long as decode's."""
    m = r.region_map
    region = m.regions[0]
    for i, layer in enumerate(region.layers):
        layer.len_bytes = 128
        layer.offset_in_region_bytes = 128 * i
    region.block_len_bytes = region.block_stride_bytes = 384
    region.full_row = True
    region.offset_bytes = 0
    m.allocations[0].size_bytes = 384 * region.num_blocks


def more_blocks(r: peer_pb2.GetAgentMetadataResponse) -> None:
    """Self-consistent, but claims 4096 blocks where 32 are registered."""
    m = r.region_map
    extra = 4096 - m.regions[0].num_blocks
    m.regions[0].num_blocks = 4096
    m.descriptor_count += extra
    m.allocations[0].size_bytes = 4096 * m.regions[0].block_stride_bytes


def moved_past_end(r: peer_pb2.GetAgentMetadataResponse) -> None:
    a = r.region_map.allocations[0]
    a.base_address += a.size_bytes


def moved_before_start(r: peer_pb2.GetAgentMetadataResponse) -> None:
    r.region_map.allocations[0].base_address -= 4096


def moved_onto_other_allocation(r: peer_pb2.GetAgentMetadataResponse) -> None:
    """Group 0 claims to live where group 1's (smaller) allocation is."""
    allocs = r.region_map.allocations
    allocs[0].base_address = allocs[1].base_address


def inconsistent(r: peer_pb2.GetAgentMetadataResponse) -> None:
    """Blocks that do not fit the allocation the map itself declares."""
    r.region_map.regions[0].num_blocks = 1 << 20


def region_over_padding(r: peer_pb2.GetAgentMetadataResponse) -> None:
    """Self-consistent, and inside the registration: the layers start at the
    row's first (padding) byte instead of byte 16."""
    r.region_map.regions[0].offset_bytes = 0


REFUSED_LIES: dict[str, Tamper] = {
    "layers longer than decode's": longer_layers,
    "more blocks than registered": more_blocks,
    "allocation moved past its registration": moved_past_end,
    "allocation moved before its registration": moved_before_start,
    "allocation moved onto a smaller registration": moved_onto_other_allocation,
    "blocks outside the declared allocation": inconsistent,
}


@pytest.mark.parametrize("lie", list(REFUSED_LIES))
@pytest.mark.parametrize("remote_ids", [[1, 2], [31, 0], [4000, 5]])
def test_a_lying_peer_map_is_refused_and_nothing_is_written(
    c: Cluster, fake: Callable[[Tamper], FakePeer], lie: str, remote_ids: list[int]
) -> None:
    """A peer whose map lies about layer lengths, block counts or allocation addresses is refused
    for both pull and push, whatever block ids are asked, and no byte of either worker nor either
    daemon's state changes. (Ids the real owner does not have, e.g. 4000, are outside any grant
    it can give: its BeginTransfer refuses them with PERMISSION_DENIED if the decode daemon,
    misled by the lie, got that far.)"""
    f = fake(REFUSED_LIES[lie])
    before = (c.p.snapshot(), c.d.snapshot())
    refused = (Code.FAILED_PRECONDITION, Code.NOT_FOUND, Code.INVALID_ARGUMENT)
    if max(remote_ids) >= c.pw.blocks:
        refused = (*refused, Code.PERMISSION_DENIED)
    spec = c.spec([{"group": 0, "local": [3, 4], "remote": remote_ids}], target=f.target)
    got, msg = c.transfer(spec, write=False)
    assert got in refused, (got, msg)
    c.assert_all_intact(f"after a pull against a peer lying with {lie}")
    # A push against the liar must not write the prefill worker either.
    spec = c.spec(
        [{"group": 0, "local": [3, 4], "remote": remote_ids}], target=f.target, write=True
    )
    got, msg = c.transfer(spec, write=True)
    assert got in refused, (got, msg)
    c.assert_all_intact(f"after a push against a peer lying with {lie}")
    assert (c.p.snapshot(), c.d.snapshot()) == before
    c.d.assert_healthy()


def test_a_lying_peer_chooses_which_of_its_bytes_arrive_never_where_they_land(
    c: Cluster, fake: Callable[[Tamper], FakePeer]
) -> None:
    """A map that stays inside the liar's own registration can make the pull
    read other bytes of that registration (here: from the row's padding), and
    they land exactly in the requested decode blocks and layers, nowhere else."""
    f = fake(region_over_padding)
    local, remote = [7, 8, 20], [0, 9, 31]
    got, msg = c.transfer(
        c.spec([{"group": 0, "local": local, "remote": remote, "layers": ["m0"]}], target=f.target),
        write=False,
    )
    assert got is Code.OK, msg
    for lb, rb in zip(local, remote, strict=True):
        start = c.pw.offsets[0] + rb * 240  # the row's first byte: padding, not m0
        c.dw.expected[c.dw.span(0, lb, "m0")] = c.pw.buf[start : start + 64]
    c.assert_all_intact("after a pull against a peer lying inside its registration")


def test_a_peer_passing_off_the_decode_daemon_as_itself_is_refused(
    c: Cluster, fake: Callable[[Tamper], FakePeer]
) -> None:
    """The fake answers with the decode daemon's own agent and decode's own
    map: the decode daemon must not copy between its own registrations."""
    own = c.d.peer.GetAgentMetadata(
        peer_pb2.GetAgentMetadataRequest(worker=c.dw.worker_id), timeout=10
    )

    def as_decode(r: peer_pb2.GetAgentMetadataResponse) -> None:
        r.CopyFrom(own)
        r.region_map.worker.engine_id = "prefill"

    f = fake(as_decode)
    spec = c.spec([{"group": 0, "local": [1, 2], "remote": [3, 4]}], target=f.target)
    for write in (False, True):
        got, msg = c.transfer(spec, write=write)
        assert got in (Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION, Code.NOT_FOUND), msg
        c.assert_all_intact("after a transfer against a peer claiming to be decode itself")


def test_a_peer_claiming_addresses_of_another_process_is_refused(
    c: Cluster, fake: Callable[[Tamper], FakePeer]
) -> None:
    """The prefill agent, with the decode worker's map (real, registered
    addresses, but in the decode process)."""
    decode_map = c.d.peer.GetAgentMetadata(
        peer_pb2.GetAgentMetadataRequest(worker=c.dw.worker_id), timeout=10
    ).region_map

    def decode_addresses(r: peer_pb2.GetAgentMetadataResponse) -> None:
        for mine, theirs in zip(r.region_map.allocations, decode_map.allocations, strict=True):
            mine.base_address = theirs.base_address
            mine.size_bytes = max(mine.size_bytes, theirs.size_bytes)

    f = fake(decode_addresses)
    spec = c.spec([{"group": 0, "local": [1, 2], "remote": [3, 4]}], target=f.target)
    for write in (False, True):
        got, msg = c.transfer(spec, write=write)
        assert got in (Code.FAILED_PRECONDITION, Code.NOT_FOUND, Code.INVALID_ARGUMENT), msg
        c.assert_all_intact("after a transfer against a peer claiming decode's addresses")


# A peer that borrows a real daemon's agent name -------------------------------------


def test_a_peer_borrowing_a_real_agent_name_cannot_cut_off_the_real_peer(
    tmp_path: Path,
) -> None:
    """A fake peer that first proxies the real prefill daemon and then changes its agent name is
    refused, and pulls straight from the real prefill daemon keep working afterwards."""
    gen = start_cluster(tmp_path)
    c = next(gen)
    mode: dict[str, int | str] = {}

    def borrow_then_change(r: peer_pb2.GetAgentMetadataResponse) -> None:
        if mode:
            r.agent_name = str(mode["name"])
            r.generation = r.region_map.generation = int(mode["generation"])

    f = FakePeer(c.p.daemon, borrow_then_change)
    try:
        g = [{"group": 0, "local": [1, 2], "remote": [3, 4]}]
        assert c.transfer(c.spec(g), write=False)[0] is Code.OK
        assert c.transfer(c.spec(g, target=f.target), write=False)[0] is Code.OK
        mode.update(name="kvmapd-evil", generation=7)
        got, _ = c.transfer(c.spec(g, target=f.target, remote_generation=7), write=False)
        assert got is not Code.OK
        expect_transfer(c.dw, c.pw, 0, [1, 2], [3, 4])
        c.assert_all_intact("after the fake peer changed its agent name")
        # The real prefill daemon did nothing wrong: pulls from it still work.
        got, msg = c.transfer(c.spec([{"group": 0, "local": [5], "remote": [6]}]), write=False)
        assert got is Code.OK, msg
    finally:
        f.stop()
        gen.close()


# A stranger with its own NIXL agent ---------------------------------------------------


def test_a_stranger_with_the_agent_metadata_cannot_touch_bytes_outside_registrations(
    c: Cluster, tmp_path: Path
) -> None:
    """A compromised peer's own NIXL agent (it holds the peer secret) loaded with the prefill
    daemon's metadata can transfer inside the registrations (the control) but every attempt
    outside them fails, and prefill's memory and state stay unchanged."""
    before = c.p.snapshot()
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("nixl_attacker.py")),
         c.p.daemon.tcp_target, "prefill", c.p.daemon.secret],
        capture_output=True, text=True, timeout=120, env=local_env(tmp_path), check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])["results"]
    for label, outcome in results.items():
        if "(control)" in label:
            # Inside a registration NIXL cannot tell a stranger from a peer:
            # the Peer port (and so the metadata) is what must be protected.
            assert outcome == "DONE", (label, outcome)
        else:
            assert outcome != "DONE", f"{label}: the stranger's transfer went through"
    c.assert_all_intact("after a stranger's NIXL agent tried to write around the registrations")
    assert c.p.snapshot() == before
    c.p.assert_healthy()
