"""Load: N concurrent decode clients x M pulls each against one prefill daemon.

Starts one prefill kvmapd (``coalesce``) and K decode kvmapds (worker i on
daemon i mod K) as real processes. The workers' KV caches are shared-memory
files (memfd) owned by this script and handed to their daemons over the fd
hand-off socket, exactly as a vLLM worker does; the layout is the demo's
GLM-like block-outermost cache (an MLA group and an indexer group). The
prefill cache is filled with seeded random bytes.

Each decode worker is one client thread calling its daemon's
``Transfers.Pull`` over the Unix socket, with the capability the prefill
worker granted for exactly that pull's blocks (outside the latency), as the
vLLM connector does: after one warm-up pull (handshake and descriptor-list
preparation, not counted), all clients start together and each runs M pulls
back to back, each pull B scattered prefill blocks of
both groups into B distinct local blocks. When all are done, every pulled
block of every pull is compared byte for byte with the prefill block it
came from.

Prints pulls, bytes, wall time, throughput (pulls/s, GB/s of KV bytes moved)
and the client round-trip latency of a pull (p50/p99/max), plus the
daemons' own post and completion times; ``--json`` adds one JSON line with
the same figures. Exit status 0 only when every pull succeeded and verified.

    .venv/bin/python -m kvmap.tools.load [--clients 4] [--pulls 50] [--blocks-per-pull 16]

Not a timed test: the figures depend on the machine (see docs/load.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import platform
import random
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt

from kvmap.client.fd_handoff import sealed_memfd, send_fds
from kvmap.tools.demo_worker import INDEXER_TOKEN_BYTES, MLA_TOKEN_BYTES
from kvmap.tools.launch import DaemonProc, start_daemon
from kvmap.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    registry_pb2,
    registry_pb2_grpc,
    transfers_pb2,
    transfers_pb2_grpc,
    types_pb2,
)

CALL_TIMEOUT_S = 120.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m kvmap.tools.load", description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    p.add_argument("--clients", type=int, default=4, help="concurrent decode workers (N)")
    p.add_argument("--pulls", type=int, default=50, help="pulls per client (M)")
    p.add_argument("--decode-daemons", type=int, default=0, help="K; default min(N, 2)")
    p.add_argument("--blocks-per-pull", type=int, default=16, help="B")
    p.add_argument("--prefill-blocks", type=int, default=512)
    p.add_argument("--block-tokens", type=int, default=64)
    p.add_argument("--mla-layers", type=int, default=6)
    p.add_argument("--indexer-layers", type=int, default=3)
    p.add_argument("--decode-planner", default="coalesce", choices=["coalesce", "baseline"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    p.add_argument("--keep", action="store_true", help="keep the work directory and its logs")
    args = p.parse_args(argv)
    if min(args.clients, args.pulls, args.blocks_per_pull, args.prefill_blocks) < 1:
        p.error("--clients, --pulls, --blocks-per-pull and --prefill-blocks must be >= 1")
    if args.blocks_per_pull > args.prefill_blocks:
        p.error("--blocks-per-pull must be <= --prefill-blocks")
    args.decode_daemons = min(args.decode_daemons or min(args.clients, 2), args.clients)
    return args


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    if not sorted_values:
        return float("nan")
    rank = max(1, -(-len(sorted_values) * q // 100))
    return sorted_values[int(rank) - 1]


def machine() -> dict[str, Any]:
    mem_kib = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_kib = int(line.split()[1])
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "mem_gib": round(mem_kib / 2**20, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "transport": "UCX over loopback (UCX_NET_DEVICES=lo)",
    }


class Worker:
    """A registered worker whose KV cache this script owns: one memfd per
    transfer group, mapped here as a ``[blocks, row bytes]`` array."""

    def __init__(self, daemon: DaemonProc, engine_id: str, blocks: int, args: Any) -> None:
        self.daemon = daemon
        self.engine_id = engine_id
        self.blocks = blocks
        self.pages = [
            (types_pb2.CACHE_KIND_MLA, args.mla_layers, args.block_tokens * MLA_TOKEN_BYTES),
            (
                types_pb2.CACHE_KIND_INDEXER,
                args.indexer_layers,
                args.block_tokens * INDEXER_TOKEN_BYTES,
            ),
        ]
        self.fds: list[int] = []
        self._maps: list[mmap.mmap] = []
        self.rows: list[npt.NDArray[np.uint8]] = []
        for g, (_, layers, page) in enumerate(self.pages):
            size = blocks * layers * page
            fd = sealed_memfd(f"{engine_id}-g{g}", size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            self.fds.append(fd)
            self._maps.append(mm)
            self.rows.append(np.frombuffer(mm, dtype=np.uint8).reshape(blocks, layers * page))
        self.channel = grpc.insecure_channel(daemon.unix_target)
        self.transfers = transfers_pb2_grpc.TransfersStub(self.channel)
        self._attach: Any = None

    @property
    def worker_id(self) -> types_pb2.WorkerId:
        return types_pb2.WorkerId(engine_id=self.engine_id)

    def fill(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        for rows in self.rows:
            rows[:] = rng.integers(0, 256, rows.shape, dtype=np.uint8)

    def register(self) -> types_pb2.RegionMap:
        token = send_fds(self.daemon.socket + ".fds", self.fds, 30)
        req = registry_pb2.RegisterWorkerRequest(
            worker=self.worker_id, kv_cache_layout="BLHNC", block_size_tokens=16
        )
        first = 0
        for g, (kind, layers, page) in enumerate(self.pages):
            alloc = f"kv-group{g}"
            req.allocations.add(
                id=alloc,
                size_bytes=self.rows[g].nbytes,
                device=types_pb2.Device(type=types_pb2.DEVICE_TYPE_CPU),
                shm_fd=types_pb2.ShmFdHandle(token=token, index=g),
            )
            for li in range(layers):
                req.views.add(
                    layer_name=f"model.layers.{first + li}.{'attn' if g == 0 else 'indexer'}",
                    allocation_id=alloc,
                    transfer_group=g,
                    cache_kind=kind,
                    dtype="uint8",
                    offset_bytes=li * page,
                    block_len_bytes=page,
                    block_stride_bytes=layers * page,
                    num_blocks=self.blocks,
                )
            first += layers
        stub = registry_pb2_grpc.RegistryStub(self.channel)
        return stub.RegisterWorker(req, timeout=CALL_TIMEOUT_S).region_map

    def attach(self) -> None:
        """Keep the worker's Attach stream open, as a vLLM worker does: its
        daemon grants transfers of attached workers only. Events are drained
        on a thread."""
        stub = registry_pb2_grpc.RegistryStub(self.channel)
        self._attach = stub.Attach(registry_pb2.AttachRequest(worker=self.worker_id))
        next(self._attach)  # the "attached" event: the daemon has the stream

        def drain() -> None:
            with contextlib.suppress(grpc.RpcError):
                for _ in self._attach:
                    pass

        threading.Thread(target=drain, daemon=True, name=f"attach-{self.engine_id}").start()

    def grant(self, request_id: str, blocks: list[int]) -> str:
        """As a vLLM prefill worker does: the capability that lets one peer
        pull exactly ``blocks`` of both groups of this worker for ``request_id``."""
        req = registry_pb2.GrantTransferRequest(
            worker=self.worker_id,
            request_id=request_id,
            groups=[types_pb2.BlockGrant(transfer_group=g, block_ids=blocks) for g in (0, 1)],
        )
        stub = registry_pb2_grpc.RegistryStub(self.channel)
        return str(stub.GrantTransfer(req, timeout=CALL_TIMEOUT_S).capability)

    def close(self) -> None:
        if self._attach is not None:
            self._attach.cancel()
        self.channel.close()
        self.rows.clear()
        for mm in self._maps:
            mm.close()
        for fd in self.fds:
            os.close(fd)


class Client:
    """One decode worker and its pulls; every pull writes a fresh chunk of a
    per-client permutation of local blocks, so all can be verified at the end."""

    def __init__(self, index: int, worker: Worker, owner: Worker, args: argparse.Namespace) -> None:
        self.index = index
        self.worker = worker
        self.owner = owner  # the prefill worker: it grants each pull
        rng = random.Random(args.seed * 1000 + index)
        b = args.blocks_per_pull
        local = list(range((args.pulls + 1) * b))
        rng.shuffle(local)
        self.plans = [
            (local[i * b : (i + 1) * b], rng.sample(range(args.prefill_blocks), b))
            for i in range(args.pulls + 1)
        ]  # plans[0] is the warm-up
        self.latencies: list[float] = []
        self.stats: list[transfers_pb2.TransferStats] = []
        self.errors: list[str] = []
        self.failed: set[int] = set()

    def request_id(self, i: int) -> str:
        return f"load-{self.index}-{i}"

    def grant(self, i: int) -> str:
        return self.owner.grant(self.request_id(i), self.plans[i][1])

    def pull(self, target: str, i: int, capability: str = "") -> transfers_pb2.TransferStats:
        """Pull ``plans[i]`` with ``capability`` (granted here when not given)."""
        local, remote = self.plans[i]
        spec = transfers_pb2.TransferSpec(
            request_id=self.request_id(i),
            local_worker=self.worker.worker_id,
            remote_target=target,
            remote_worker=types_pb2.WorkerId(engine_id="prefill"),
            capability=capability or self.grant(i),
        )
        for group in (0, 1):
            spec.groups.add(transfer_group=group, local_block_ids=local, remote_block_ids=remote)
        last = None
        for resp in self.worker.transfers.Pull(
            transfers_pb2.PullRequest(spec=spec), timeout=CALL_TIMEOUT_S
        ):
            last = resp.status
        if last is None or last.state != transfers_pb2.TRANSFER_STATE_DONE:
            raise RuntimeError(f"pull {spec.request_id} ended without DONE: {last}")
        return last.stats

    def run(self, target: str, start: threading.Barrier) -> None:
        start.wait()
        for i in range(1, len(self.plans)):
            try:
                # The prefill side's grant is not part of the pull's latency.
                capability = self.grant(i)
                t0 = time.perf_counter()
                stats = self.pull(target, i, capability)
            except (grpc.RpcError, RuntimeError) as err:
                self.errors.append(f"{type(err).__name__}: {err}")
                self.failed.add(i)
                continue
            self.latencies.append(time.perf_counter() - t0)
            self.stats.append(stats)

    def verify(self, prefill: Worker) -> list[int]:
        """Bad blocks (both groups) of each successful counted pull, read from memory."""
        bad = []
        for i, (local, remote) in enumerate(self.plans):
            if i == 0 or i in self.failed:
                continue
            n = 0
            for mine, theirs in zip(self.worker.rows, prefill.rows, strict=True):
                n += int(np.count_nonzero((mine[local] != theirs[remote]).any(axis=1)))
            bad.append(n)
        return bad


def _served(daemon: DaemonProc, expected: int, wait_s: float = 5.0) -> int:
    """Transfers the prefill daemon saw finish (its NIXL notifications may
    trail the pullers' DONE by a moment: wait, bounded, for ``expected``)."""
    deadline = time.monotonic() + wait_s
    with grpc.insecure_channel(daemon.unix_target) as ch:
        while True:
            stats = admin_pb2_grpc.AdminStub(ch).GetStats(admin_pb2.GetStatsRequest(), timeout=10)
            served = int(stats.transfers.served_done)
            if served >= expected or time.monotonic() > deadline:
                return served
            time.sleep(0.05)


@dataclass(frozen=True)
class Outcome:
    """What one load run saw, before it is summed up."""

    clients: list[Client]
    warmup: list[transfers_pb2.TransferStats]  # each client's first pull
    bad: list[int]  # bad blocks per counted successful pull
    served: int  # transfers the prefill daemon saw finish
    bytes_per_block: int
    setup_s: float
    warmup_s: float
    wall_s: float
    verify_s: float


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    daemons: list[DaemonProc] = []
    workers: list[Worker] = []
    try:
        t0 = time.perf_counter()
        daemons.extend(_start_daemons(args, work))
        prefill, clients = _register_workers(args, daemons, workers)
        setup_s = time.perf_counter() - t0
        target = daemons[0].tcp_target
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            warmup = list(pool.map(lambda c: c.pull(target, 0), clients))
        warmup_s = time.perf_counter() - t0
        wall_s = _pull_together(clients, target)
        t0 = time.perf_counter()
        bad = [n for c in clients for n in c.verify(prefill)]
        verify_s = time.perf_counter() - t0
        done_pulls = sum(len(c.stats) for c in clients) + len(clients)
        served = _served(daemons[0], done_pulls)
    finally:
        _stop(workers, daemons)
    outcome = Outcome(
        clients=clients,
        warmup=warmup,
        bad=bad,
        served=served,
        bytes_per_block=sum(layers * page for _, layers, page in prefill.pages),
        setup_s=setup_s,
        warmup_s=warmup_s,
        wall_s=wall_s,
        verify_s=verify_s,
    )
    return figures(args, outcome)


def _start_daemons(args: argparse.Namespace, work: Path) -> list[DaemonProc]:
    """The prefill daemon, then the decode ones, started in parallel."""
    with ThreadPoolExecutor(args.decode_daemons + 1) as pool:
        futures = [pool.submit(start_daemon, work / "prefill", name="prefill")] + [
            pool.submit(
                start_daemon,
                work / f"decode{k}",
                "--planner",
                args.decode_planner,
                name=f"decode{k}",
            )
            for k in range(args.decode_daemons)
        ]
        return [f.result() for f in futures]


def _register_workers(
    args: argparse.Namespace, daemons: list[DaemonProc], workers: list[Worker]
) -> tuple[Worker, list[Client]]:
    """The filled prefill worker and one client per decode worker (worker i on
    decode daemon i mod K), all registered; each joins ``workers`` as soon as
    it exists so that the caller closes it whatever happens next."""
    prefill_daemon, decodes = daemons[0], daemons[1:]
    prefill = Worker(prefill_daemon, "prefill", args.prefill_blocks, args)
    workers.append(prefill)
    prefill.fill(args.seed)
    prefill.register()
    prefill.attach()
    local_blocks = (args.pulls + 1) * args.blocks_per_pull
    clients = []
    for i in range(args.clients):
        w = Worker(decodes[i % len(decodes)], f"decode-{i}", local_blocks, args)
        workers.append(w)
        w.register()
        clients.append(Client(i, w, prefill, args))
    return prefill, clients


def _pull_together(clients: list[Client], target: str) -> float:
    """Start every client's pulls at once; seconds until the last is done."""
    start = threading.Barrier(len(clients) + 1)
    threads = [threading.Thread(target=c.run, args=(target, start)) for c in clients]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def _stop(workers: list[Worker], daemons: list[DaemonProc]) -> None:
    for w in workers:
        w.close()
    with ThreadPoolExecutor(max(1, len(daemons))) as pool:
        for d, rc in zip(daemons, pool.map(DaemonProc.terminate, daemons), strict=True):
            if rc != 0:
                print(f"warning: {d.log_path} exited {rc}", file=sys.stderr)


def _ms(seconds: float, digits: int) -> float:
    return round(seconds * 1e3, digits)


def figures(args: argparse.Namespace, o: Outcome) -> dict[str, Any]:
    """The figures ``report`` prints and ``--json`` writes."""
    lat = sorted(x for c in o.clients for x in c.latencies)
    stats = [s for c in o.clients for s in c.stats]
    errors = [e for c in o.clients for e in c.errors]
    post = sorted(s.post_seconds for s in stats)
    done = sorted(s.completion_seconds for s in stats)
    total_bytes = sum(s.bytes for s in stats)
    pulls = len(stats)
    return {
        "machine": machine(),
        "clients": args.clients,
        "pulls_per_client": args.pulls,
        "decode_daemons": args.decode_daemons,
        "decode_planner": args.decode_planner,
        "blocks_per_pull": args.blocks_per_pull,
        "bytes_per_block": o.bytes_per_block,
        "bytes_per_pull": o.bytes_per_block * args.blocks_per_pull,
        "descriptors_per_pull": int(stats[0].descriptors) if stats else 0,
        "setup_s": round(o.setup_s, 2),
        "warmup_s": round(o.warmup_s, 3),
        "warmup_handshaked": sum(1 for s in o.warmup if s.handshaked),
        "verify_s": round(o.verify_s, 2),
        "pulls": pulls + len(errors),
        "failed_pulls": len(errors),
        "first_error": errors[0] if errors else None,
        "verified_pulls": sum(1 for n in o.bad if n == 0),
        "bad_blocks": sum(o.bad),
        "prefill_served": o.served,
        "wall_s": round(o.wall_s, 3),
        "pulls_per_s": round(pulls / o.wall_s, 1),
        "gb_per_s": round(total_bytes / o.wall_s / 1e9, 3),
        "p50_ms": _ms(percentile(lat, 50), 2),
        "p99_ms": _ms(percentile(lat, 99), 2),
        "max_ms": _ms(lat[-1], 2) if lat else float("nan"),
        "post_p50_ms": _ms(percentile(post, 50), 3),
        "post_p99_ms": _ms(percentile(post, 99), 3),
        "completion_p50_ms": _ms(percentile(done, 50), 3),
        "completion_p99_ms": _ms(percentile(done, 99), 3),
    }


def ok(r: dict[str, Any]) -> bool:
    return bool(
        r["failed_pulls"] == 0 and r["bad_blocks"] == 0 and r["verified_pulls"] == r["pulls"]
    )


def report(r: dict[str, Any]) -> str:
    m = r["machine"]
    lines = [
        f"kvmap load: 1 prefill daemon, {r['decode_daemons']} decode daemon(s) "
        f"({r['decode_planner']}), {r['clients']} decode clients x {r['pulls_per_client']} pulls",
        f"  machine      {m['cpus']} CPUs, {m['mem_gib']} GiB, {m['platform']}, {m['transport']}",
        f"  setup        {r['setup_s']:.1f} s; warm-up (handshake) {r['warmup_s'] * 1e3:.0f} ms; "
        f"verification {r['verify_s']:.1f} s",
        f"  pull         {r['blocks_per_pull']} blocks x 2 groups = "
        f"{r['bytes_per_pull'] / 1e6:.2f} MB in {r['descriptors_per_pull']} descriptors",
        f"  pulls        {r['pulls']}: {r['failed_pulls']} failed, {r['verified_pulls']} verified "
        f"byte for byte ({r['bad_blocks']} bad blocks); prefill served {r['prefill_served']} "
        f"(with {r['clients']} warm-up)",
        f"  wall         {r['wall_s']:.2f} s",
        f"  throughput   {r['pulls_per_s']:.1f} pulls/s, {r['gb_per_s']:.3f} GB/s",
        f"  latency      p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms, "
        f"max {r['max_ms']:.2f} ms (Pull round trip seen by the client)",
        f"  daemon       post p50 {r['post_p50_ms']:.3f} / p99 {r['post_p99_ms']:.3f} ms, "
        f"completion p50 {r['completion_p50_ms']:.3f} / p99 {r['completion_p99_ms']:.3f} ms",
    ]
    if r["first_error"]:
        lines.append(f"  first error  {r['first_error']}")
    lines.append("kvmap load: every pull verified" if ok(r) else "kvmap load: FAILED")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="kvmap-load-"))
    try:
        result = run(args, work)
    finally:
        if args.keep:
            print(f"work directory kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(report(result), flush=True)
    if args.json:
        print(json.dumps(result), flush=True)
    return 0 if ok(result) else 1


if __name__ == "__main__":
    sys.exit(main())
