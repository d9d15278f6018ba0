"""Who a peer is, against real daemons (issue 24): a neighbour on the same
host shares loopback, and agent names are only what a caller declares.

- Peer access over TCP rests on the shared peer secret (or mutual TLS): a
  daemon under the default configuration (neither) answers no TCP caller,
  and one with a secret answers no caller without it, so a neighbour learns
  no agent metadata and its own daemon cannot pull.
- Claims, leases and their quotas belong to the authenticated peer. The
  prefill daemon here listens on ``[::]`` so that two peers reach it from
  two addresses: ``127.0.0.1`` (the decode daemon, and the ``c.p.peer``
  stub) and ``::1`` (the stub ``other``), each presenting the secret.
- A lease ends no later than its grant; declared readers are checked against
  the granting worker's TP layout; a readers-0 release needs the prefill
  worker's word (``unread_release``, kept across a restart) and its layout.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from security_support import (
    PAGE,
    Cluster,
    Live,
    ShmWorker,
    expect_transfer,
    start_cluster,
)

from kvmap.client.fd_handoff import credential_metadata
from kvmap.core.peer_policy import INBOUND_DENIED
from kvmap.daemon.engine.leases import MAX_LEASES_PER_PEER
from kvmap.tools.launch import DaemonProc, start_daemon
from kvmap.tools.peers import new_peer_secret, peer_channel
from kvmap.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    peer_pb2,
    peer_pb2_grpc,
    region_maps_pb2,
    region_maps_pb2_grpc,
    registry_pb2,
    registry_pb2_grpc,
    types_pb2,
)

Code = grpc.StatusCode
Call = tuple[Code, str, str]
UNSPECIFIED = registry_pb2.UNREAD_RELEASE_UNSPECIFIED
ALLOWED = registry_pb2.UNREAD_RELEASE_ALLOWED
REFUSED = registry_pb2.UNREAD_RELEASE_REFUSED


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The security cluster, its prefill daemon on ``[::]`` (both loopbacks),
    with two more prefill workers: ranks 0 and 1 of tensor-parallel size 2."""
    yield from start_cluster(tmp_path_factory.mktemp("identity"), prefill_listen="[::]:0")


@pytest.fixture(scope="module")
def ranks(c: Cluster) -> Iterator[tuple[ShmWorker, ShmWorker]]:
    workers = [ShmWorker(c.p, f"prefill-tp{r}", 8, seed=10 + r, tp=(r, 2)) for r in (0, 1)]
    for w in workers:
        w.register()
        w.attach()
    yield workers[0], workers[1]
    for w in workers:
        w.close()


@pytest.fixture(scope="module")
def other(c: Cluster) -> Iterator[peer_pb2_grpc.PeerStub]:
    """A second authorized peer: the secret, from ``::1``."""
    with peer_channel(f"[::1]:{c.p.daemon.tcp_port}", c.p.daemon.secret) as ch:
        yield peer_pb2_grpc.PeerStub(ch)


def agent(role: str) -> str:
    """A fresh agent name (names stay bound to their peer for the module)."""
    return f"kvmapd-{role}-{uuid.uuid4().hex[:8]}"


def leases(c: Cluster) -> int:
    got = admin_pb2_grpc.AdminStub(c.p.unix).GetStats(admin_pb2.GetStatsRequest(), timeout=10)
    return int(got.leases)


def call(method: Any, req: Any) -> Call:
    """(status, details, lease token) of one Peer call."""
    try:
        resp = method(req, timeout=10)
    except grpc.RpcError as err:
        return err.code(), err.details() or "", ""
    return Code.OK, "", getattr(resp, "transfer_token", "")


def announce(
    stub: peer_pb2_grpc.PeerStub, w: ShmWorker, cap: str, peer_agent: str, **kw: Any
) -> Call:
    """BeginTransfer of block 1 of group 0 of ``w`` (``kw`` overrides)."""
    fields: dict[str, Any] = {
        "request_id": "id",
        "worker": w.worker_id,
        "generation": w.region_map.generation if w.region_map else 1,
        "peer_agent": peer_agent,
        "lease_ms": 120_000,
        "blocks": 1,
        "groups": [types_pb2.BlockGrant(transfer_group=0, block_ids=[1])],
        "capability": cap,
    }
    fields.update(kw)
    return call(stub.BeginTransfer, peer_pb2.BeginTransferRequest(**fields))


