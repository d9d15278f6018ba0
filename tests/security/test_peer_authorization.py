"""Who may talk to a daemon, and whom a daemon dials (the data plane).

NIXL READs need no lease: whoever gets a daemon's agent metadata can read all
the memory it registered, and RegionMaps tells where that memory is. So on
TCP, Peer and RegionMaps answer only authorized peers (by source address, or
by certificate identity under mutual TLS), and a daemon dials only the peers
its ``peer_allow`` lists, refusing anything else before any connection with
one message (no port-scanner oracle). Real daemons, real certificates, 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pki import Ca, Leaf, spiffe

from kvmap.core.peer_policy import INBOUND_DENIED, OUTBOUND_DENIED
from kvmap.tools.launch import DaemonProc, WorkerProc, start_daemon, start_worker
from kvmap.v1 import (
    peer_pb2,
    peer_pb2_grpc,
    region_maps_pb2,
    region_maps_pb2_grpc,
    transfers_pb2,
    transfers_pb2_grpc,
    types_pb2,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

Code = grpc.StatusCode
GEO = ("--blocks", "16", "--block-tokens", "32", "--mla-layers", "3", "--indexer-layers", "1")
TIMEOUT_S = 20


@contextlib.contextmanager
def daemon_with_worker(workdir: Path, engine_id: str, *args: str) -> Iterator[DaemonProc]:
    daemon = start_daemon(workdir, *args, name=engine_id)
    worker: WorkerProc | None = None
    try:
        worker = start_worker(daemon, engine_id, *GEO)
        yield daemon
    finally:
        if worker is not None:
            worker.stop()
        assert daemon.terminate() == 0, daemon.log()


def peer_calls(channel: grpc.Channel, engine_id: str) -> dict[str, tuple[Code, str]]:
    """Every Peer and RegionMaps RPC once, with what it answered (OK or the status)."""
    peer = peer_pb2_grpc.PeerStub(channel)
    maps = region_maps_pb2_grpc.RegionMapsStub(channel)
    worker = types_pb2.WorkerId(engine_id=engine_id)
    calls = {
        "GetAgentMetadata": lambda: peer.GetAgentMetadata(
            peer_pb2.GetAgentMetadataRequest(worker=worker), timeout=TIMEOUT_S
        ),
        "BeginTransfer": lambda: peer.BeginTransfer(
            peer_pb2.BeginTransferRequest(worker=worker, request_id="r", capability="x"),
            timeout=TIMEOUT_S,
        ),
        "EndTransfer": lambda: peer.EndTransfer(
            peer_pb2.EndTransferRequest(transfer_token="t"), timeout=TIMEOUT_S
        ),
        # A push offer would reach the engine's workers (push mode).
        "OfferPush": lambda: peer.OfferPush(
            peer_pb2.PeerOfferPushRequest(
                offer=types_pb2.PushOffer(push_id="p" * 24, prefill_engine_id=engine_id)
            ),
            timeout=TIMEOUT_S,
        ),
        "ListWorkers": lambda: maps.ListWorkers(
            region_maps_pb2.ListWorkersRequest(), timeout=TIMEOUT_S
        ),
        "GetRegionMap": lambda: maps.GetRegionMap(
            region_maps_pb2.GetRegionMapRequest(worker=worker), timeout=TIMEOUT_S
        ),
    }
    answers = {}
    for name, call in calls.items():
        try:
            call()
            answers[name] = (Code.OK, "")
        except grpc.RpcError as err:
            answers[name] = (err.code(), err.details() or "")
    return answers


def health(channel: grpc.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S).status


def test_a_stranger_address_learns_nothing_on_tcp(tmp_path: Path) -> None:
    """Pins inbound authorization by source address: a daemon accepting only 127.0.0.2 refuses
    a 127.0.0.1 client every Peer and RegionMaps RPC with PERMISSION_DENIED and one message
    (no worker names, no metadata), while health stays open and the Unix socket still lists
    the worker. A daemon accepting 127.0.0.1 answers the same client the same calls."""
    rpcs = (
        "GetAgentMetadata",
        "BeginTransfer",
        "EndTransfer",
        "OfferPush",
        "ListWorkers",
        "GetRegionMap",
    )
    refused = {name: (Code.PERMISSION_DENIED, INBOUND_DENIED) for name in rpcs}
    with daemon_with_worker(tmp_path / "p", "prefill", "--peer-accept", "127.0.0.2/32") as p:
        with p.channel(tcp=True) as ch:
            assert peer_calls(ch, "prefill") == refused
            assert health(ch) == health_pb2.HealthCheckResponse.SERVING
        with p.channel() as ch:
            listed = region_maps_pb2_grpc.RegionMapsStub(ch).ListWorkers(
                region_maps_pb2.ListWorkersRequest(), timeout=TIMEOUT_S
            )
        assert [w.worker.engine_id for w in listed.workers] == ["prefill"]
    with (
        daemon_with_worker(tmp_path / "q", "open", "--peer-accept", "127.0.0.1/32") as q,
        q.channel(tcp=True) as ch,
    ):
        answers = peer_calls(ch, "open")
        meta = peer_pb2_grpc.PeerStub(ch).GetAgentMetadata(
            peer_pb2.GetAgentMetadataRequest(worker=types_pb2.WorkerId(engine_id="open")),
            timeout=TIMEOUT_S,
        )
    assert answers["ListWorkers"] == (Code.OK, "") and answers["GetRegionMap"] == (Code.OK, "")
    assert meta.agent_metadata and meta.agent_name
    assert all(code is not Code.PERMISSION_DENIED or msg != INBOUND_DENIED
               for code, msg in answers.values()), answers  # fmt: skip


def test_mutual_tls_authorizes_by_identity_not_by_ca(tmp_path: Path) -> None:
    """Pins inbound authorization by certificate identity: under mutual TLS a certificate from
    the right CA whose SANs (a SPIFFE ID and a DNS name) are not listed gets PERMISSION_DENIED on
    every Peer/RegionMaps RPC; one with a listed SPIFFE ID gets the agent metadata; a plaintext
    client gets nothing at all. A daemon with mutual TLS and no identities refuses to start."""
    ca = Ca(tmp_path / "pki")
    server = ca.issue("prefill", uris=(spiffe("prefill"),))
    decode = ca.issue("decode", uris=(spiffe("decode"),))
    stranger = ca.issue("stranger", uris=(spiffe("stranger"),), dns=("decode.kvmap.test",))
    args = ca.daemon_args(server, spiffe("decode"))
    with daemon_with_worker(tmp_path / "p", "prefill", *args) as p:

        def over(leaf: Leaf) -> dict[str, tuple[Code, str]]:
            key, chain = leaf.pem()
            creds = grpc.ssl_channel_credentials(ca.path.read_bytes(), key, chain)
            with grpc.secure_channel(p.tcp_target, creds) as ch:
                return peer_calls(ch, "prefill")

        denied = over(stranger)
        allowed = over(decode)
        with grpc.insecure_channel(p.tcp_target) as ch, pytest.raises(grpc.RpcError):
            health(ch)
    assert set(denied.values()) == {(Code.PERMISSION_DENIED, INBOUND_DENIED)}, denied
    assert allowed["GetAgentMetadata"] == (Code.OK, ""), allowed
    assert allowed["ListWorkers"] == (Code.OK, ""), allowed

    with pytest.raises(AssertionError, match="tls_client_ca needs peer_identities"):
        start_daemon(tmp_path / "n", *ca.daemon_args(server), name="no-identities")


def pull(daemon: DaemonProc, target: str) -> tuple[Code, str]:
    """A Pull on the decode daemon's Unix socket towards ``target``."""
    spec = transfers_pb2.TransferSpec(
        request_id="probe",
        local_worker=types_pb2.WorkerId(engine_id="decode"),
        remote_target=target,
        remote_worker=types_pb2.WorkerId(engine_id="prefill"),
        groups=[
            transfers_pb2.GroupBlocks(transfer_group=0, local_block_ids=[1], remote_block_ids=[9])
        ],
        capability="attacker-chosen",
        timeout_ms=5000,
    )
    with daemon.channel() as ch:
        try:
            list(transfers_pb2_grpc.TransfersStub(ch).Pull(
                transfers_pb2.PullRequest(spec=spec), timeout=TIMEOUT_S))  # fmt: skip
        except grpc.RpcError as err:
            return err.code(), err.details() or ""
    return Code.OK, ""


