"""A daemon that stays responsive, against real daemons:

- 100 pulls towards silent peers (127.0.0.1 sockets that accept and never
  answer) neither stall a warm pull to a healthy peer nor exhaust the
  daemon: at most ``MAX_HANDSHAKES_IN_FLIGHT`` handshakes wait, the rest are
  RESOURCE_EXHAUSTED at once;
- requests rejected for their size leave the daemon's memory as it was.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from security_support import Cluster, Live, ShmWorker, expect_transfer

from kvmap.core.transfer_plan import MAX_GROUPS_PER_TRANSFER
from kvmap.daemon.engine.transfers import MAX_HANDSHAKES_IN_FLIGHT
from kvmap.tools.launch import start_daemon
from kvmap.v1 import registry_pb2, transfers_pb2, types_pb2

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

Code = grpc.StatusCode
SILENT = 100
# How long the decode daemon waits for a handshake: long enough that the
# silent pulls are certainly still waiting while the healthy one runs.
CONNECT_TIMEOUT_S = 10.0


class SilentPeers:
    """``count`` listening sockets on 127.0.0.1 that accept connections and
    never send a byte; counts the listeners that were connected to."""

    def __init__(self, count: int) -> None:
        self._sel = selectors.DefaultSelector()
        self._listeners = []
        self._held: list[socket.socket] = []
        self.reached: set[int] = set()
        self.changed = threading.Condition()
        for i in range(count):
            s = socket.create_server(("127.0.0.1", 0), backlog=16)
            s.setblocking(False)
            self._sel.register(s, selectors.EVENT_READ, i)
            self._listeners.append(s)
        self.targets = [f"127.0.0.1:{s.getsockname()[1]}" for s in self._listeners]
        self._stop = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop:
            for key, _ in self._sel.select(0.2):
                conn, _ = key.fileobj.accept()  # type: ignore[union-attr]
                self._held.append(conn)  # held open, never answered
                with self.changed:
                    self.reached.add(key.data)
                    self.changed.notify_all()

    def close(self) -> None:
        self._stop = True
        self._thread.join(5)
        for s in self._listeners + self._held:
            s.close()
        self._sel.close()


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Prefill (coalesce) and decode daemons; the decode daemon waits
    CONNECT_TIMEOUT_S for a handshake. The prefill worker stays attached so
    that it may grant capabilities."""
    tmp = tmp_path_factory.mktemp("responsive")
    config = tmp / "decode.toml"
    config.write_text(f"connect_timeout_s = {CONNECT_TIMEOUT_S}\n")
    p = start_daemon(tmp / "p", "--planner", "coalesce", name="p")
    d = start_daemon(tmp / "d", "--planner", "baseline", "--config", str(config), name="d")
    pl, dl = Live(p), Live(d)
    pw, dw = ShmWorker(pl, "prefill", 32, seed=1), ShmWorker(dl, "decode", 24, seed=2)
    attach = None
    try:
        pw.register()
        dw.register()
        attach = pl.registry.Attach(registry_pb2.AttachRequest(worker=pw.worker_id))
        assert next(attach).WhichOneof("event") == "attached"
        yield Cluster(pl, dl, pw, dw)
        for live in (pl, dl):
            live.assert_healthy()
    finally:
        if attach is not None:
            attach.cancel()
        for live in (pl, dl):
            live.close()
        for proc in (d, p):
            proc.stop()
        pw.close()
        dw.close()


def granted(c: Cluster, request_id: str, remote: list[int]) -> transfers_pb2.TransferSpec:
    """A pull of group 0 blocks ``remote`` into decode blocks 0.., with the
    capability the prefill daemon grants for them."""
    spec = c.spec(
        [{"group": 0, "local": list(range(len(remote))), "remote": remote}], request_id=request_id
    )
    grant = c.p.registry.GrantTransfer(
        registry_pb2.GrantTransferRequest(
            worker=c.pw.worker_id,
            request_id=request_id,
            groups=[types_pb2.BlockGrant(transfer_group=0, block_ids=remote)],
        ),
        timeout=10,
    )
    spec.capability = grant.capability
    return spec


