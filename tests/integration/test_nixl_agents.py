"""Real NIXL agents over UCX (loopback) in separate processes, no progress
thread, moving bytes between real shared memory.

Three processes, as in production:
- worker:    a "vLLM worker" owning torch KV tensors; it exports them as shm
             fds and sends them over the fd hand-off socket;
- initiator: a "decode daemon": runs the fd hand-off server, imports and
             registers the worker's memory, and posts READs and WRITEs;
- target:    a "prefill daemon" with its own registered memory; it makes no
             transfer calls, only polls ``take_notifs`` as the daemon's
             progress loop does (without that, nothing completes).

The worker checks what landed in its own tensors and the target checks its
memory, byte for byte.
"""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing as mp
import os
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

NB = 16  # blocks per region
# (allocation, offset in a block row, length, block stride): allocation 0 is a
# 2-region KV row (layers 0-1 coalesced, then layer 2), allocation 1 an indexer.
REGIONS = [(0, 0, 1024, 1536), (0, 1024, 512, 1536), (1, 0, 256, 256)]
ALLOC_SIZES = [NB * 1536, NB * 256]
TARGET_SEED, WORKER_SEED = 1, 2
CALL_TIMEOUT_S = 60.0

# Block pairs per transfer, (source block, destination block).
READ_PREPPED = [(3, 0), (7, 2), (15, 4)]  # target -> worker
WRITE_PREPPED = [(1, 9), (5, 12)]  # worker -> target
READ_DESCS = [(11, 6)]
WRITE_DESCS = [(13, 14)]
WORKER_FILLED = [1, 5, 13]  # worker blocks that hold WORKER_SEED data at start


def pattern(seed: int, block: int, region: int, n: int) -> npt.NDArray[np.uint8]:
    return ((seed * 13 + block * 7 + region * 31 + np.arange(n)) % 251).astype(np.uint8)


def region_bytes(base: list[int], block: int, region: int) -> tuple[int, int]:
    alloc, offset, length, stride = REGIONS[region]
    return base[alloc] + block * stride + offset, length


def strided_rows(base: list[int]) -> npt.NDArray[np.uint64]:
    """One Nx5 row per region: descriptor ``r * NB + b`` is block b of region r."""
    return np.array(
        [[base[a] + off, length, 0, stride, NB] for a, off, length, stride in REGIONS],
        dtype=np.uint64,
    )


def explicit_rows(base: list[int], blocks: list[int]) -> npt.NDArray[np.uint64]:
    return np.array(
        [[*region_bytes(base, b, r), 0] for b in blocks for r in range(len(REGIONS))],
        dtype=np.uint64,
    )


def view(address: int, n: int) -> npt.NDArray[np.uint8]:
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(address))


# -- child processes ----------------------------------------------------------


def _child(conn: Connection, handle: Callable[[Any], Any], idle: Callable[[], None]) -> None:
    """Command loop: answer each message with ("ok", result) or ("error", text);
    between messages run ``idle`` (the progress poll of a daemon)."""
    while True:
        if not conn.poll(0.001):
            idle()
            continue
        msg = conn.recv()
        if msg == "stop":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", handle(msg)))
        except Exception as e:
            conn.send(("error", type(e).__name__, str(e), traceback.format_exc()))


def _reporting(main: Callable[..., None]) -> Callable[..., None]:
    """Send a child's setup failure to the test instead of letting it time out."""

    def run(conn: Connection, *args: Any) -> None:
        try:
            main(conn, *args)
        except Exception as e:
            conn.send(("error", type(e).__name__, str(e), traceback.format_exc()))
            raise

    return run


def target_main(conn: Connection) -> None:
    _reporting(_target)(conn)


