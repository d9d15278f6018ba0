"""Socket-group members acting as a worker (issue 24), against real `kvmapd serve` processes:
memory that could shrink under the daemon is refused (a truncation would kill it with SIGBUS),
and a flood of pending fds from one uid is bounded and does not lock the other uids out (the
flooding member is a forked child running as another uid in the socket's group: needs root).
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvmap.client.client import KvmapClient
from kvmap.client.fd_handoff import (
    PEER_TOKEN_METADATA,
    credential_metadata,
    sealed_memfd,
    send_credentials,
    send_fds,
)
from kvmap.client.transports.local_calls import (
    ATTACH_FIELD,
    GRANT_FIELD,
    REVOKE_FIELD,
    call_bytes,
)
from kvmap.core.config import LOCAL_CALLS_SUFFIX
from kvmap.core.errors import ResourceExhausted
from kvmap.tools.launch import DaemonProc, start_daemon
from kvmap.v1 import (
    local_calls_pb2,
    region_maps_pb2,
    region_maps_pb2_grpc,
    registry_pb2,
    registry_pb2_grpc,
    types_pb2,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

NOBODY = 65534
BATCHES = 48  # beyond the per-uid limit of 32 pending batches
FDS_PER_BATCH = 64  # 3,072 fds in all, beyond the per-uid limit of 2,048


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory the second uid can traverse through its group (pytest's tmp dirs are 0700)."""
    path = Path(tempfile.mkdtemp(prefix="kvmap-group-", dir="/tmp"))
    os.chmod(path, 0o750)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _daemon_fds(daemon: DaemonProc) -> int:
    return len(os.listdir(f"/proc/{daemon.proc.pid}/fd"))