def _pull(c: Cluster, spec: transfers_pb2.TransferSpec) -> tuple[Code, str, float]:
    """(status, details, when it ended) of a pull on the decode daemon."""
    try:
        list(c.d.transfers.Pull(transfers_pb2.PullRequest(spec=spec), timeout=60))
        code, msg = Code.OK, ""
    except grpc.RpcError as err:
        code, msg = err.code(), err.details() or ""
    return code, msg, time.monotonic()


# Shares the machine: what it asserts is an order (the healthy pull ends
# before any handshake's 10 s timeout) and codes, not a duration; the
# latencies it prints are noisier for it.
def test_silent_peers_delay_only_the_pulls_to_them(c: Cluster) -> None:
    """100 pulls towards 100 silent peers: MAX_HANDSHAKES_IN_FLIGHT of them wait on their
    handshake, the others are RESOURCE_EXHAUSTED naming the limit; meanwhile a warm pull to the
    healthy prefill daemon completes with the right bytes before any waiting pull has ended, and
    the waiting ones end UNAVAILABLE or DEADLINE_EXCEEDED (the handshake's timeout). Both
    latencies are printed. (Pins: handshakes are not serialised behind one lock, cached lookups
    wait on nothing, and the number in flight is bounded.)"""
    assert _pull(c, granted(c, "warm", [3]))[0] is Code.OK
    expect_transfer(c.dw, c.pw, 0, [0], [3])
    silent = SilentPeers(SILENT)
    pool = ThreadPoolExecutor(SILENT)
    try:
        started = time.monotonic()
        futures: list[Future[tuple[Code, str, float]]] = []
        for i, target in enumerate(silent.targets):
            spec = c.spec([{"group": 0, "local": [1], "remote": [1]}], request_id=f"s{i}")
            spec.remote_target, spec.capability = target, "none-needed-to-hang"
            futures.append(pool.submit(_pull, c, spec))
        with silent.changed:
            assert silent.changed.wait_for(
                lambda: len(silent.reached) >= MAX_HANDSHAKES_IN_FLIGHT, 60
            ), f"only {len(silent.reached)} silent peers were dialled"
        refused = [f.result(60) for f in futures if f.done()]

        healthy_start = time.monotonic()
        code, msg, healthy_end = _pull(c, granted(c, "healthy", [5, 6]))
        assert code is Code.OK, (code, msg)
        expect_transfer(c.dw, c.pw, 0, [0, 1], [5, 6])
        c.assert_all_intact("after the healthy pull")
        waiting = [f for f in futures if not f.done()]
        assert len(waiting) == MAX_HANDSHAKES_IN_FLIGHT, len(waiting)

        ended = [f.result(CONNECT_TIMEOUT_S * 3) for f in futures]
        hung = [e for e, f in zip(ended, futures, strict=True) if f in waiting]
        assert {code for code, _, _ in hung} <= {Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED}, hung
        assert healthy_end < min(end for _, _, end in hung)
        refused = [e for e in ended if e[0] is Code.RESOURCE_EXHAUSTED]
        assert len(refused) == SILENT - MAX_HANDSHAKES_IN_FLIGHT, ended
        assert {msg for _, msg, _ in refused} == {
            f"{MAX_HANDSHAKES_IN_FLIGHT} handshakes with remote daemons in flight "
            "(the limit); retry later"
        }
        print(
            f"\nhealthy warm pull: {healthy_end - healthy_start:.3f} s while "
            f"{len(hung)} pulls hung on silent peers for "
            f"{min(e for _, _, e in hung) - started:.1f}-{max(e for _, _, e in hung) - started:.1f}"
            f" s; {len(refused)} refused at once"
        )
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        silent.close()
    c.d.assert_healthy()