def _target(conn: Connection) -> None:
    os.environ["UCX_NET_DEVICES"] = "lo"
    from kvmap.client.fd_handoff import sealed_memfd
    from kvmap.daemon.adapters import memory
    from kvmap.daemon.adapters.nixl_agent import NixlAgent

    agent = NixlAgent.create("target")
    maps = []
    for size in ALLOC_SIZES:
        fd = sealed_memfd("target-kv", size)
        maps.append(memory.import_shm_fd(fd, 0, size))
    base = [m.address for m in maps]
    for m in maps:
        agent.register_dram(m.address, m.size)

    def fill() -> None:
        for r in range(len(REGIONS)):
            for b in range(NB):
                addr, n = region_bytes(base, b, r)
                view(addr, n)[:] = pattern(TARGET_SEED, b, r, n)

    fill()
    notifs: dict[str, list[bytes]] = {}

    def poll() -> None:
        for peer, msgs in agent.take_notifs().items():
            notifs.setdefault(peer, []).extend(msgs)

    def handle(msg: Any) -> Any:
        cmd = msg[0]
        if cmd == "hello":
            return agent.metadata(), base
        if cmd == "add_remote":
            return agent.add_remote(msg[1])
        if cmd == "reset":  # every block back to its starting bytes
            fill()
            return None
        if cmd == "notifs":
            out = {k: list(v) for k, v in notifs.items()}
            notifs.clear()
            return out
        if cmd == "check_written":  # [(worker block, target block)] -> mismatches
            bad = []
            for src, dst in msg[1]:
                for r in range(len(REGIONS)):
                    addr, n = region_bytes(base, dst, r)
                    if not np.array_equal(view(addr, n), pattern(WORKER_SEED, src, r, n)):
                        bad.append((src, dst, r))
            untouched = {b for b in range(NB)} - {d for _, d in msg[1]}
            for b in untouched:
                for r in range(len(REGIONS)):
                    addr, n = region_bytes(base, b, r)
                    if not np.array_equal(view(addr, n), pattern(TARGET_SEED, b, r, n)):
                        bad.append(("changed", b, r))
            return bad
        raise ValueError(f"unknown command {cmd}")

    try:
        _child(conn, handle, poll)
    finally:
        agent.close()
        for m in maps:
            m.close()


def worker_main(conn: Connection, fd_socket: str) -> None:
    _reporting(_worker)(conn, fd_socket)


def _worker(conn: Connection, fd_socket: str) -> None:
    import torch

    from kvmap.client.fd_handoff import send_fds
    from kvmap.client.shm_export import export_tensors

    kv = torch.zeros(NB, 1536, dtype=torch.uint8)
    indexer = torch.zeros(NB, 256, dtype=torch.uint8)
    tensors = [kv, indexer]
    # Three layer views over two storages: exported as two fds.
    storages, views = export_tensors([kv[:, :1024], kv[:, 1024:], indexer])
    assert [v.storage_index for v in views] == [0, 0, 1]

    def region(block: int, r: int) -> torch.Tensor:
        alloc, offset, length, _ = REGIONS[r]
        return tensors[alloc][block, offset : offset + length]

    def fill() -> None:
        for t in tensors:
            t.zero_()
        for b in WORKER_FILLED:
            for r in range(len(REGIONS)):
                region(b, r).copy_(torch.from_numpy(pattern(WORKER_SEED, b, r, REGIONS[r][2])))

    fill()
    token = send_fds(fd_socket, [s.fd for s in storages], timeout=10.0)

    def handle(msg: Any) -> Any:
        if msg[0] == "reset":  # every block back to its starting bytes
            fill()
            return None
        if msg[0] == "check_read":  # [(target block, worker block)] -> mismatches
            bad = []
            for src, dst in msg[1]:
                for r in range(len(REGIONS)):
                    want = pattern(TARGET_SEED, src, r, REGIONS[r][2])
                    if not np.array_equal(region(dst, r).numpy(), want):
                        bad.append((src, dst, r))
            touched = {d for _, d in msg[1]} | set(WORKER_FILLED)
            for b in set(range(NB)) - touched:
                if any(int(region(b, r).count_nonzero()) for r in range(len(REGIONS))):
                    bad.append(("changed", b))
            return bad
        raise ValueError(f"unknown command {msg[0]}")

    conn.send(("ok", (token, [s.size_bytes for s in storages])))
    _child(conn, handle, lambda: None)


def initiator_main(conn: Connection, fd_socket: str) -> None:
    os.environ["UCX_NET_DEVICES"] = "lo"
    _reporting(lambda c, f: asyncio.run(_initiator(c, f)))(conn, fd_socket)