def release(
    stub: peer_pb2_grpc.PeerStub, w: ShmWorker, cap: str, peer_agent: str, **kw: Any
) -> Call:
    """A release of one use of ``w``'s grant (``kw``: request_id, readers)."""
    req = peer_pb2.BeginTransferRequest(
        worker=w.worker_id, peer_agent=peer_agent, capability=cap, release=True, **kw
    )
    return call(stub.BeginTransfer, req)


def end(stub: peer_pb2_grpc.PeerStub, token: str) -> None:
    assert call(stub.EndTransfer, peer_pb2.EndTransferRequest(transfer_token=token))[0] is Code.OK


def pull(c: Cluster, request_id: str, local: int, remote: int) -> None:
    """A legitimate pull through the decode daemon, every byte checked."""
    groups = [{"group": 0, "local": [local], "remote": [remote]}]
    assert c.transfer(c.spec(groups, request_id=request_id), write=False) == (Code.OK, "")
    expect_transfer(c.dw, c.pw, 0, [local], [remote])
    c.assert_all_intact(f"after pull {request_id}")


# A neighbour without the secret ---------------------------------------------------------


def _refused_everything(target: str, secret: str) -> None:
    """Every Peer and RegionMaps call to ``target`` presenting ``secret`` is
    PERMISSION_DENIED with the one message; health answers."""
    with peer_channel(target, secret) as ch:
        for method, req in (
            (peer_pb2_grpc.PeerStub(ch).GetAgentMetadata, peer_pb2.GetAgentMetadataRequest(
                worker=types_pb2.WorkerId(engine_id="prefill"))),
            (region_maps_pb2_grpc.RegionMapsStub(ch).ListWorkers,
             region_maps_pb2.ListWorkersRequest()),
        ):  # fmt: skip
            code, details, _ = call(method, req)
            assert (code, details) == (Code.PERMISSION_DENIED, INBOUND_DENIED), (secret, details)


def test_under_the_default_configuration_no_tcp_caller_gets_metadata_or_maps(
    tmp_path: Path,
) -> None:
    """A daemon with neither a peer secret file nor mutual TLS (the default) refuses every TCP
    caller of Peer and RegionMaps from 127.0.0.1, whatever secret it presents, while its worker
    is registered and health serves: a local user learns no agent metadata."""
    daemon = start_daemon(tmp_path / "d", "--peer-secret-file", "", name="d")
    live = Live(daemon)
    worker = ShmWorker(live, "prefill", 4, seed=1)
    try:
        worker.register()
        for secret in ("", "guess-" * 8):
            _refused_everything(daemon.tcp_target, secret)
        live.assert_healthy()
        assert "peer_service_closed" in daemon.log()
    finally:
        worker.close()
        live.close()
        daemon.stop()


def test_a_neighbour_without_the_secret_learns_nothing_and_its_daemon_cannot_pull(
    c: Cluster, tmp_path: Path
) -> None:
    """From 127.0.0.1, a caller with no secret or another secret gets PERMISSION_DENIED for
    GetAgentMetadata and RegionMaps; a neighbour's own kvmapd (another secret) pulling with a
    valid capability gets PERMISSION_DENIED and 0 bytes land; the real decode then pulls."""
    for secret in ("", "x" * 43, c.p.daemon.secret[:-1]):
        _refused_everything(c.p.daemon.tcp_target, secret)
    other = start_daemon(
        tmp_path / "n", "--peer-secret-file", str(new_peer_secret(tmp_path)), name="n"
    )
    live = Live(other)
    thief = ShmWorker(live, "decode", 24, seed=5)
    try:
        thief.register()
        thief.attach()
        spec = c.spec([{"group": 0, "local": [3], "remote": [4]}], request_id="neighbour")
        stolen = Cluster(c.p, live, c.pw, thief)
        code, details = stolen.transfer(spec, write=False)
        assert code is Code.PERMISSION_DENIED, details
        thief.assert_intact("after the neighbour's refused pull")
        assert c.transfer(spec, write=False) == (Code.OK, "")  # the grant is intact
        expect_transfer(c.dw, c.pw, 0, [3], [4])
        c.assert_all_intact("after the real pull")
    finally:
        thief.close()
        live.close()
        other.stop()