def _vm_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def _wide(c: Cluster, name: str) -> None:
    """~20,000 groups: refused for the group limit before anything is planned."""
    spec = c.spec([], request_id=name)
    for i in range(20_000):
        spec.groups.add(transfer_group=0, local_block_ids=[i % 24], remote_block_ids=[i % 32])
    spec.capability = "rejected-first"
    code, msg, _ = _pull(c, spec)
    assert code is Code.INVALID_ARGUMENT, (code, msg)
    assert msg == f"groups: 20000 transfer groups exceed the limit of {MAX_GROUPS_PER_TRANSFER}"


def _rejected_round(c: Cluster, round_no: int) -> None:
    """Six pulls the decode daemon refuses INVALID_ARGUMENT only after planning them: close to
    the limit of groups, each request a new layer selection (a new cache key), with a local block
    out of range."""
    for k in range(6):
        n = MAX_GROUPS_PER_TRANSFER - 1 - 6 * round_no - k
        spec = c.spec([], request_id=f"far-{round_no}-{k}")
        for i in range(n):
            spec.groups.add(
                transfer_group=0, local_block_ids=[24], remote_block_ids=[i % 32],
                layer_names=["m0", "m1", "m2"][: 1 + i % 3],
            )  # fmt: skip
        spec.capability = "rejected-after-planning"
        code, msg, _ = _pull(c, spec)
        assert code is Code.INVALID_ARGUMENT and "out of range" in msg, (code, msg)


ROUNDS, FLOOR_ROUNDS = 13, 5
# The allocator handed the transient planning memory (hundreds of MiB a
# round, before planning kept cells of meeting groups instead of their
# pairs) back in a cycle of about four rounds whose phase drifts: one window's floor
# or peak can miss the cycle's by 150 MiB in an unchanged daemon (seen in CI:
# floors 534 -> 685 MiB with peaks 1070 -> 1028 MiB). What this test guards
# against, each refused request's prepared lists kept for good (megabytes per
# request), raises every round: the floor and the peak alike. So a growth of
# both by this much fails; the drift moves one of them.
GROWTH_LIMIT_KIB = 64 * 1024


# RSS is not the CPU's to change: this one shares the machine, with time for it.
@pytest.mark.timeout(600)
def test_rejected_requests_leave_the_daemons_memory_as_it_was(c: Cluster) -> None:
    """Pulls of ~20,000 groups are refused for the group limit; rounds of six pulls of ~1,000
    groups, each a new layer selection, refused only after planning, do not grow the decode
    daemon's RSS by 64 MiB from rounds 2-6 to rounds 9-13 at both its floor and its peak (before
    the fix each was prepared and cached: megabytes per request, for good), and memory and
    workers are intact.
    (Pins: limits are checked, and transfers planned, before anything is prepared or cached.)"""
    assert _pull(c, granted(c, "warm-rss", [7]))[0] is Code.OK
    expect_transfer(c.dw, c.pw, 0, [0], [7])
    for k in range(6):
        _wide(c, f"wide-{k}")
    pid = c.d.daemon.proc.pid
    rss = []
    for r in range(ROUNDS):
        _rejected_round(c, r)
        rss.append(_vm_rss_kib(pid))
    # Planning a refused request allocates transiently (it was hundreds of
    # MiB a round while planning listed every pair of meeting groups; a few
    # MiB now), so the floors of five rounds are compared: what is kept for
    # good raises every later floor, a transient peak does not.
    first, last = rss[1 : 1 + FLOOR_ROUNDS], rss[-FLOOR_ROUNDS:]
    floor_growth, peak_growth = min(last) - min(first), max(last) - max(first)
    print(f"\ndecode daemon RSS per round (KiB): {rss}")
    assert min(floor_growth, peak_growth) < GROWTH_LIMIT_KIB, (
        f"RSS floor grew {floor_growth} KiB and its peak {peak_growth} KiB"
    )
    c.assert_all_intact("after the rejected requests")
    c.d.assert_healthy()