async def _initiator(conn: Connection, fd_socket: str) -> None:
    from kvmap.core import errors
    from kvmap.daemon.adapters import memory
    from kvmap.daemon.adapters.fd_handoff import FdHandoffServer
    from kvmap.daemon.adapters.nixl_agent import NixlAgent, XferOp, XferState

    agent = NixlAgent.create("initiator")
    fds = FdHandoffServer(fd_socket)
    await fds.start()
    maps: list[memory.MappedMemory] = []
    state: dict[str, Any] = {}

    def wait(xfer: Any) -> str:
        deadline = asyncio.get_running_loop().time() + 30
        while agent.poll(xfer) is XferState.PROC:
            if asyncio.get_running_loop().time() > deadline:
                return "TIMEOUT"
        agent.release(xfer)
        return xfer.state.value

    def prepped(op: XferOp, pairs: list[tuple[int, int]], notif: bytes) -> str:
        # Source/destination blocks -> local/remote descriptor indices.
        local_blocks = [d for _, d in pairs] if op is XferOp.READ else [s for s, _ in pairs]
        remote_blocks = [s for s, _ in pairs] if op is XferOp.READ else [d for _, d in pairs]
        regions = range(len(REGIONS))
        li = [r * NB + b for b in local_blocks for r in regions]
        ri = [r * NB + b for b in remote_blocks for r in regions]
        xfer = agent.post_prepped(op, state["local"], li, state["remote"], ri, notif=notif)
        return wait(xfer)

    def descs(op: XferOp, pairs: list[tuple[int, int]], notif: bytes) -> str:
        local_blocks = [d for _, d in pairs] if op is XferOp.READ else [s for s, _ in pairs]
        remote_blocks = [s for s, _ in pairs] if op is XferOp.READ else [d for _, d in pairs]
        local = explicit_rows(state["base"], local_blocks)
        remote = explicit_rows(state["remote_base"], remote_blocks)
        return wait(agent.post_descs(op, local, remote, state["peer"], notif=notif))

    def error_of(fn: Callable[[], Any]) -> tuple[str, str, str]:
        try:
            fn()
        except errors.KvmapError as e:
            return type(e).__name__, getattr(e, "field", ""), str(e)
        return "no error", "", ""

    def handle(msg: Any) -> Any:
        cmd = msg[0]
        if cmd == "import":  # claim the worker's fds and register them
            token, sizes = msg[1], msg[2]
            for i, size in enumerate(sizes):
                field = f"allocations[{i}].shm_fd"
                maps.append(memory.import_shm_fd(fds.claim(token, i, field), 0, size, field=field))
            fds.discard(token)
            for m in maps:
                agent.register_dram(m.address, m.size)
            state["base"] = [m.address for m in maps]
            state["local"] = agent.prep_local(strided_rows(state["base"]))
            return agent.metadata(), fds.pending_fds
        if cmd == "connect":
            md, remote_base = msg[1], msg[2]
            state["peer"] = agent.add_remote(md)
            state["remote_base"] = remote_base
            state["remote"] = agent.prep_remote(state["peer"], strided_rows(remote_base))
            return state["peer"]
        if cmd == "prepped":
            return prepped(XferOp[msg[1]], msg[2], msg[3])
        if cmd == "descs":
            return descs(XferOp[msg[1]], msg[2], msg[3])
        if cmd == "notif":
            agent.send_notif(state["peer"], msg[1])
            return None
        if cmd == "errors":
            rows = strided_rows(state["remote_base"])
            outside = np.array([[state["remote_base"][1] + ALLOC_SIZES[1], 64, 0]])
            return {
                "unknown agent": error_of(lambda: agent.prep_remote("nobody", rows)),
                "unregistered": error_of(lambda: agent.prep_remote(state["peer"], outside)),
                "bad index": error_of(
                    lambda: agent.post_prepped(
                        XferOp.READ, state["local"], [0], state["remote"], [3 * NB]
                    )
                ),
                "bad metadata": error_of(lambda: agent.add_remote(b"not metadata")),
                "length mismatch": error_of(
                    lambda: agent.post_descs(
                        XferOp.READ,
                        [[state["base"][0], 64, 0]],
                        [[state["remote_base"][0], 32, 0]],
                        state["peer"],
                    )
                ),
                "bad rows": error_of(lambda: agent.prep_local(np.zeros((2, 4)))),
                "self as peer": error_of(lambda: agent.add_remote(agent.metadata())),
                "overlap": error_of(lambda: agent.register_dram(state["base"][0] + 4096, 64)),
                "empty registration": error_of(lambda: agent.register_dram(state["base"][0], 0)),
            }
        if cmd == "drift":
            from kvmap.daemon.adapters.nixl_agent import exception_map_drift

            return exception_map_drift()
        raise ValueError(f"unknown command {cmd}")

    try:
        while True:
            # The fd hand-off server runs on this loop: yield to it between polls.
            ready = await asyncio.to_thread(conn.poll, 0.01)
            if not ready:
                agent.take_notifs()
                continue
            msg = conn.recv()
            if msg == "stop":
                conn.send(("ok", None))
                return
            try:
                conn.send(("ok", handle(msg)))
            except Exception as e:
                conn.send(("error", type(e).__name__, str(e), traceback.format_exc()))
    finally:
        agent.close()
        for m in maps:
            m.close()
        await fds.close()


