"""Decode peers that come and go, across a real network link: the churn soak.

One owner (a prefill kvmapd and its worker, blocks filled with the known
pattern) runs on a node of a test bed (``kvmap.tools.netbed``); decode
"pods" come and go on nodes of their own, ``at_once`` of them at a time.
Each is a real kvmapd and a real decode worker on a fresh node (a fresh
address, as a rescheduled pod gets), which pulls ``pulls`` requests of
scattered blocks from the owner over UCX on TCP, verifies every byte, and
leaves one of the ways a pod leaves (``DEPARTURES``, in turn): killed
(SIGKILL), stopped (SIGTERM), its link gone down before it dies, or killed
while a pull is in flight (its daemon, or its link).

The owner must never die, and every pull a live peer asks for must succeed
with verified bytes. Afterwards, once the half-open connections of the
peers whose link went down are closed (TCP and gRPC keepalives; bounded by
``settle_s``), the report gives what the owner holds against its baseline:
RSS, open fds, leases (none may outlive its TTL: sampled throughout), and
the remote NIXL agents its daemon holds.

    python -m kvmap.tools.churn --peers 2000 --at-once 4      # the full soak
    python -m kvmap.tools.churn --peers 300 --json out.json   # CI's size

Needs root (network namespaces); prints a line every ``--every`` peers and
the figures at the end, as JSON with ``--json``. Each decode worker starts
afresh (its imports cost ~2 CPU-s); under the test suite
(tests/multinode/test_churn.py) they are forked from a zygote instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvmap.tools.grants import granted
from kvmap.tools.launch import (
    DaemonProc,
    WorkerProc,
    start_daemon,
    start_worker,
)
from kvmap.tools.netbed import BED_NETWORK, NetBed, Node
from kvmap.tools.node_probe import OwnerProbe, OwnerSample
from kvmap.v1 import admin_pb2

# What every daemon of the bed is started with: it dials and answers the
# bed's network (its peer secret is the harness's, as for every daemon).
BED_PEER_FLAGS = ("--peer-allow", str(BED_NETWORK), "--peer-accept", str(BED_NETWORK))
BLOCKS = 64
GEOMETRY = (
    "--blocks",
    str(BLOCKS),
    "--block-tokens",
    "32",
    "--mla-layers",
    "6",
    "--indexer-layers",
    "3",
)
BLOCKS_PER_PULL = 6
# The decode daemons' deadline: a pull whose peer died waits no longer (a
# loaded CI machine's live pulls stay well inside it).
TENANT_TIMEOUT_S = 15.0

DEPARTURES = ("kill", "sigterm", "link_down", "kill_mid_pull", "link_down_mid_pull")


@dataclass(frozen=True)
class ChurnConfig:
    peers: int = 300
    at_once: int = 4
    pulls: int = 2
    departures: tuple[str, ...] = DEPARTURES
    # How long the owner may take to close the connections of vanished peers.
    settle_s: float = 180.0
    seed: int = 0
    every: int = 50
    # The owner's lease TTL slack: a lease seen this long past its expiry
    # has outlived its TTL (the owner's lease sweep runs every second or so).
    lease_slack_ms: int = 2000
    # The owner's fds may end at most this many above its baseline (the
    # settle waits for it; a negative slack waits out ``settle_s``).
    fd_slack: int = 64

    def __post_init__(self) -> None:
        unknown = set(self.departures) - set(DEPARTURES)
        if unknown or not self.departures:
            raise ValueError(f"departures must be some of {DEPARTURES}, not {sorted(unknown)}")
        if self.peers < 1 or self.at_once < 1 or self.pulls < 1:
            raise ValueError("peers, at_once and pulls must be positive")


@dataclass
class ChurnReport:
    peers: int = 0
    at_once: int = 0
    pulls_ok: int = 0
    pulls_failed: int = 0
    # Pulls of peers that were killed while the pull was in flight: these
    # may fail (their peer is gone), and are counted apart.
    pulls_cut: int = 0
    departures: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    owner_alive: bool = True
    owner_exit: int | None = None
    seconds: float = 0.0
    settle_seconds: float = 0.0
    baseline: dict[str, int] = field(default_factory=dict)
    peak: dict[str, int] = field(default_factory=dict)
    after: dict[str, int] = field(default_factory=dict)
    leases_outlived: list[str] = field(default_factory=list)
    owner_log_fatal: list[str] = field(default_factory=list)

    @property
    def rss_growth_mib(self) -> float:
        return (self.after.get("rss_kib", 0) - self.baseline.get("rss_kib", 0)) / 1024

    @property
    def fd_growth(self) -> int:
        return self.after.get("fds", 0) - self.baseline.get("fds", 0)

    def figures(self) -> dict[str, Any]:
        out = asdict(self)
        out["rss_growth_mib"] = round(self.rss_growth_mib, 1)
        out["fd_growth"] = self.fd_growth
        out["peers_per_second"] = round(self.peers / self.seconds, 2) if self.seconds else 0.0
        return out


class _Owner:
    """The owner's node, daemon and worker; grants are made one at a time
    (the worker answers one command line at a time)."""

    def __init__(self, bed: NetBed, workdir: Path, extra: tuple[str, ...]) -> None:
        self.node = bed.add_node("owner")
        self.daemon = start_daemon(
            workdir / "owner", *BED_PEER_FLAGS, *extra, name="p", node=self.node
        )
        self.worker = start_worker(self.daemon, "prefill", *GEOMETRY, "--fill")
        self._lock = threading.Lock()

    def grant(self, cmd: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            return granted(self.worker, cmd)

    def stop(self) -> None:
        self.worker.stop()
        self.daemon.stop()


def pull_command(rng: random.Random, request_id: str, owner: DaemonProc) -> dict[str, Any]:
    """A pull of ``BLOCKS_PER_PULL`` scattered owner blocks of both groups
    into scattered decode blocks."""
    remote = rng.sample(range(BLOCKS), BLOCKS_PER_PULL)
    local = rng.sample(range(BLOCKS), BLOCKS_PER_PULL)
    return {
        "cmd": "pull",
        "request_id": request_id,
        "remote_target": owner.tcp_target,
        "remote_worker": {"engine_id": "prefill"},
        "groups": [{"group": g, "local": local, "remote": remote} for g in (0, 1)],
    }


def pulled(answer: dict[str, Any]) -> bool:
    return bool(answer.get("ok")) and answer.get("bad_blocks") == 0


class _Tenant:
    """One decode pod: a node, its kvmapd and its worker."""

    def __init__(self, bed: NetBed, workdir: Path, index: int) -> None:
        self.bed = bed
        self.workdir = workdir / f"d{index}"
        self.node: Node = bed.add_node(f"d{index}")
        self.daemon: DaemonProc | None = None
        self.worker: WorkerProc | None = None
        try:
            self.daemon = start_daemon(
                self.workdir,
                *BED_PEER_FLAGS,
                "--transfer-timeout-s",
                str(TENANT_TIMEOUT_S),
                name="d",
                node=self.node,
            )
            self.worker = start_worker(self.daemon, f"decode{index}", *GEOMETRY)
        except BaseException:
            self.gone()
            raise

    def gone(self) -> None:
        """Kill what still runs and remove the node and the folder."""
        for proc in (self.worker, self.daemon):
            if proc is not None:
                proc.kill()
        self.bed.remove_node(self.node.name)
        shutil.rmtree(self.workdir, ignore_errors=True)


class Churn:
    def __init__(self, config: ChurnConfig, workdir: Path, owner_flags: tuple[str, ...] = ()):
        self.config = config
        self.workdir = workdir
        self.owner_flags = owner_flags
        self.report = ChurnReport(peers=config.peers, at_once=config.at_once)
        self._lock = threading.Lock()
        self._next = iter(range(config.peers))

    def run(self, bed: NetBed, progress: Callable[[str], None] = print) -> ChurnReport:
        owner = _Owner(bed, self.workdir, self.owner_flags)
        probe = OwnerProbe(owner.daemon)
        try:
            self.report.baseline = probe.sample().figures()
            self.report.peak = dict(self.report.baseline)
            watcher = _LeaseWatch(probe, self.config.lease_slack_ms, self._observe)
            started = time.monotonic()
            with watcher:
                slots = [
                    threading.Thread(
                        target=self._slot, args=(bed, owner, s, progress), name=f"churn-slot-{s}"
                    )
                    for s in range(self.config.at_once)
                ]
                for t in slots:
                    t.start()
                for t in slots:
                    t.join()
                self.report.seconds = round(time.monotonic() - started, 1)
                self._settle(owner, probe)
            self.report.leases_outlived = watcher.outlived
        finally:
            self.report.owner_alive = owner.daemon.proc.poll() is None
            self.report.owner_exit = owner.daemon.proc.poll()
            self.report.owner_log_fatal = _fatal_lines(owner.daemon.log())
            owner.stop()
        return self.report

    def _observe(self, sample: OwnerSample) -> None:
        with self._lock:
            for k, v in sample.figures().items():
                self.report.peak[k] = max(self.report.peak.get(k, v), v)

    def _settle(self, owner: _Owner, probe: OwnerProbe) -> None:
        """Wait (bounded) until the owner holds no lease and its fds are
        within 64 of the baseline: vanished peers' connections close on
        keepalive, not at once."""
        start = time.monotonic()
        deadline = start + self.config.settle_s
        baseline_fds = self.report.baseline["fds"]
        sample = probe.sample()
        while time.monotonic() < deadline and owner.daemon.proc.poll() is None:
            sample = probe.sample()
            if sample.leases == 0 and sample.fds - baseline_fds <= self.config.fd_slack:
                break
            time.sleep(1.0)
        self.report.settle_seconds = round(time.monotonic() - start, 1)
        self.report.after = sample.figures()

    def _claim(self) -> int | None:
        with self._lock:
            return next(self._next, None)

    def _slot(self, bed: NetBed, owner: _Owner, slot: int, progress: Callable[[str], None]) -> None:
        rng = random.Random(self.config.seed * 1000 + slot)
        while owner.daemon.proc.poll() is None:
            index = self._claim()
            if index is None:
                return
            departure = self.config.departures[index % len(self.config.departures)]
            try:
                self._tenant(bed, owner, index, departure, rng)
            except Exception as err:  # a tenant that could not start is a failure too
                self._fail(f"peer {index} ({departure}): {type(err).__name__}: {err}")
            with self._lock:
                self.report.departures[departure] = self.report.departures.get(departure, 0) + 1
                done = sum(self.report.departures.values())
            if done % self.config.every == 0:
                progress(self._progress_line(done))

    def _progress_line(self, done: int) -> str:
        r = self.report
        return (
            f"churn: {done}/{r.peers} peers, pulls ok {r.pulls_ok} failed {r.pulls_failed}"
            f" cut {r.pulls_cut}; owner peak rss {r.peak.get('rss_kib', 0) // 1024} MiB"
            f" fds {r.peak.get('fds', 0)}"
        )

    def _fail(self, message: str) -> None:
        with self._lock:
            self.report.pulls_failed += 1
            if len(self.report.failures) < 50:
                self.report.failures.append(message)

    def _tenant(
        self, bed: NetBed, owner: _Owner, index: int, departure: str, rng: random.Random
    ) -> None:
        tenant = _Tenant(bed, self.workdir, index)
        try:
            assert tenant.worker is not None and tenant.daemon is not None
            for k in range(self.config.pulls):
                cmd = owner.grant(pull_command(rng, f"churn-{index}-{k}", owner.daemon))
                answer = tenant.worker.call(cmd, timeout=TENANT_TIMEOUT_S + 30)
                if pulled(answer):
                    with self._lock:
                        self.report.pulls_ok += 1
                else:
                    self._fail(f"peer {index} pull {k}: {answer}")
            self._leave(tenant, owner, index, departure, rng)
        finally:
            tenant.gone()

    def _leave(
        self, tenant: _Tenant, owner: _Owner, index: int, departure: str, rng: random.Random
    ) -> None:
        assert tenant.worker is not None and tenant.daemon is not None
        if departure == "kill":
            tenant.daemon.kill()
        elif departure == "sigterm":
            tenant.worker.stop()
            tenant.daemon.stop()
        elif departure == "link_down":
            tenant.bed.link_down(tenant.node.name)
            tenant.daemon.kill()
        else:
            cmd = owner.grant(pull_command(rng, f"churn-{index}-cut", owner.daemon))
            cut = _InFlight(tenant.worker, cmd)
            # Somewhere inside the pull: its handshake is cached, so a few ms
            # in is the owner's BeginTransfer or the read.
            time.sleep(rng.uniform(0.0, 0.02))
            if departure == "link_down_mid_pull":
                tenant.bed.link_down(tenant.node.name)
            tenant.daemon.kill()
            cut.join()
            with self._lock:
                self.report.pulls_cut += 1


class _InFlight(threading.Thread):
    """A worker's pull, in a thread of its own (its answer, whatever it is,
    is not checked: its peer is being killed under it)."""

    def __init__(self, worker: WorkerProc, cmd: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.worker, self.cmd = worker, cmd
        self.start()

    def run(self) -> None:
        # The worker's daemon dies under it: any answer, or none.
        with contextlib.suppress(TimeoutError, RuntimeError, OSError, ValueError):
            self.worker.call(self.cmd, timeout=TENANT_TIMEOUT_S + 30)

    def join(self, timeout: float | None = TENANT_TIMEOUT_S + 35) -> None:
        super().join(timeout)


class _LeaseWatch:
    """Samples the owner every half second while the churn runs: peaks, and
    any lease seen past its expiry by more than the slack."""

    def __init__(
        self, probe: OwnerProbe, slack_ms: int, observe: Callable[[OwnerSample], None]
    ) -> None:
        self._probe, self._slack_ms, self._observe = probe, slack_ms, observe
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="churn-lease-watch", daemon=True)
        self.outlived: list[str] = []

    def __enter__(self) -> _LeaseWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                sample = self._probe.sample(with_leases=True)
            except Exception:  # the owner died: the churn's end reports it
                return
            self._observe(sample)
            for lease in sample.lease_list:
                if lease.expires_in_ms < -self._slack_ms and len(self.outlived) < 50:
                    self.outlived.append(_lease_line(lease))


def _lease_line(lease: admin_pb2.LeaseStatus) -> str:
    return f"{lease.request_id} of {lease.peer_agent}: {-lease.expires_in_ms} ms past its expiry"


def _fatal_lines(log: str) -> list[str]:
    """The owner's log lines that say it died or nearly did."""
    words = ("Assertion", "Caught signal", "terminate called", "Fatal Python error")
    return [line[:400] for line in log.splitlines() if any(w in line for w in words)][:20]


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m kvmap.tools.churn", description=__doc__.split("\n")[0], allow_abbrev=False
    )
    ap.add_argument("--peers", type=int, default=ChurnConfig.peers, help="decode peers in all")
    ap.add_argument("--at-once", type=int, default=ChurnConfig.at_once, help="peers at a time")
    ap.add_argument("--pulls", type=int, default=ChurnConfig.pulls, help="pulls per peer")
    ap.add_argument(
        "--departures",
        default=",".join(DEPARTURES),
        help="how peers leave, in turn (comma-separated)",
    )
    ap.add_argument(
        "--settle-s",
        type=float,
        default=ChurnConfig.settle_s,
        help="seconds the owner may take to close vanished peers' fds",
    )
    ap.add_argument(
        "--fd-slack",
        type=int,
        default=ChurnConfig.fd_slack,
        help="fds the owner may end above its baseline (<0: all of --settle-s)",
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of the block ids")
    ap.add_argument("--every", type=int, default=ChurnConfig.every, help="a line every N peers")
    ap.add_argument("--json", default="", help="write the figures here as JSON")
    ap.add_argument(
        "--workdir", default="", help="folder of the daemons (default: a temporary one)"
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    config = ChurnConfig(
        peers=args.peers,
        at_once=args.at_once,
        pulls=args.pulls,
        departures=tuple(d for d in args.departures.split(",") if d),
        settle_s=args.settle_s,
        fd_slack=args.fd_slack,
        seed=args.seed,
        every=args.every,
    )
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvchurn-"))
    with NetBed("churn") as bed:
        report = Churn(config, workdir).run(bed, lambda line: print(line, flush=True))
    figures = report.figures()
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if verdict(report) == [] else 1


def verdict(report: ChurnReport) -> list[str]:
    """What the soak's goals say of a report: one line per goal missed."""
    missed = []
    if not report.owner_alive:
        missed.append(f"the owner died (exit {report.owner_exit}): {report.owner_log_fatal}")
    if report.pulls_failed:
        missed.append(f"{report.pulls_failed} pulls of live peers failed: {report.failures[:3]}")
    if report.rss_growth_mib > 64:
        missed.append(f"the owner's RSS grew {report.rss_growth_mib:.1f} MiB (at most 64)")
    if report.fd_growth > 64:
        missed.append(f"the owner's fds grew by {report.fd_growth} (at most 64)")
    if report.leases_outlived:
        missed.append(f"leases outlived their TTL: {report.leases_outlived[:3]}")
    if report.after.get("leases", 0):
        missed.append(f"{report.after['leases']} leases left after the settle")
    if report.after.get("remote_agents", 0) > report.baseline.get("remote_agents", 0):
        missed.append("the owner holds more remote agents than before")
    return missed


if __name__ == "__main__":
    sys.exit(main())