# Names bound to peers, quotas per peer -----------------------------------------------------


def test_a_peer_cannot_announce_under_an_agent_name_another_peer_holds(
    c: Cluster, other: peer_pb2_grpc.PeerStub
) -> None:
    """Once 127.0.0.1 announced under a name, ::1 announcing under it (with its own valid
    capability) is PERMISSION_DENIED with no lease; under its own name it is served."""
    name = agent("bound")
    code, _, first = announce(
        c.p.peer, c.pw, c.pw.grant("bind-1", {0: [1]}), name, request_id="bind-1"
    )
    assert code is Code.OK
    before = leases(c)
    cap = c.pw.grant("bind-2", {0: [1]})
    code, details, _ = announce(other, c.pw, cap, name, request_id="bind-2")
    assert code is Code.PERMISSION_DENIED, details
    assert leases(c) == before
    code, _, mine = announce(other, c.pw, cap, agent("own"), request_id="bind-2")
    assert code is Code.OK
    end(other, mine)
    end(c.p.peer, first)


def test_leases_are_counted_per_peer_not_per_declared_name(
    c: Cluster, other: peer_pb2_grpc.PeerStub
) -> None:
    """1,024 leases from ::1 under 8 invented names (64 readers of 16 grants) use up that peer's
    quota: a 9th name is RESOURCE_EXHAUSTED naming the peer (an unknown token frees nothing),
    while the decode daemon (127.0.0.1) still pulls; ending one lease admits one more."""
    names = [agent(f"greedy{i}") for i in range(8)]
    tokens: list[str] = []
    try:
        for g in range(MAX_LEASES_PER_PEER // 64):
            cap = c.pw.grant(f"greedy-{g}", {0: [1]}, max_uses=64)
            for _ in range(64):
                code, details, token = announce(
                    other, c.pw, cap, names[g % 8], request_id=f"greedy-{g}"
                )
                assert code is Code.OK, (len(tokens), details)
                tokens.append(token)
        cap = c.pw.grant("greedy-x", {0: [1]})
        code, details, _ = announce(other, c.pw, cap, agent("ninth"), request_id="greedy-x")
        assert code is Code.RESOURCE_EXHAUSTED, details
        assert details == f"peer ::1 has {MAX_LEASES_PER_PEER} transfers outstanding (the limit)"
        end(other, "0" * 32)  # an unknown token frees nothing
        assert announce(other, c.pw, cap, agent("ninth"), request_id="greedy-x")[0] is (
            Code.RESOURCE_EXHAUSTED
        )
        pull(c, "not-greedy", 9, 10)
        end(other, tokens.pop())
        code, _, token = announce(other, c.pw, cap, agent("ninth"), request_id="greedy-x")
        assert code is Code.OK
        tokens.append(token)
    finally:
        for token in tokens:
            end(other, token)
    assert leases(c) == 0


def test_only_the_claims_peer_can_end_release_or_take_it_over(
    c: Cluster, other: peer_pb2_grpc.PeerStub
) -> None:
    """While 127.0.0.1 holds a claim, ::1 holding the same capability and the lease's token
    cannot end the lease (answered as an unknown token), take the claim over by naming the
    holder in replaces_agents, or release a use under its own or the holder's name: all leave
    the lease. The holder's own EndTransfer frees it, and ::1 may then claim."""
    holder = agent("holder")
    # Two uses: a use is left to release, so only the claim stands in the way.
    cap = c.pw.grant("claim", {0: [1]}, max_uses=2)
    code, _, token = announce(c.p.peer, c.pw, cap, holder, request_id="claim")
    assert code is Code.OK
    held = leases(c)
    end(other, token)
    assert leases(c) == held
    thief = agent("thief")
    code, details, _ = announce(
        other, c.pw, cap, thief, request_id="claim", replaces_agents=[holder]
    )
    assert code is Code.PERMISSION_DENIED, details
    for name in (thief, holder):
        code, details, _ = release(other, c.pw, cap, name, request_id="claim", readers=2)
        assert code is Code.PERMISSION_DENIED, (name, details)
    assert leases(c) == held
    end(c.p.peer, token)
    assert leases(c) == held - 1
    code, _, mine = announce(other, c.pw, cap, thief, request_id="claim")
    assert code is Code.OK
    end(other, mine)


# Leases, readers, releases -------------------------------------------------------------------


def test_no_lease_outlives_its_grant(c: Cluster, other: peer_pb2_grpc.PeerStub) -> None:
    """A lease asked for 600 s under a grant that expires in 1.5 s ends with the grant (the
    owner's lease sweep frees it within seconds, not minutes)."""
    before = leases(c)
    cap = c.pw.grant("short", {0: [1]}, ttl_ms=1500)
    code, _, _ = announce(other, c.pw, cap, agent("long"), request_id="short", lease_ms=600_000)
    assert code is Code.OK
    assert leases(c) == before + 1
    deadline = time.monotonic() + 15
    while leases(c) > before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leases(c) == before, "the lease outlived its grant"


def test_a_first_claim_declaring_more_readers_than_the_layout_has_is_refused(
    c: Cluster, ranks: tuple[ShmWorker, ShmWorker], other: peer_pb2_grpc.PeerStub
) -> None:
    """An open grant of rank 0 of TP 2 is read by at most 32 decode ranks (64 over 2): a first
    claim declaring 64 is FAILED_PRECONDITION with no lease and the count still open; one
    declaring 32 fixes it."""
    w = ranks[0]
    before = leases(c)
    cap = w.grant("readers", {0: [1]}, open_uses=True)
    code, details, _ = announce(other, w, cap, agent("many"), request_id="readers", readers=64)
    assert (code, "read by at most 32 decode ranks" in details) == (
        Code.FAILED_PRECONDITION, True
    ), details  # fmt: skip
    assert leases(c) == before
    code, _, token = announce(other, w, cap, agent("fair"), request_id="readers", readers=32)
    assert code is Code.OK
    end(other, token)


@pytest.mark.parametrize("word", [UNSPECIFIED, ALLOWED], ids=["unspecified", "allowed"])
def test_a_decode_cannot_burn_an_open_grant_of_a_rank_every_decode_reads(
    c: Cluster,
    ranks: tuple[ShmWorker, ShmWorker],
    other: peer_pb2_grpc.PeerStub,
    word: registry_pb2.UnreadRelease.ValueType,
) -> None:
    """A readers-0 release of an open grant of rank 0 (every decode engine reads it) is
    FAILED_PRECONDITION and the grant stays usable, even when its worker said ALLOWED (both
    words must agree); of rank 1 of a replicated TP-2 cache (a TP-1 decode reads it not at
    all) it uses the grant up, as the decode connector does, when the worker said ALLOWED or
    nothing (a connector that predates the field: the layout decides, as before)."""
    first, second = ranks
    request = f"unread-{word}"
    cap = first.grant(request, {0: [1]}, open_uses=True, unread_release=word)
    code, details, _ = release(other, first, cap, agent("burn"), request_id=request, readers=0)
    assert code is Code.FAILED_PRECONDITION and "read by every decode engine" in details, details
    code, _, token = announce(other, first, cap, agent("reader"), request_id=request, readers=1)
    assert code is Code.OK
    end(other, token)
    cap = second.grant(request, {0: [1]}, open_uses=True, unread_release=word)
    name = agent("unread")
    assert release(other, second, cap, name, request_id=request, readers=0)[0] is Code.OK
    code, details, _ = release(other, second, cap, name, request_id=request, readers=0)
    assert code is Code.PERMISSION_DENIED, details  # used up


def test_a_grant_its_worker_said_every_decode_reads_cannot_be_burned_unread(
    c: Cluster, ranks: tuple[ShmWorker, ShmWorker], other: peer_pb2_grpc.PeerStub
) -> None:
    """Rank 1 of a replicated TP-2 cache, whose layout lets it go unread, granted with
    REFUSED (its connector knows every decode reads it): a capability holder's readers-0
    release is FAILED_PRECONDITION naming the worker's word, spends nothing and takes no
    lease; the decode daemon's pull then reads the granted block, every byte checked."""
    second = ranks[1]
    before = leases(c)
    cap = second.grant("refused", {0: [2]}, open_uses=True, unread_release=REFUSED)
    code, details, _ = release(other, second, cap, agent("burn"), request_id="refused", readers=0)
    assert (code, "its worker said every decode engine reads it" in details) == (
        Code.FAILED_PRECONDITION, True
    ), details  # fmt: skip
    assert leases(c) == before
    groups = [{"group": 0, "local": [5], "remote": [2]}]
    spec = c.spec(groups, request_id="refused", remote_engine=second.engine_id, capability=cap)
    spec.remote_worker.tp_rank = second.tp_rank
    assert c.transfer(spec, write=False) == (Code.OK, "")
    expect_transfer(c.dw, second, 0, [5], [2])
    c.dw.assert_intact("after the pull of a grant that refused an unread release")


def test_the_workers_word_on_unread_releases_survives_a_restart(tmp_path: Path) -> None:
    """Rank 1 of a replicated TP-2 cache (a path registration, restored from the state dir)
    grants one open grant with REFUSED and one with ALLOWED; after the daemon stops (SIGTERM)
    and restarts on the same state dir, a readers-0 release of the REFUSED one is still
    FAILED_PRECONDITION and of the ALLOWED one uses it up."""
    kv_file = tmp_path / "kv.bin"
    kv_file.write_bytes(bytes(4 * PAGE))
    flags = ("--state-dir", str(tmp_path / "state"), "--shm-path-prefix", str(tmp_path))
    caps = _grant_each_word_then_stop(start_daemon(tmp_path / "p", *flags, name="p"), kv_file)
    again = start_daemon(tmp_path / "p", *flags, name="p")
    try:
        with peer_channel(again.tcp_target, again.secret) as ch:
            stub = peer_pb2_grpc.PeerStub(ch)
            for word, want in ((REFUSED, Code.FAILED_PRECONDITION), (ALLOWED, Code.OK)):
                req = peer_pb2.BeginTransferRequest(
                    worker=RANK1, peer_agent=agent("late"), capability=caps[word],
                    release=True, request_id=f"word-{word}", readers=0,
                )  # fmt: skip
                code, details, _ = call(stub.BeginTransfer, req)
                assert code is want, (word, details)
    finally:
        assert again.terminate() == 0, again.log()[-4000:]


RANK1 = types_pb2.WorkerId(engine_id="restored", tp_rank=1)


def _grant_each_word_then_stop(daemon: DaemonProc, kv_file: Path) -> dict[int, str]:
    """Register ``RANK1`` over ``kv_file``, attach it, grant block 1 open, once with REFUSED
    and once with ALLOWED, and stop the daemon (SIGTERM) while the worker is still attached
    (an Attach stream that ends means the worker is gone, and its grants with it): the
    capability of each."""
    caps = {}
    try:
        with daemon.channel() as ch:
            registry = registry_pb2_grpc.RegistryStub(ch)
            me = credential_metadata(daemon.socket)
            registry.RegisterWorker(_path_registration(kv_file), timeout=10, metadata=me)
            attach = registry.Attach(registry_pb2.AttachRequest(worker=RANK1), metadata=me)
            assert next(attach).HasField("attached")
            for word in (REFUSED, ALLOWED):
                caps[word] = registry.GrantTransfer(
                    registry_pb2.GrantTransferRequest(
                        worker=RANK1, request_id=f"word-{word}", unread_release=word,
                        open_uses=True,
                        groups=[types_pb2.BlockGrant(transfer_group=0, block_ids=[1])],
                    ),
                    timeout=10, metadata=me,
                ).capability  # fmt: skip
            assert daemon.terminate() == 0, daemon.log()[-4000:]
            attach.cancel()
    finally:
        daemon.stop()  # (a no-op once it exited)
    return caps


def _path_registration(kv_file: Path) -> registry_pb2.RegisterWorkerRequest:
    """Rank 1 of TP 2 with one MLA layer of 4 one-page blocks in ``kv_file``: a path, which
    a restarted daemon maps again (a memfd would be gone)."""
    req = registry_pb2.RegisterWorkerRequest(
        worker=RANK1, kv_cache_layout="BLHNC", block_size_tokens=16, tp_size=2
    )
    req.allocations.add(
        id="kv", size_bytes=4 * PAGE, shm_path=types_pb2.ShmPathHandle(path=str(kv_file))
    )
    req.views.add(
        layer_name="model.layers.0.self_attn.attn", allocation_id="kv", transfer_group=0,
        cache_kind=types_pb2.CACHE_KIND_MLA, dtype="uint8", block_len_bytes=PAGE,
        block_stride_bytes=PAGE, num_blocks=4,
    )  # fmt: skip
    return req