def _as_nobody(work: Callable[[], str]) -> str:
    """``work()``'s answer, computed in a forked child running as uid NOBODY in group 0 (the
    socket's group). Plain sockets only in ``work``: nothing of the parent's threads is used."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        try:
            os.setgroups([])
            os.setgid(0)
            os.setuid(NOBODY)
            answer = work()
        except BaseException as err:  # reported to the parent, which fails the test
            answer = f"child failed: {err!r}"
        os.write(write, answer.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as reader:
        got = reader.read().decode()
    os.waitpid(pid, 0)
    return got


def _flood(daemon: DaemonProc) -> tuple[int, str]:
    """As NOBODY: send BATCHES batches of the same FDS_PER_BATCH memfds; how many the daemon
    took and its last refusal."""

    def flood() -> str:
        fd = os.memfd_create("flood")
        os.ftruncate(fd, 4096)
        fds = [os.dup(fd) for _ in range(FDS_PER_BATCH)]
        taken, refused = 0, ""
        for _ in range(BATCHES):
            try:
                send_fds(daemon.socket + ".fds", fds, 10)
                taken += 1
            except ResourceExhausted as err:
                refused = str(err)
        return f"{taken} {refused}"

    taken, _, refused = _as_nobody(flood).partition(" ")
    assert taken.isdigit(), refused
    return int(taken), refused


@pytest.mark.skipif(os.geteuid() != 0, reason="a second uid needs root to create")
def test_a_flood_of_pending_fds_from_one_uid_is_bounded(shared_dir: Path) -> None:
    """Another uid of the socket's group sends 48 batches of 64 fds and never registers: the
    daemon takes at most its per-uid share (2,048 fds: 32 batches), refuses the rest with
    RESOURCE_EXHAUSTED naming the per-uid limit and closes them; the daemon's own uid still
    gets its batches accepted."""
    daemon = start_daemon(shared_dir / "run", name="k")
    try:
        before = _daemon_fds(daemon)
        taken, refused = _flood(daemon)
        assert taken * FDS_PER_BATCH <= 2048, taken
        assert f"uid {NOBODY}" in refused and "per uid" in refused, refused
        grown = _daemon_fds(daemon) - before
        assert grown <= 2048 + 16, grown  # the pending share, and no refused fd kept
        fd = os.memfd_create("legit")
        try:
            os.ftruncate(fd, 4096)
            for _ in range(4):
                assert send_fds(daemon.socket + ".fds", [fd], 10)
        finally:
            os.close(fd)
    finally:
        daemon.stop()


SIZE = 1 << 20
BLOCKS = 64


def _register(
    daemon: DaemonProc, memory: int | Path, metadata: Any = None
) -> tuple[grpc.StatusCode, str]:
    """RegisterWorker with one allocation of SIZE bytes: the memfd ``memory`` (sent by fd
    hand-off) or the file at path ``memory``; as this process's uid unless ``metadata`` says
    otherwise (``()``: no credentials)."""
    if metadata is None:
        metadata = credential_metadata(daemon.socket)
    req = registry_pb2.RegisterWorkerRequest(
        worker=types_pb2.WorkerId(engine_id="w"), kv_cache_layout="BLHNC", block_size_tokens=16
    )
    alloc = req.allocations.add(
        id="kv", size_bytes=SIZE, device=types_pb2.Device(type=types_pb2.DEVICE_TYPE_CPU)
    )
    if isinstance(memory, Path):
        alloc.shm_path.path = str(memory)
    else:
        token = send_fds(daemon.socket + ".fds", [memory], 10)
        alloc.shm_fd.CopyFrom(types_pb2.ShmFdHandle(token=token, index=0))
    req.views.add(
        layer_name="l0", allocation_id="kv", transfer_group=0,
        cache_kind=types_pb2.CACHE_KIND_MLA, dtype="uint8", offset_bytes=0,
        block_len_bytes=SIZE // BLOCKS, block_stride_bytes=SIZE // BLOCKS, num_blocks=BLOCKS,
    )  # fmt: skip
    with grpc.insecure_channel(daemon.unix_target) as ch:
        try:
            registry_pb2_grpc.RegistryStub(ch).RegisterWorker(req, timeout=60, metadata=metadata)
        except grpc.RpcError as err:
            return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


def _worker_count(daemon: DaemonProc) -> int:
    with grpc.insecure_channel(daemon.unix_target) as ch:
        resp = region_maps_pb2_grpc.RegionMapsStub(ch).ListWorkers(
            region_maps_pb2.ListWorkersRequest(), timeout=10
        )
    return len(resp.workers)


def test_memory_that_could_shrink_is_refused_and_sealed_memory_cannot(tmp_path: Path) -> None:
    """An unsealed memfd is refused with INVALID_ARGUMENT naming the missing F_SEAL_SHRINK, and
    nothing is registered; a sealed one registers, and its worker can then no longer truncate it
    (EPERM), so the SIGBUS that truncation used to cause in the daemon cannot happen: the daemon
    still serves and still holds the worker."""
    daemon = start_daemon(tmp_path / "run", name="k")
    unsealed = os.memfd_create("kv-unsealed")
    sealed = sealed_memfd("kv-sealed", SIZE)
    try:
        os.ftruncate(unsealed, SIZE)
        code, details = _register(daemon, unsealed)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        assert "allocations[0].shm_fd" in details and "F_SEAL_SHRINK" in details, details
        assert _worker_count(daemon) == 0
        assert _register(daemon, sealed) == (grpc.StatusCode.OK, "")
        with pytest.raises(PermissionError):
            os.ftruncate(sealed, 0)
        assert _worker_count(daemon) == 1 and daemon.proc.poll() is None
    finally:
        os.close(unsealed)
        os.close(sealed)
        daemon.stop()


def test_shm_path_only_under_the_allowed_prefixes_and_never_through_a_link(
    tmp_path: Path,
) -> None:
    """With --shm-path-prefix DIR, a path registration of a file outside DIR (someone's
    0600 file), of a link inside DIR to such a file, or through a linked directory inside DIR,
    is INVALID_ARGUMENT on allocations[0].shm_path saying why; nothing is registered and the
    file keeps its bytes. A file of the caller's directly under DIR registers."""
    allowed = tmp_path / "shm"
    allowed.mkdir()
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * SIZE)
    os.chmod(secret, 0o600)
    (allowed / "link").symlink_to(secret)
    (allowed / "dir-link").symlink_to(tmp_path)
    daemon = start_daemon(tmp_path / "run", "--shm-path-prefix", str(allowed), name="k")
    try:
        for path, why in [
            (secret, "not under an allowed shm_path_prefix"),
            (allowed / "link", "symbolic link"),
            (allowed / "dir-link" / "secret", "symbolic link"),
        ]:
            code, details = _register(daemon, path)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (path, code, details)
            assert details.startswith("allocations[0].shm_path") and why in details, details
        assert _worker_count(daemon) == 0
        assert secret.read_bytes() == b"s" * SIZE
        (allowed / "kv").write_bytes(b"\0" * SIZE)
        assert _register(daemon, allowed / "kv") == (grpc.StatusCode.OK, "")
    finally:
        daemon.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="a second uid needs root to create")