@contextlib.contextmanager
def listener(silent: bool) -> Iterator[tuple[socket.socket, int]]:
    """A TCP port on 127.0.0.1: listening (and never answering) or closed."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    if silent:
        sock.listen(16)
        sock.setblocking(False)
    try:
        yield sock, port
    finally:
        sock.close()


def test_a_daemon_dials_only_allowed_peers_and_says_one_thing(tmp_path: Path) -> None:
    """Pins the outbound allow-list: with peer_allow 10.0.0.0/8, pulls towards a silent
    listener, a closed port, localhost and an unresolvable name all get PERMISSION_DENIED with
    the same message, and the listener sees no connection (its accept() finds nothing). The
    same pull from a daemon allowing loopback reaches the listener (so this test fails if the
    check is removed)."""
    with (
        daemon_with_worker(tmp_path / "d", "decode", "--peer-allow", "10.0.0.0/8") as d,
        listener(silent=True) as (silent, silent_port),
        listener(silent=False) as (_, closed_port),
    ):
        targets = [
            f"127.0.0.1:{silent_port}",
            f"127.0.0.1:{closed_port}",
            f"localhost:{silent_port}",
            "not-allowed.invalid:50051",
            f"[::1]:{silent_port}",
        ]
        answers = {target: pull(d, target) for target in targets}
        with pytest.raises(BlockingIOError):
            silent.accept()
    assert set(answers.values()) == {(Code.PERMISSION_DENIED, OUTBOUND_DENIED)}, answers

    with (
        daemon_with_worker(tmp_path / "e", "decode") as e,
        listener(silent=True) as (silent, silent_port),
    ):
        code, _ = pull(e, f"127.0.0.1:{silent_port}")
        conn, _ = silent.accept()  # the default (loopback) lets the dial through
        conn.close()
    assert code is not Code.PERMISSION_DENIED


def test_mutual_tls_dials_only_listed_server_identities(tmp_path: Path) -> None:
    """Pins the outbound identity check: a decode daemon whose peer_identities list only
    another server's SPIFFE ID refuses to use a prefill daemon whose certificate (same CA,
    valid for 127.0.0.1) names itself, with the one outbound message; listing the prefill's
    ID lets the pull past the handshake (the prefill then judges the capability)."""
    ca = Ca(tmp_path / "pki")
    prefill_leaf = ca.issue("prefill", uris=(spiffe("prefill"),))
    decode_leaf = ca.issue("decode", uris=(spiffe("decode"),))
    with daemon_with_worker(
        tmp_path / "p", "prefill", *ca.daemon_args(prefill_leaf, spiffe("decode"))
    ) as p:
        with daemon_with_worker(
            tmp_path / "d", "decode", *ca.daemon_args(decode_leaf, spiffe("other-prefill"))
        ) as d:
            wrong = pull(d, p.tcp_target)
        with daemon_with_worker(
            tmp_path / "e", "decode", *ca.daemon_args(decode_leaf, spiffe("prefill"))
        ) as e:
            right = pull(e, p.tcp_target)
    assert wrong == (Code.PERMISSION_DENIED, OUTBOUND_DENIED)
    assert right != wrong and OUTBOUND_DENIED not in right[1] and INBOUND_DENIED not in right[1]