def survivor_main(conn: Connection) -> None:
    _reporting(_survivor)(conn)


def _survivor(conn: Connection) -> None:
    """Reads from a target, outlives it, and reports what NIXL then says."""
    os.environ["UCX_NET_DEVICES"] = "lo"
    from kvmap.core import errors
    from kvmap.daemon.adapters.nixl_agent import NixlAgent, XferOp, XferState

    agent = NixlAgent.create("survivor")
    buf = np.zeros(ALLOC_SIZES[0], dtype=np.uint8)
    agent.register_dram(buf.ctypes.data, buf.nbytes)
    conn.send(("ok", agent.metadata()))
    md, remote_base = conn.recv()
    peer = agent.add_remote(md)
    local = agent.prep_local(strided_rows([buf.ctypes.data, 0])[:1])
    remote = agent.prep_remote(peer, strided_rows(remote_base)[:1])

    def read() -> str:
        xfer = agent.post_prepped(XferOp.READ, local, [0], remote, [1])
        deadline = time.monotonic() + 30
        while agent.poll(xfer) is XferState.PROC and time.monotonic() < deadline:
            pass
        return f"{xfer.state.value} {xfer.error!r}"

    conn.send(("ok", read()))
    conn.recv()  # the target is dead now
    try:
        # Either the post fails at once or the transfer ends in ERR.
        outcome = f"polled: {read()}"
    except errors.KvmapError as e:
        outcome = f"raised: {type(e).__name__}: {e}"
    agent.close()  # must not abort in UCX (see NixlAgent.close)
    conn.send(("ok", outcome))


# -- the test side --------------------------------------------------------------


@dataclass
class Proc:
    name: str
    process: Any
    conn: Connection

    def call(self, *msg: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        self.conn.send(msg)
        return self.reply(timeout)

    def reply(self, timeout: float = CALL_TIMEOUT_S) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.name}: no reply in {timeout}s")
        answer = self.conn.recv()
        if answer[0] != "ok":
            raise AssertionError(f"{self.name}: {answer[1]}: {answer[2]}\n{answer[3]}")
        return answer[1]

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send("stop")
                self.conn.poll(10)
            except (OSError, EOFError):
                pass
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


@dataclass
class Cluster:
    worker: Proc
    initiator: Proc
    target: Proc
    initiator_name: str
    target_name: str
    pending_fds_after_import: int


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    os.environ["UCX_NET_DEVICES"] = "lo"  # inherited by every child as well
    ctx = mp.get_context("spawn")
    procs: list[Proc] = []

    def start(name: str, fn: Callable[..., None], *args: Any) -> Proc:
        ours, theirs = ctx.Pipe()
        p = ctx.Process(target=fn, args=(theirs, *args), name=name, daemon=True)
        p.start()
        proc = Proc(name, p, ours)
        procs.append(proc)
        return proc

    with tempfile.TemporaryDirectory(prefix="kvnx", dir="/tmp") as d:
        fd_socket = str(Path(d) / "kvmapd.sock.fds")
        try:
            target = start("target", target_main)
            initiator = start("initiator", initiator_main, fd_socket)
            target_md, target_base = target.call("hello")
            worker = _start_worker(start, fd_socket)
            token, sizes = worker.reply()
            initiator_md, pending = initiator.call("import", token, sizes)
            target_name = initiator.call("connect", target_md, target_base)
            initiator_name = target.call("add_remote", initiator_md)
            yield Cluster(worker, initiator, target, initiator_name, target_name, pending)
        finally:
            for proc in procs:
                proc.stop()