def test_a_path_registration_names_only_the_callers_own_file(shared_dir: Path) -> None:
    """Under an allowed prefix, a file owned by another uid (NOBODY's) is PERMISSION_DENIED naming
    both uids, and a path registration without credentials is PERMISSION_DENIED saying so:
    a socket-group member registers only memory it could map itself."""
    allowed = shared_dir / "shm"
    allowed.mkdir()
    theirs = allowed / "theirs"
    theirs.write_bytes(b"t" * SIZE)
    os.chown(theirs, NOBODY, 0)
    mine = allowed / "mine"
    mine.write_bytes(b"\0" * SIZE)
    daemon = start_daemon(shared_dir / "run", "--shm-path-prefix", str(allowed), name="k")
    try:
        code, details = _register(daemon, theirs)
        assert code == grpc.StatusCode.PERMISSION_DENIED, (code, details)
        assert f"owned by uid {NOBODY}, not by the caller's uid 0" in details, details
        code, details = _register(daemon, mine, metadata=())
        assert code == grpc.StatusCode.PERMISSION_DENIED, (code, details)
        assert "needs the caller's credentials" in details, details
        assert _worker_count(daemon) == 0
        assert theirs.read_bytes() == b"t" * SIZE
    finally:
        daemon.stop()


def _refused(call: Any, request: Any, metadata: Any) -> str:
    """The details of ``call``'s PERMISSION_DENIED (a stream is read to its first message)."""
    with pytest.raises(grpc.RpcError) as err:
        answer = call(request, timeout=10, metadata=metadata)
        if not hasattr(answer, "ByteSize"):
            next(answer)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value
    return err.value.details() or ""


@pytest.mark.skipif(os.geteuid() != 0, reason="a second uid needs root to create")
def test_only_the_registering_uid_acts_as_its_worker(shared_dir: Path) -> None:
    """A worker registered with the client library (its uid's credential token): another uid of
    the socket's group (NOBODY, with its own valid token), a caller without a token and one with
    a made-up token are each refused Attach, GrantTransfer, RevokeTransfer, DeregisterWorker and
    a replacing RegisterWorker with PERMISSION_DENIED, and NOBODY's attach, grant and revoke on
    the local calls socket (where the kernel names its uid; no token to steal or forge) are
    refused the same;
    the worker stays registered as it was, and its own uid attaches and grants."""
    daemon = start_daemon(shared_dir / "run", name="k")
    fd = sealed_memfd("kv", SIZE)
    client = KvmapClient.connect(daemon.socket)
    try:
        worker = types_pb2.WorkerId(engine_id="w")
        client.register_worker(_registration(worker, "kv"), [fd])
        stream = client.attach(worker)
        assert next(iter(stream)).WhichOneof("event") == "attached"
        nobody = _as_nobody(lambda: send_credentials(daemon.socket + ".fds", 10))
        assert len(nobody) == 32, nobody  # a token, not an error
        strangers = [((PEER_TOKEN_METADATA, nobody),), (), ((PEER_TOKEN_METADATA, "0" * 32),)]
        with grpc.insecure_channel(daemon.unix_target) as ch:
            registry = registry_pb2_grpc.RegistryStub(ch)
            for md in strangers:
                for call, req in _worker_calls(registry, worker, daemon):
                    _refused(call, req, md)
        path = daemon.socket + LOCAL_CALLS_SUFFIX
        for field, request in _local_worker_calls(worker):
            local = _as_nobody(functools.partial(_local_call, path, field, request))
            assert local.startswith("7 worker w/dp0/tp0/pp0 was registered by another uid"), local
        assert _worker_count(daemon) == 1
        grant = client.grant_transfer(worker, "r1", {0: [1, 2]})
        assert grant.capability and grant.generation == 1
        stream.cancel()
    finally:
        client.close()
        os.close(fd)
        daemon.stop()