def _start_worker(start: Callable[..., Proc], fd_socket: str) -> Proc:
    # The fd socket is created by the initiator's first loop turn; wait for it.
    deadline = 30.0
    while not os.path.exists(fd_socket) and deadline > 0:
        time.sleep(0.05)
        deadline -= 0.05
    return start("worker", worker_main, fd_socket)


def wait_notifs(cluster: Cluster, expected: set[bytes], timeout: float = 20.0) -> None:
    """Poll the target until ``expected`` arrived from the initiator (nothing else)."""
    got: list[bytes] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not expected <= set(got):
        notifs = cluster.target.call("notifs")
        assert set(notifs) <= {cluster.initiator_name}
        got += notifs.get(cluster.initiator_name, [])
        time.sleep(0.02)
    assert sorted(got) == sorted(expected)


def reset(cluster: Cluster) -> None:
    """Both memories back to their starting bytes, whatever tests ran before."""
    cluster.worker.call("reset")
    cluster.target.call("reset")


def test_worker_fds_arrive_through_the_handoff_socket(cluster: Cluster) -> None:
    """Setting up the three processes works end to end: the agents know each other by name, and the
    initiator holds no pending fds once it has imported the worker's."""
    assert cluster.target_name == "target"
    assert cluster.initiator_name == "initiator"
    assert cluster.pending_fds_after_import == 0  # discarded once imported


def test_read_and_write_with_prepped_strided_lists(cluster: Cluster) -> None:
    """READ and WRITE on prepared strided descriptor lists complete, move the chosen blocks of every
    region byte for byte and change no other block, and deliver their notifications to the
    target."""
    reset(cluster)
    assert cluster.initiator.call("prepped", "READ", READ_PREPPED, b"pull-prepped") == "DONE"
    assert cluster.initiator.call("prepped", "WRITE", WRITE_PREPPED, b"push-prepped") == "DONE"
    assert cluster.worker.call("check_read", READ_PREPPED) == []
    assert cluster.target.call("check_written", WRITE_PREPPED) == []
    wait_notifs(cluster, {b"pull-prepped", b"push-prepped"})


def test_read_and_write_with_explicit_descriptors(cluster: Cluster) -> None:
    """READ and WRITE on explicit descriptor rows complete and move the chosen blocks byte for byte
    (blocks moved just before by prepped transfers intact, nothing else changed), with their
    notifications."""
    reset(cluster)
    # Blocks already moved, which the explicit transfers must leave alone.
    assert cluster.initiator.call("prepped", "READ", READ_PREPPED, b"pull-before") == "DONE"
    assert cluster.initiator.call("prepped", "WRITE", WRITE_PREPPED, b"push-before") == "DONE"
    assert cluster.initiator.call("descs", "READ", READ_DESCS, b"pull-descs") == "DONE"
    assert cluster.initiator.call("descs", "WRITE", WRITE_DESCS, b"push-descs") == "DONE"
    assert cluster.worker.call("check_read", READ_PREPPED + READ_DESCS) == []
    assert cluster.target.call("check_written", WRITE_PREPPED + WRITE_DESCS) == []
    wait_notifs(cluster, {b"pull-before", b"push-before", b"pull-descs", b"push-descs"})


def test_notifications_reach_the_target(cluster: Cluster) -> None:
    """A standalone notification sent by the initiator arrives at the target, and nothing else
    does."""
    cluster.initiator.call("notif", b"standalone")
    wait_notifs(cluster, {b"standalone"})


def test_nixl_errors_are_mapped(cluster: Cluster) -> None:
    """NIXL failures map to kvmap errors: unknown agent and unregistered memory are NOT_FOUND; bad
    index, metadata, lengths, row shape, self as peer and empty registration are INVALID_ARGUMENT
    with a field; an overlapping registration is ALREADY_EXISTS."""
    errs = cluster.initiator.call("errors")
    kind, _, message = errs["unknown agent"]
    assert kind == "NotFound" and "NIXL_ERR_NOT_FOUND" in message and "'nobody'" in message
    kind, _, message = errs["unregistered"]
    assert kind == "NotFound" and "NIXL_ERR_NOT_FOUND" in message
    assert errs["bad index"] == (
        "InvalidArgument",
        "remote_idx[0]",
        f"remote_idx[0]: index {3 * NB} outside the list's {3 * NB} descriptors",
    )
    kind, field, message = errs["bad metadata"]
    assert (kind, field) == ("InvalidArgument", "metadata")
    assert "NIXL_ERR_MISMATCH" in message
    kind, field, message = errs["length mismatch"]
    assert (kind, field) == ("InvalidArgument", "remote_rows[0]")
    kind, field, message = errs["bad rows"]
    assert (kind, field) == ("InvalidArgument", "rows")
    assert "expected an Nx3 or Nx5 array, got shape (2, 4)" in message
    kind, field, message = errs["self as peer"]
    assert (kind, field) == ("InvalidArgument", "metadata")
    assert "NIXL_ERR_INVALID_PARAM" in message
    kind, field, message = errs["overlap"]
    assert kind == "AlreadyExists" and "overlap the registration of" in message
    assert errs["empty registration"][:2] == ("InvalidArgument", "size")


def test_every_nixl_exception_class_is_mapped(cluster: Cluster) -> None:
    """Every exception class the installed nixl bindings define has a mapping, and no mapping names
    a class that no longer exists."""
    assert cluster.initiator.call("drift") == {"unmapped": [], "stale": []}


def test_translate_matches_the_documented_table() -> None:
    """Each row of the module docstring's table is what ``translate`` does."""
    from kvmap.core import errors
    from kvmap.daemon.adapters import nixl_agent

    assert nixl_agent.__doc__ is not None
    rows = [
        line.split()
        for line in nixl_agent.__doc__.splitlines()
        if line.startswith("nixl") and "Error" in line.split()[0]
    ]
    assert len(rows) == len(nixl_agent._EXC_MAP)
    for row in rows:
        name, status, kind = row[0].rstrip(","), row[-2], row[-1]
        fake = type(name, (Exception,), {"__module__": "nixl_fake._bindings"})
        err = nixl_agent.translate(fake(status), "prep_remote(agent 'x')", "rows")
        assert type(err).__name__ == kind, name
        assert str(err).endswith(f"prep_remote(agent 'x'): {status}")
        if isinstance(err, errors.TransferError):
            assert err.nixl_status == status
        if isinstance(err, errors.InvalidArgument):
            assert err.field == "rows"
    foreign = nixl_agent.translate(TypeError("bad"), "post", "x")
    assert isinstance(foreign, errors.InternalError)
    assert not isinstance(foreign, errors.TransferError)


def test_peer_death_is_unavailable_and_close_survives_it() -> None:
    """After the remote process is killed, a READ from it fails as UNAVAILABLE (or ends in ERR) with
    a disconnect or backend status, and the survivor's agent closes and exits cleanly."""
    os.environ["UCX_NET_DEVICES"] = "lo"
    ctx = mp.get_context("spawn")
    procs = []
    try:
        for name, fn in (("victim", target_main), ("survivor", survivor_main)):
            ours, theirs = ctx.Pipe()
            p = ctx.Process(target=fn, args=(theirs,), name=name, daemon=True)
            p.start()
            procs.append(Proc(name, p, ours))
        victim, survivor = procs
        victim_md, victim_base = victim.call("hello")
        survivor_md = survivor.reply()
        victim.call("add_remote", survivor_md)
        assert survivor.call(victim_md, victim_base) == "DONE None"
        victim.process.kill()
        victim.process.join(10)
        outcome = survivor.call("go")
        # Measured: the post raises at once; were UCX to notice later, the
        # transfer would end in ERR with the reason attached instead.
        assert outcome.startswith(
            ("raised: Unavailable: READ with agent 'target': ", "polled: ERR TransferError(")
        ), outcome
        assert "NIXL_ERR_REMOTE_DISCONNECT" in outcome or "NIXL_ERR_BACKEND" in outcome
        survivor.process.join(30)
        assert survivor.process.exitcode == 0  # no UCX abort on close
    finally:
        for proc in procs:
            if proc.process.is_alive():
                proc.process.kill()
                proc.process.join(5)