def _local_worker_calls(worker: types_pb2.WorkerId) -> list[tuple[int, bytes]]:
    """The local calls socket's Registry calls that act as ``worker``."""
    grant = registry_pb2.GrantTransferRequest(
        worker=worker,
        request_id="stolen",
        groups=[types_pb2.BlockGrant(transfer_group=0, block_ids=[1])],
    )
    return [
        (ATTACH_FIELD, registry_pb2.AttachRequest(worker=worker).SerializeToString()),
        (GRANT_FIELD, grant.SerializeToString()),
        (
            REVOKE_FIELD,
            registry_pb2.RevokeTransferRequest(worker=worker, request_id="r").SerializeToString(),
        ),
    ]


def _local_call(path: str, field: int, request: bytes) -> str:
    """One call on the local calls socket, by hand: the first frame's end
    status number and message, or what came instead."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(path)
        sock.sendall(call_bytes(field, request, ""))
        head = sock.recv(4, socket.MSG_WAITALL)
        body = sock.recv(int.from_bytes(head, "little"), socket.MSG_WAITALL)
    reply = local_calls_pb2.LocalReply.FromString(body)
    if reply.WhichOneof("reply") != "end":
        return f"not refused: {reply}"
    return f"{reply.end.code} {reply.end.message}"


def _registration(worker: types_pb2.WorkerId, alloc: str) -> registry_pb2.RegisterWorkerRequest:
    req = registry_pb2.RegisterWorkerRequest(
        worker=worker, kv_cache_layout="BLHNC", block_size_tokens=16
    )
    req.allocations.add(
        id=alloc, size_bytes=SIZE, device=types_pb2.Device(type=types_pb2.DEVICE_TYPE_CPU),
        shm_fd=types_pb2.ShmFdHandle(index=0),
    )  # fmt: skip
    req.views.add(
        layer_name="l0", allocation_id=alloc, transfer_group=0,
        cache_kind=types_pb2.CACHE_KIND_MLA, dtype="uint8", offset_bytes=0,
        block_len_bytes=SIZE // BLOCKS, block_stride_bytes=SIZE // BLOCKS, num_blocks=BLOCKS,
    )  # fmt: skip
    return req


def _worker_calls(
    registry: registry_pb2_grpc.RegistryStub, worker: types_pb2.WorkerId, daemon: DaemonProc
) -> list[tuple[Any, Any]]:
    """Every Registry call that acts as ``worker`` (the replacing registration's memory is a
    fresh sealed memfd, sent by this process)."""
    fd = sealed_memfd("kv2", SIZE)
    try:
        replace = _registration(worker, "kv2")
        replace.allocations[0].shm_fd.token = send_fds(daemon.socket + ".fds", [fd], 10)
    finally:
        os.close(fd)
    return [
        (registry.Attach, registry_pb2.AttachRequest(worker=worker)),
        (registry.GrantTransfer, registry_pb2.GrantTransferRequest(
            worker=worker, request_id="stolen",
            groups=[types_pb2.BlockGrant(transfer_group=0, block_ids=[1])])),
        (registry.RevokeTransfer,
         registry_pb2.RevokeTransferRequest(worker=worker, request_id="r")),
        (registry.DeregisterWorker, registry_pb2.DeregisterWorkerRequest(worker=worker)),
        (registry.RegisterWorker, replace),
    ]  # fmt: skip
