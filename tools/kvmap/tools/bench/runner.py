"""The benchmark run: for each profile and planner, two real daemons (prefill
and decode, separate processes, real NIXL agents over loopback UCX) and one
bench worker process next to each; register, handshake, pull, verify, and
collect the figures as a ``results.BenchResult``.

What is measured where (``docs/benchmarks.md`` has the long version):

- ``full`` worker, full-scale geometry on sparse memfds (nothing is touched
  but the blocks a pull moves): regions, registered descriptors, NIXL
  registrations, agent metadata and region-map bytes, ready time
  (RegisterWorker round trip: fd hand-off, import, validate, plan, NIXL
  register, prepare the local list), first-contact cost (end to end through
  the daemons, and step by step in ``contact``), pull bandwidth at full page
  size, daemon resident memory.
- ``req`` worker, the same geometry with every page divided by a stated
  power of two so that a 128K-token request fits in memory: layers, blocks
  and block ids are untouched, so descriptors per transfer are exactly the
  full-scale ones (cross-checked against ``plan_transfer`` on the full-scale
  maps). Post time (``make_prepped_xfer`` + ``transfer``, as the daemon
  reports it) and completion time of the scattered and the contiguous request.
- ``desc`` worker, pages divided until the scattered request moves at most
  ``descriptor_budget``: post time as descriptor work alone.
- ``c0..`` workers, pages divided until the largest concurrency level fits
  ``concurrency_budget``: N scattered requests with distinct blocks in
  flight at once (``pull_many``), post and Pull-to-DONE percentiles.
- Raw NIXL (``raw_nixl``): two bare agents in two more processes, the same
  geometries, posting the lists each planner's daemon posts, after each
  kvmap series; and the TP pod (``pod``) on a daemon of its own.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import os
import platform
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from kvmap.core import convert
from kvmap.core import planner as planners
from kvmap.core.geometry import RegionMapModel, WorkerGeometry
from kvmap.core.transfer_pieces import LayerSelection, build_piece_table
from kvmap.core.transfer_plan import GroupPairs, plan_transfer
from kvmap.tools.bench import blockpool
from kvmap.tools.bench.profiles import Profile, get_profile
from kvmap.tools.bench.raw_nixl import RawPair
from kvmap.tools.bench.results import (
    CONCURRENCY,
    RATIO_KEYS,
    SCHEMA,
    BandwidthRequest,
    BenchResult,
    Concurrency,
    Fragmentation,
    LatencySamples,
    Machine,
    PlannerResult,
    ProfileInfo,
    RawNixl,
    Rss,
    Samples,
    SeriesSamples,
    TimingScale,
    ratio,
)
from kvmap.tools.bench.worker import packed_ids
from kvmap.tools.launch import DaemonProc, WorkerProc, spawn_worker, start_daemon
from kvmap.v1 import peer_pb2, peer_pb2_grpc, types_pb2

MIB = 1024 * 1024
WORKER_TIMEOUT_S = 180.0
PREFILL_SEED, DECODE_SEED = 1, 2

Ids = list[list[int]]  # block ids per request group


@dataclass
class Options:
    profiles: list[str]
    planners: list[str]
    repeats: int = 5
    # Largest request (bytes per side) the 128K-token requests may move.
    request_budget: int = 128 * MIB
    # Bytes per side of the full-page-size bandwidth request.
    bandwidth_budget: int = 256 * MIB
    memcpy_bytes: int = 256 * MIB
    contact_repeats: int = 20
    # Scattered 128K-token pulls in flight at once, and the bytes per side
    # all of the largest level's requests may move together.
    concurrency: tuple[int, ...] = CONCURRENCY
    concurrency_budget: int = 64 * MIB
    # The descriptor-cost request: pages divided until it moves at most this.
    descriptor_budget: int = 2 * MIB
    # The TP pod: this profile's full-scale workers on one daemon (None: skip).
    tp8_profile: str | None = "glm53"
    tp8_workers: int = 8
    progress: Callable[[str], None] = field(default=lambda line: None)


# Requests -------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """Block ids per request group, on each side."""

    groups: tuple[int, ...]
    local: Ids
    remote: Ids

    def spec(self) -> list[dict[str, Any]]:
        return [
            {"group": g, "local": loc, "remote": rem}
            for g, loc, rem in zip(self.groups, self.local, self.remote, strict=True)
        ]

    def head(self, k: int) -> Request:
        """The first ``k`` blocks of every group."""
        return Request(self.groups, [ids[:k] for ids in self.local], [r[:k] for r in self.remote])


def _own_counts(profile: Profile) -> tuple[list[int], list[bool]]:
    """Blocks per request group, and which groups draw ids of their own."""
    counts = [profile.group_blocks(g) for g in profile.request_groups]
    own = [i == 0 or g.own_blocks for i, g in enumerate(profile.request_groups)]
    return [n if o else 0 for n, o in zip(counts, own, strict=True)], own


def _complete(profile: Profile, drawn: Ids) -> Ids:
    # A group without its own block table uses the first group's ids; a
    # windowed one only the last blocks of them.
    counts = [profile.group_blocks(g) for g in profile.request_groups]
    _, own = _own_counts(profile)
    return [d if o else drawn[0][-n:] for d, n, o in zip(drawn, counts, own, strict=True)]


def _request_ids(profile: Profile, draw: Callable[[list[int]], Ids]) -> Ids:
    return _complete(profile, draw(_own_counts(profile)[0]))


def concurrent_requests(profile: Profile, n: int) -> tuple[int, list[tuple[int, Request]]]:
    """``n`` scattered requests in flight at once, with distinct block sets
    on each side: (worker pairs needed, [(worker pair, request)]). Request i
    goes to pair ``i % pairs``; a pair holds as many as its pool can."""
    counts, _ = _own_counts(profile)
    groups = tuple(g.transfer_group for g in profile.request_groups)
    pairs = -(-n // blockpool.per_pool(profile.num_blocks, counts))
    per_pair: list[list[Request]] = []
    for w in range(pairs):
        k = len(range(w, n, pairs))
        local, remote = (
            blockpool.scattered_many(
                profile.num_blocks, profile.block_tokens, counts, k, seed + 1000 * (w + 1)
            )
            for seed in (DECODE_SEED, PREFILL_SEED)
        )
        per_pair.append(
            [
                Request(groups, _complete(profile, loc), _complete(profile, rem))
                for loc, rem in zip(local, remote, strict=True)
            ]
        )
    return pairs, [(i % pairs, per_pair[i % pairs][i // pairs]) for i in range(n)]


def requests(profile: Profile) -> tuple[Request, Request]:
    """(scattered, contiguous) 128K-token requests of ``profile``."""
    groups = tuple(g.transfer_group for g in profile.request_groups)

    def scattered(seed: int) -> Ids:
        return _request_ids(
            profile,
            lambda counts: blockpool.scattered(
                profile.num_blocks, profile.block_tokens, counts, seed
            ),
        )

    fresh = _request_ids(profile, lambda counts: blockpool.contiguous(profile.num_blocks, counts))
    return (
        Request(groups, scattered(DECODE_SEED), scattered(PREFILL_SEED)),
        Request(groups, fresh, [list(ids) for ids in fresh]),
    )


def _views_bytes(geometry: WorkerGeometry, group: int) -> int:
    """Bytes one block of ``group`` holds over all its views."""
    return sum(v.block_len_bytes for v in geometry.views if v.transfer_group == group)


def request_bytes(geometry: WorkerGeometry, req: Request) -> int:
    return sum(
        len(ids) * _views_bytes(geometry, g) for g, ids in zip(req.groups, req.local, strict=True)
    )


def timing_divisor(profile: Profile, req: Request, budget: int) -> int:
    """Smallest power of two the pages are divided by for ``req`` to fit ``budget``."""
    divisor = 1
    while request_bytes(profile.geometry(divisor), req) > budget and divisor < 1 << 20:
        divisor *= 2
    return divisor


def bandwidth_blocks(geometry: WorkerGeometry, req: Request, budget: int) -> int:
    """Most blocks per group whose full-page bytes fit ``budget`` (at least 1)."""
    k = 1
    longest = max(len(ids) for ids in req.local)
    while k < longest and request_bytes(geometry, req.head(k + 1)) <= budget:
        k += 1
    return k


# Processes -------------------------------------------------------------------


def _start_daemons(workdir: Path, planners_: list[str]) -> dict[str, tuple[DaemonProc, DaemonProc]]:
    """Start a prefill and a decode daemon per planner, all at once."""
    out: dict[tuple[str, str], DaemonProc] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def start(planner: str, side: str) -> None:
        try:
            d = start_daemon(workdir / planner / side, "--planner", planner, name=side)
        except BaseException as err:
            with lock:
                errors.append(err)
            return
        with lock:
            out[(planner, side)] = d

    threads = [
        threading.Thread(target=start, args=(p, side))
        for p in planners_
        for side in ("prefill", "decode")
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for d in out.values():
            d.kill()
        raise errors[0]
    return {p: (out[(p, "prefill")], out[(p, "decode")]) for p in planners_}


def _start_worker(daemon: DaemonProc, side: str) -> WorkerProc:
    return spawn_worker(
        daemon, "kvmap.tools.bench.worker", [], f"bench-worker-{side}", WORKER_TIMEOUT_S
    )


def _call(w: WorkerProc, cmd: dict[str, Any]) -> dict[str, Any]:
    out = w.call(cmd, timeout=WORKER_TIMEOUT_S)
    if not out.get("ok"):
        raise RuntimeError(f"bench worker {cmd['cmd']} failed: {out.get('code')}: {out}")
    return out


def daemon_rss(pid: int) -> int:
    """The daemon's own resident memory: RSS minus the shared KV-cache pages
    it maps (those belong to the worker and are counted there)."""
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            key, _, rest = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                fields[key] = int(rest.split()[0]) * 1024
    return fields.get("RssAnon", 0) + fields.get("RssFile", 0)


def agent_metadata(target: str, engine_id: str) -> peer_pb2.GetAgentMetadataResponse:
    """What a peer downloads at first contact (the Peer handshake)."""
    with grpc.insecure_channel(
        target, options=[("grpc.max_receive_message_length", 64 * MIB)]
    ) as ch:
        stub = peer_pb2_grpc.PeerStub(ch)
        resp: peer_pb2.GetAgentMetadataResponse = stub.GetAgentMetadata(
            peer_pb2.GetAgentMetadataRequest(worker=types_pb2.WorkerId(engine_id=engine_id)),
            timeout=30,
        )
    return resp


class Pair:
    """A planner's two daemons (prefill, decode) and a bench worker next to
    each. The decode worker pulls; the prefill worker owns the source."""

    def __init__(
        self, stack: contextlib.ExitStack, planner: str, daemons: tuple[DaemonProc, DaemonProc]
    ) -> None:
        self.planner = planner
        self.prefill, self.decode = daemons
        stack.callback(self.prefill.stop)
        stack.callback(self.decode.stop)
        self.pw = _start_worker(self.prefill, "prefill")
        stack.callback(self.pw.stop)
        self.dw = _start_worker(self.decode, "decode")
        stack.callback(self.dw.stop)
        self.pulls = 0

    def register(self, side: str, name: str, profile: str, divisor: int) -> dict[str, Any]:
        """Register worker ``<side>-<name>`` with the profile's geometry."""
        return _call(
            self.pw if side == "prefill" else self.dw,
            {
                "cmd": "register",
                "name": name,
                "engine_id": f"{side}-{name}",
                "profile": profile,
                "divisor": divisor,
            },
        )

    def pull(self, name: str, req: Request, remote: str = "") -> dict[str, Any]:
        """Decode worker ``name`` pulls ``req`` from prefill worker ``remote``
        (default: the prefill worker of the same name), with the capability
        that worker granted for exactly those blocks (outside the timing)."""
        return _call(self.dw, self._pull_cmd(name, req, remote))

    def pull_many(
        self, pulls: list[tuple[str, Request, str]], cpu: dict[str, float] | None = None
    ) -> list[dict[str, Any]]:
        """Every (decode worker, request, prefill worker) pull in flight at
        once (granted first, outside the timing); their answers in order.
        With ``cpu``, the pulls' CPU seconds are added to it by place
        (``CPU_PLACES``; the grants are outside the count, as the timing)."""
        cmds = [self._pull_cmd(name, req, remote) for name, req, remote in pulls]
        if cpu is None:
            out: list[dict[str, Any]] = _call(self.dw, {"cmd": "pull_many", "pulls": cmds})["pulls"]
            return out
        # The window opens once the worker has read the command, built the
        # specs and started the threads (harness work, not the client's) and
        # closes when the last pull is DONE and answered.
        _call(self.dw, {"cmd": "stage_pulls", "pulls": cmds})
        before = cpu_now(self)
        out = _call(self.dw, {"cmd": "release_pulls"})["pulls"]
        for k, v in cpu_now(self).items():
            # A thread's tick can land between the two reads that split
            # main thread from the rest: never count less than nothing.
            cpu[k] = cpu.get(k, 0.0) + max(0.0, v - before[k])
        return out

    def _pull_cmd(self, name: str, req: Request, remote: str) -> dict[str, Any]:
        self.pulls += 1
        owner = remote or name
        request_id = f"bench-{name}-{self.pulls}"
        blocks: dict[int, dict[int, None]] = {}
        for g, ids in zip(req.groups, req.remote, strict=True):
            blocks.setdefault(g, {}).update(dict.fromkeys(ids))
        grant = _call(
            self.pw,
            {
                "cmd": "grant",
                "name": owner,
                "request_id": request_id,
                "groups": [{"group": g, "blocks": list(ids)} for g, ids in blocks.items()],
            },
        )
        return {
            "cmd": "pull",
            "name": name,
            "request_id": request_id,
            "remote_target": self.prefill.tcp_target,
            "remote_engine_id": f"prefill-{owner}",
            # Packed ids: json reads thousands of numbers per group 4x
            # slower than their base64 (``worker._ids``).
            "groups": [
                {
                    "group": g["group"],
                    "local": packed_ids(g["local"]),
                    "remote": packed_ids(g["remote"]),
                }
                for g in req.spec()
            ],
            "capability": grant["capability"],
        }

    def fill(self, name: str, req: Request) -> None:
        """Write the pattern into the source blocks of ``req``."""
        groups = [
            {"group": g, "blocks": ids} for g, ids in zip(req.groups, req.remote, strict=True)
        ]
        _call(self.pw, {"cmd": "fill", "name": name, "groups": groups})

    def zero(self, name: str, req: Request) -> None:
        _call(self.dw, {"cmd": "zero", "name": name, "groups": req.spec()})

    def verify(self, name: str, req: Request) -> tuple[int, int]:
        """(bytes checked, blocks that differ) of ``req``'s destination."""
        out = _call(self.dw, {"cmd": "verify", "name": name, "groups": req.spec()})
        return int(out["bytes"]), int(out["bad_blocks"])

    def contact(self, profile: str, repeats: int) -> dict[str, Any]:
        """First-contact steps timed in the decode worker (bench.contact)."""
        return _call(
            self.dw,
            {
                "cmd": "contact",
                "remote_target": self.prefill.tcp_target,
                "remote_engine_id": "prefill-full",
                "profile": profile,
                "planner": self.planner,
                "repeats": repeats,
            },
        )

    def rss(self) -> Rss:
        return Rss(
            prefill=daemon_rss(self.prefill.proc.pid), decode=daemon_rss(self.decode.proc.pid)
        )

    def notified(self) -> int:
        """Transfers the prefill worker was told of (TransferFinished events)."""
        return int(_call(self.pw, {"cmd": "events"})["finished"])


# Measurement -----------------------------------------------------------------


def memcpy_gbps(nbytes: int, rounds: int = 5) -> float:
    """Single-thread memcpy between two resident buffers: the physical limit
    a single-stream CPU pull can approach. Median of ``rounds``."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    np.copyto(dst, src)  # touch both
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        np.copyto(dst, src)
        samples.append(time.perf_counter() - start)
    return nbytes / statistics.median(samples) / 1e9


def memcpy_all_cores_gbps(nbytes: int, rounds: int = 5) -> float:
    """Every core copying its own slice of two resident buffers at once
    (numpy releases the GIL while it copies). Median of ``rounds``."""
    cores = max(1, os.cpu_count() or 1)
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    np.copyto(dst, src)
    cuts = np.linspace(0, nbytes, cores + 1).astype(int)
    slices = [slice(int(a), int(b)) for a, b in itertools.pairwise(cuts)]

    def copy(sl: slice, gate: threading.Barrier) -> None:
        gate.wait()
        np.copyto(dst[sl], src[sl])

    samples = []
    for _ in range(rounds):
        gate = threading.Barrier(cores + 1)
        threads = [threading.Thread(target=copy, args=(sl, gate)) for sl in slices]
        for t in threads:
            t.start()
        gate.wait()
        start = time.perf_counter()
        for t in threads:
            t.join()
        samples.append(time.perf_counter() - start)
    return nbytes / statistics.median(samples) / 1e9


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _order(runs: list[PlannerRun], i: int) -> list[PlannerRun]:
    """The planners in round ``i``: reversed every other round (ABBA), so that
    a change in machine load while the bench runs hits every planner alike."""
    return runs if i % 2 == 0 else runs[::-1]


def _rounds(runs: list[PlannerRun], n: int) -> list[PlannerRun]:
    return [run for i in range(n) for run in _order(runs, i)]


@dataclass
class PullSeries:
    """Timed pulls of one request: samples as the daemon reported them."""

    descriptors: int = 0
    bytes: int = 0
    post: list[float] = field(default_factory=list)
    completion: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)
    verified_bytes: int = 0
    bad_blocks: int = 0

    def add(self, out: dict[str, Any]) -> None:
        st = out["stats"]
        self.descriptors = int(st["descriptors"])
        self.bytes = int(st["bytes"])
        self.post.append(float(st["post_seconds"]))
        self.completion.append(float(st["completion_seconds"]))
        self.wall.append(float(out["wall_seconds"]))

    @property
    def transfer(self) -> list[float]:
        return [p + c for p, c in zip(self.post, self.completion, strict=True)]

    def samples(self) -> SeriesSamples:
        return SeriesSamples(
            post_seconds=self.post, completion_seconds=self.completion, wall=self.wall
        )


NO_RSS = Rss(prefill=0, decode=0)  # not measured yet


# Where a concurrency round's CPU time is counted: each daemon's event loop
# (its main thread) and its other threads (the NIXL thread above all, and
# grpc's), and the decode bench worker (the stand-in vLLM worker).
CPU_PLACES = (
    "prefill_loop",
    "prefill_threads",
    "decode_loop",
    "decode_threads",
    "decode_worker",
)


def _stat_cpu(path: str) -> float:
    """utime + stime of a /proc stat file, in seconds."""
    with open(path, encoding="ascii") as f:
        utime, stime = f.read().rpartition(")")[2].split()[11:13]
    return (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")


def _process_cpu(pid: int) -> tuple[float, float]:
    """(main thread, other threads) CPU seconds of a process so far. The
    process's own stat counts every thread, those that ended included, so
    a thread ending between two readings takes nothing away."""
    main = _stat_cpu(f"/proc/{pid}/task/{pid}/stat")
    return main, _stat_cpu(f"/proc/{pid}/stat") - main


def cpu_now(pair: Pair) -> dict[str, float]:
    """CPU seconds so far in each of ``CPU_PLACES`` of a planner's pair."""
    p_loop, p_threads = _process_cpu(pair.prefill.proc.pid)
    d_loop, d_threads = _process_cpu(pair.decode.proc.pid)
    worker = sum(_process_cpu(pair.dw.pid))
    return dict(zip(CPU_PLACES, (p_loop, p_threads, d_loop, d_threads, worker), strict=True))


@dataclass
class Latency:
    """Every pull of one concurrency level: kvmap's and raw NIXL's, and the
    CPU time the rounds took (``CPU_PLACES``)."""

    post: list[float] = field(default_factory=list)
    pull: list[float] = field(default_factory=list)
    raw_post: list[float] = field(default_factory=list)
    raw_pull: list[float] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)

    def figures(self) -> Concurrency:
        return Concurrency(
            post_p50_seconds=_pct(self.post, 50),
            post_p95_seconds=_pct(self.post, 95),
            post_max_seconds=max(self.post, default=0.0),
            pull_p50_seconds=_pct(self.pull, 50),
            pull_p95_seconds=_pct(self.pull, 95),
            cpu_seconds_per_pull={k: v / len(self.pull) for k, v in self.cpu.items() if self.pull},
        )

    def samples(self) -> LatencySamples:
        return LatencySamples(self.post, self.pull, self.raw_post, self.raw_pull)


@dataclass
class PlannerRun:
    """What one planner's pair measured in one profile."""

    pair: Pair
    full_prefill: dict[str, Any] = field(default_factory=dict)
    full_decode: dict[str, Any] = field(default_factory=dict)
    metadata: peer_pb2.GetAgentMetadataResponse | None = None
    ready: list[float] = field(default_factory=list)
    cold_contact: float = 0.0
    contact_steps: dict[str, Any] = field(default_factory=dict)
    handshaked: bool = False
    series: dict[str, PullSeries] = field(default_factory=dict)
    rss_ready: Rss = NO_RSS
    rss: Rss = NO_RSS
    notified: int = 0
    latency: dict[int, Latency] = field(default_factory=dict)
    raw_bandwidth: list[float] = field(default_factory=list)
    raw_desc_post: list[float] = field(default_factory=list)


def _model(b64: str) -> RegionMapModel:
    return convert.region_map_from_proto(types_pb2.RegionMap.FromString(base64.b64decode(b64)))


def full_scale_descriptors(local: RegionMapModel, remote: RegionMapModel, req: Request) -> int:
    """Descriptors ``req`` takes between two full-scale maps (pure planning)."""
    table = build_piece_table(local, remote, [LayerSelection(g) for g in req.groups])
    pairs = [
        GroupPairs(g, loc, rem)
        for g, loc, rem in zip(req.groups, req.local, req.remote, strict=True)
    ]
    return plan_transfer(table, pairs).descriptors


@dataclass(frozen=True)
class ProfilePlan:
    """Everything about a profile that does not depend on the planner."""

    profile: Profile
    scattered: Request
    contiguous: Request
    bandwidth: Request
    first_contact: Request
    divisor: int
    info: ProfileInfo
    # The largest concurrency level's requests, as (worker pair, request);
    # level N pulls the first N.
    concurrent: list[tuple[int, Request]]
    concurrency_divisor: int
    descriptor_divisor: int

    @property
    def concurrency_pairs(self) -> int:
        return 1 + max(w for w, _ in self.concurrent)


def plan_profile(profile: Profile, opts: Options, memcpy: float = 0.0) -> ProfilePlan:
    """The requests of ``profile`` and their scale; ``memcpy`` (GB/s, measured
    next to the profile's pulls) goes into its info."""
    full = profile.geometry()
    scattered, contiguous = requests(profile)
    divisor = timing_divisor(profile, scattered, opts.request_budget)
    bandwidth = scattered.head(bandwidth_blocks(full, scattered, opts.bandwidth_budget))
    pairs, concurrent = concurrent_requests(profile, max(opts.concurrency))
    conc_div = timing_divisor(profile, scattered, opts.concurrency_budget // len(concurrent))
    desc_div = timing_divisor(profile, scattered, opts.descriptor_budget)
    info = ProfileInfo(
        title=profile.title,
        source=profile.source,
        kv_cache_layout=profile.kv_cache_layout,
        views=len(full.views),
        allocations=len(full.allocations),
        blocks=profile.num_blocks,
        block_tokens=profile.block_tokens,
        page_bytes=_page_bytes(full),
        allocated_bytes=sum(a.size_bytes for a in full.allocations),
        request_tokens=profile.request_tokens,
        request_blocks=[len(ids) for ids in scattered.local],
        request_bytes_full_scale=request_bytes(full, scattered),
        timing_scale=_timing_scale(profile, scattered, divisor),
        bandwidth_request=BandwidthRequest(
            blocks=[len(ids) for ids in bandwidth.local], bytes=request_bytes(full, bandwidth)
        ),
        fragmentation=_fragmentation(scattered),
        memcpy_gbps=memcpy,
        concurrency_divisor=conc_div,
        concurrency_workers=pairs,
        descriptor_cost_divisor=desc_div,
    )
    return ProfilePlan(
        profile=profile,
        scattered=scattered,
        contiguous=contiguous,
        bandwidth=bandwidth,
        first_contact=scattered.head(1),
        divisor=divisor,
        info=info,
        concurrent=concurrent,
        concurrency_divisor=conc_div,
        descriptor_divisor=desc_div,
    )


def _page_bytes(geometry: WorkerGeometry) -> list[int]:
    return sorted({v.block_len_bytes for v in geometry.views}, reverse=True)


def _timing_scale(profile: Profile, scattered: Request, divisor: int) -> TimingScale:
    timed = profile.geometry(divisor)
    return TimingScale(
        page_divisor=divisor,
        page_bytes=_page_bytes(timed),
        request_bytes=request_bytes(timed, scattered),
    )


def _fragmentation(scattered: Request) -> Fragmentation:
    local, remote = scattered.local[0], scattered.remote[0]
    return Fragmentation(
        model=blockpool.MODEL,
        ascending_pairs_local=blockpool.ascending_pairs(local),
        ascending_pairs_remote=blockpool.ascending_pairs(remote),
        ascending_pairs_both=blockpool.joint_ascending_pairs(local, remote),
    )


def measure_profile(pp: ProfilePlan, opts: Options) -> dict[str, PlannerResult]:
    """One profile under every planner, on fresh daemons."""
    with tempfile.TemporaryDirectory(prefix="kvmap-bench-") as tmp:
        try:
            return _measure(pp, opts, Path(tmp))
        except (RuntimeError, TimeoutError, AssertionError, OSError) as err:
            raise RuntimeError(f"{pp.profile.name}: {err}{_log_tails(Path(tmp))}") from err


def _log_tails(workdir: Path, n: int = 1500) -> str:
    out = []
    for log in sorted(workdir.glob("*/*/*.log")):
        with contextlib.suppress(OSError):
            out.append(f"\n--- {log.parent.parent.name}/{log.name} (last {n} chars) ---\n")
            out.append(log.read_text(errors="replace")[-n:])
    return "".join(out)


# Timed pulls, planners interleaved ABBA: (series, worker name, request).
def _series(pp: ProfilePlan) -> tuple[tuple[str, str, Request], ...]:
    return (
        ("bandwidth", "full", pp.bandwidth),
        ("scattered", "req", pp.scattered),
        ("contiguous", "req", pp.contiguous),
        ("descriptor_cost", "desc", pp.scattered),
    )


def _measure(pp: ProfilePlan, opts: Options, workdir: Path) -> dict[str, PlannerResult]:
    # Extra full-scale prefill workers whose registrations are the timed
    # "ready" samples; the first is also the remote of the cold first contact.
    fresh = [f"ready{i}" for i in range(opts.repeats)]
    with contextlib.ExitStack() as stack:
        runs = _start_pairs(stack, pp, opts, workdir)
        raw = RawPair(stack, workdir / "raw")
        _register(runs, pp, fresh)
        _register_scaled(runs, pp)
        _raw_setup(raw, runs, pp)
        _first_contact(runs, pp, opts, fresh[0])
        for kind, name, req in _series(pp):
            _timed_pulls(runs, kind, name, req, opts.repeats)
            opts.progress(f"{pp.profile.name}: {kind} " + ", ".join(
                f"{r.pair.planner} {r.series[kind].descriptors:,} descriptors post "
                f"{_median(r.series[kind].post) * 1e3:.1f} ms" for r in runs
            ))  # fmt: skip
        _raw_single(raw, runs, pp, opts.repeats)
        _concurrency(runs, raw, pp, opts)
        for run in runs:
            run.rss = run.pair.rss()
            run.notified = _notified(run.pair)
    return {run.pair.planner: _result(pp, run, opts) for run in runs}


def _start_pairs(
    stack: contextlib.ExitStack, pp: ProfilePlan, opts: Options, workdir: Path
) -> list[PlannerRun]:
    """Every planner's daemons and bench workers, in ``opts.planners`` order."""
    t0 = time.perf_counter()
    daemons = _start_daemons(workdir, opts.planners)
    runs = [PlannerRun(Pair(stack, p, daemons[p])) for p in opts.planners]
    opts.progress(f"{pp.profile.name}: {2 * len(runs)} daemons and workers up in "
                  f"{time.perf_counter() - t0:.1f}s")  # fmt: skip
    return runs


def _register(runs: list[PlannerRun], pp: ProfilePlan, fresh: list[str]) -> None:
    """Register every worker. Prefill: the full-scale worker alone first (so
    the agent metadata is one worker's), then the request worker; then the
    ``fresh`` ones, timed, planners interleaved."""
    profile = pp.profile.name
    for run in runs:
        run.full_prefill = run.pair.register("prefill", "full", profile, 1)
        run.metadata = agent_metadata(run.pair.prefill.tcp_target, "prefill-full")
        run.pair.register("prefill", "req", profile, pp.divisor)
        run.full_decode = run.pair.register("decode", "full", profile, 1)
        run.pair.register("decode", "req", profile, pp.divisor)
    for i, name in enumerate(fresh):
        for run in _order(runs, i):
            out = run.pair.register("prefill", name, profile, 1)
            run.ready.append(float(out["ready_seconds"]))
    for run in runs:
        run.pair.fill(fresh[0], pp.first_contact)
    for run in runs:
        run.rss_ready = run.pair.rss()


def _register_scaled(runs: list[PlannerRun], pp: ProfilePlan) -> None:
    """The descriptor-cost worker and the concurrency workers, both sides."""
    profile = pp.profile.name
    for run in runs:
        for side in ("prefill", "decode"):
            run.pair.register(side, "desc", profile, pp.descriptor_divisor)
            for w in range(pp.concurrency_pairs):
                run.pair.register(side, f"c{w}", profile, pp.concurrency_divisor)


def _raw_setup(raw: RawPair, runs: list[PlannerRun], pp: ProfilePlan) -> None:
    """Raw NIXL: the same geometries on both sides, resident where pulls
    read; every planner's lists prepared (as its daemon caches them)."""
    name = pp.profile.name
    keys = {"full": 1, "desc": pp.descriptor_divisor}
    keys |= {f"c{w}": pp.concurrency_divisor for w in range(pp.concurrency_pairs)}
    for key, divisor in keys.items():
        raw.register(key, name, divisor)
        if key != "full":
            raw.touch(key)
    bw = pp.bandwidth
    raw.touch(
        "full", [{"group": g, "blocks": ids} for g, ids in zip(bw.groups, bw.remote, strict=True)]
    )
    raw.connect()
    for run in runs:
        for key, divisor in keys.items():
            prep = f"{run.pair.planner}/{key}"
            raw.prepare(
                prep, run.pair.planner, key, profile=name, divisor=divisor, groups=bw.groups
            )


def _raw_rounds(
    raw: RawPair, runs: list[PlannerRun], reqs: list[tuple[str, Request]], repeats: int
) -> dict[str, list[dict[str, list[float]]]]:
    """A warm-up round, then ``repeats`` timed rounds ABBA over planners of
    raw NIXL pulling ``reqs`` ((space, request)) all at once."""
    out: dict[str, list[dict[str, list[float]]]] = {}
    for i in range(-1, repeats):
        for run in _order(runs, max(i, 0)):
            planner = run.pair.planner
            specs = [{"prep": f"{planner}/{k}", "groups": r.spec()} for k, r in reqs]
            rounds = raw.pull(specs, 1)["rounds"]
            if i >= 0:
                out.setdefault(planner, []).extend(rounds)
    return out


def _raw_single(raw: RawPair, runs: list[PlannerRun], pp: ProfilePlan, repeats: int) -> None:
    """Raw NIXL's full-page bandwidth pull and negligible-bytes scattered post."""
    bw = _raw_rounds(raw, runs, [("full", pp.bandwidth)], repeats)
    desc = _raw_rounds(raw, runs, [("desc", pp.scattered)], repeats)
    for run in runs:
        run.raw_bandwidth = [r["pull_seconds"][0] for r in bw[run.pair.planner]]
        run.raw_desc_post = [r["post_seconds"][0] for r in desc[run.pair.planner]]


def _conc_pulls(pp: ProfilePlan, n: int) -> list[tuple[str, Request, str]]:
    return [(f"c{w}", req, f"c{w}") for w, req in pp.concurrent[:n]]


def _concurrency(runs: list[PlannerRun], raw: RawPair, pp: ProfilePlan, opts: Options) -> None:
    """Each level: N scattered pulls in flight at once, ``repeats`` rounds
    per planner (ABBA), then raw NIXL posting the same lists; finally every
    destination byte of the largest level is verified."""
    for run in runs:
        for w, req in pp.concurrent:
            run.pair.fill(f"c{w}", req)
        run.pair.pull_many(_conc_pulls(pp, len(pp.concurrent)))  # warm up
        for w, req in pp.concurrent:
            run.pair.zero(f"c{w}", req)
    for n in opts.concurrency:
        for run in _rounds(runs, opts.repeats):
            lat = run.latency.setdefault(n, Latency())
            for out in run.pair.pull_many(_conc_pulls(pp, n), cpu=lat.cpu):
                lat.post.append(float(out["stats"]["post_seconds"]))
                lat.pull.append(float(out["wall_seconds"]))
        reqs = [(f"c{w}", r) for w, r in pp.concurrent[:n]]
        for planner, rounds in _raw_rounds(raw, runs, reqs, opts.repeats).items():
            lat = next(r for r in runs if r.pair.planner == planner).latency[n]
            for r in rounds:
                lat.raw_post += r["post_seconds"]
                lat.raw_pull += r["pull_seconds"]
        opts.progress(f"{pp.profile.name}: concurrency {n}: " + ", ".join(
            f"{r.pair.planner} post p95 {_pct(r.latency[n].post, 95) * 1e3:.1f} ms, "
            f"pull p95 {_pct(r.latency[n].pull, 95) * 1e3:.1f} ms "
            f"(raw NIXL {_pct(r.latency[n].raw_pull, 95) * 1e3:.1f} ms)" for r in runs
        ))  # fmt: skip
    for run in runs:
        s = run.series["concurrency"] = PullSeries()
        for w, req in pp.concurrent:
            nbytes, bad = run.pair.verify(f"c{w}", req)
            s.verified_bytes += nbytes
            s.bad_blocks += bad


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def _first_contact(runs: list[PlannerRun], pp: ProfilePlan, opts: Options, remote: str) -> None:
    """First contact, end to end: the decode daemon's very first pull
    (handshake, load the remote agent, connect UCX, build the piece table,
    prepare both lists) minus the next identical one. Then the same steps one
    by one, repeated, from the decode worker's process."""
    for run in runs:
        first = run.pair.pull("full", pp.first_contact, remote=remote)
        again = run.pair.pull("full", pp.first_contact, remote=remote)
        run.cold_contact = first["wall_seconds"] - again["wall_seconds"]
        run.handshaked = bool(first["stats"]["handshaked"])
    for run in runs:
        run.contact_steps = run.pair.contact(pp.profile.name, opts.contact_repeats)
    opts.progress(f"{pp.profile.name}: first contact " + ", ".join(
        f"{r.pair.planner} {r.cold_contact * 1e3:.1f} ms cold, "
        f"{r.contact_steps['total_seconds'] * 1e3:.2f} ms in steps" for r in runs
    ))  # fmt: skip


def _timed_pulls(runs: list[PlannerRun], kind: str, name: str, req: Request, repeats: int) -> None:
    """One series: write the source, warm up once, clear the destination,
    pull, verify every byte (only the timed pulls can have written it)."""
    for run in runs:
        run.pair.fill(name, req)
        run.pair.pull(name, req)
        run.pair.zero(name, req)
        run.series[kind] = PullSeries()
    for run in _rounds(runs, repeats):
        run.series[kind].add(run.pair.pull(name, req))
    for run in runs:
        s = run.series[kind]
        s.verified_bytes, s.bad_blocks = run.pair.verify(name, req)


def _notified(pair: Pair, timeout_s: float = 10.0) -> int:
    """Wait (bounded) until the prefill worker was told of every pull."""
    deadline = time.monotonic() + timeout_s
    while True:
        n = pair.notified()
        if n >= pair.pulls or time.monotonic() > deadline:
            return n
        time.sleep(0.05)


@dataclass(frozen=True)
class FullScale:
    """The full-scale workers' maps, and what pure planning says of them."""

    plan_seconds: float  # the planner alone, on the profile's geometry
    remote_map: RegionMapModel  # the prefill worker's, as its daemon registered it
    scattered_descriptors: int  # per transfer, between the two full-scale maps
    contiguous_descriptors: int


def _full_scale(pp: ProfilePlan, run: PlannerRun, planner: planners.Planner) -> FullScale:
    """The daemon must have registered what the planner alone plans."""
    start = time.perf_counter()
    plan = planner.plan(pp.profile.geometry())
    plan_s = time.perf_counter() - start
    remote_map = _model(run.full_prefill["region_map"])
    if remote_map.descriptor_count != plan.descriptor_count:
        raise RuntimeError(
            f"{pp.profile.name}/{planner.info.name}: the daemon registered "
            f"{remote_map.descriptor_count} descriptors, the planner alone plans "
            f"{plan.descriptor_count}"
        )
    local_map = _model(run.full_decode["region_map"])
    return FullScale(
        plan_seconds=plan_s,
        remote_map=remote_map,
        scattered_descriptors=full_scale_descriptors(local_map, remote_map, pp.scattered),
        contiguous_descriptors=full_scale_descriptors(local_map, remote_map, pp.contiguous),
    )


def _contact_steps(steps: dict[str, Any]) -> dict[str, float]:
    """The medians (and piece count) of ``bench.contact``'s answer."""
    return {k: v for k, v in steps.items() if k.endswith("_seconds") or k == "pieces"}


def _samples(run: PlannerRun) -> Samples:
    return Samples(
        ready_seconds=run.ready,
        first_contact_steps=run.contact_steps["samples"],
        bandwidth=run.series["bandwidth"].samples(),
        scattered=run.series["scattered"].samples(),
        contiguous=run.series["contiguous"].samples(),
        descriptor_cost=run.series["descriptor_cost"].samples(),
        concurrency={str(n): lat.samples() for n, lat in run.latency.items()},
        raw_bandwidth_seconds=run.raw_bandwidth,
        raw_descriptor_cost_post_seconds=run.raw_desc_post,
    )


def _gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / _median(seconds) / 1e9 if seconds else 0.0


def _result(pp: ProfilePlan, run: PlannerRun, opts: Options) -> PlannerResult:
    planner = planners.get_planner(run.pair.planner)
    full = _full_scale(pp, run, planner)
    remote_map = full.remote_map
    assert run.metadata is not None
    bw, sc, co = (run.series[k] for k in ("bandwidth", "scattered", "contiguous"))
    bad = sum(s.bad_blocks for s in run.series.values())
    return PlannerResult(
        planner=planner.info,
        regions=len(remote_map.regions),
        descriptors=remote_map.descriptor_count,
        baseline_descriptors=remote_map.baseline_descriptor_count,
        # The daemon registers each allocation with NIXL exactly once
        # (registration.py), whatever the planner.
        nixl_registrations=len(remote_map.allocations),
        agent_metadata_bytes=len(run.metadata.agent_metadata),
        region_map_bytes=run.metadata.region_map.ByteSize(),
        registration_request_bytes=int(run.full_prefill["request_bytes"]),
        plan_seconds=full.plan_seconds,
        ready_seconds=_median(run.ready),
        first_contact_seconds=max(0.0, run.cold_contact),
        first_contact_steps_seconds=run.contact_steps["total_seconds"],
        first_contact_steps=_contact_steps(run.contact_steps),
        first_contact_handshaked=run.handshaked,
        descriptors_per_transfer_scattered=sc.descriptors,
        descriptors_per_transfer_scattered_full_scale=full.scattered_descriptors,
        post_seconds_scattered=_median(sc.post),
        completion_seconds_scattered=_median(sc.completion),
        transfer_seconds_scattered=_median(sc.transfer),
        bytes_scattered=sc.bytes,
        descriptors_per_transfer_contiguous=co.descriptors,
        descriptors_per_transfer_contiguous_full_scale=full.contiguous_descriptors,
        post_seconds_contiguous=_median(co.post),
        completion_seconds_contiguous=_median(co.completion),
        transfer_seconds_contiguous=_median(co.transfer),
        bytes_contiguous=co.bytes,
        pull_gbps=_gbps(bw.bytes, bw.transfer),
        pull_gbps_wall=_gbps(bw.bytes, bw.wall),
        pull_bytes=bw.bytes,
        pull_descriptors=bw.descriptors,
        daemon_rss_bytes=run.rss,
        daemon_rss_ready_bytes=run.rss_ready,
        bytes_verified=sum(s.verified_bytes for s in run.series.values()),
        bad_blocks=bad,
        verified=bad == 0,
        pulls=run.pair.pulls,
        owner_notified=run.notified,
        repeats=opts.repeats,
        samples=_samples(run),
        **_new_figures(run, bw),
    )


def _new_figures(run: PlannerRun, bw: PullSeries) -> dict[str, Any]:
    """Concurrency, descriptor cost and raw NIXL figures of ``run``."""
    desc = run.series["descriptor_cost"]
    top = run.latency[max(run.latency)]
    raw_p95 = _pct(top.raw_pull, 95)
    return {
        "concurrency": {str(n): lat.figures() for n, lat in run.latency.items()},
        "post_us_per_descriptor": _median(desc.post) / max(1, desc.descriptors) * 1e6,
        "raw_nixl": RawNixl(
            pull_seconds=raw_p95,
            gbps=_gbps(bw.bytes, run.raw_bandwidth),
            post_seconds=_median(run.raw_desc_post),
        ),
        "pull_vs_raw_nixl": _pct(top.pull, 95) / raw_p95 if raw_p95 > 0 else 0.0,
    }


# Ratios ----------------------------------------------------------------------


def add_ratios(results: dict[str, PlannerResult]) -> dict[str, PlannerResult]:
    """``results`` with every planner's gains over ``baseline`` (if it ran)."""
    base = results.get("baseline")
    if base is None:
        return results
    return {
        name: r
        if name == "baseline"
        else replace(
            r,
            vs_baseline={
                key: ratio(base.figure(key), r.figure(key), higher) for key, higher in RATIO_KEYS
            },
        )
        for name, r in results.items()
    }


# The run -----------------------------------------------------------------------


def machine() -> Machine:
    mem = 0
    with contextlib.suppress(OSError), open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return Machine(
        cpu=cpu,
        cpus=os.cpu_count(),
        memory_bytes=mem,
        kernel=platform.release(),
        python=platform.python_version(),
        transport="NIXL UCX backend over loopback (UCX_NET_DEVICES=lo)",
    )


def default_planners() -> list[str]:
    """``baseline`` first, then every other planner the daemon knows."""
    names = sorted(planners.PLANNERS)
    return ["baseline", *[n for n in names if n != "baseline"]] if "baseline" in names else names


def run_bench(opts: Options) -> BenchResult:
    started = time.perf_counter()
    profiles = [get_profile(name) for name in opts.profiles]
    for name in opts.planners:
        planners.get_planner(name)  # fail before starting anything
    results: dict[str, dict[str, PlannerResult]] = {}
    infos: dict[str, ProfileInfo] = {}
    # memcpy is measured next to every profile's pulls, so that a busy
    # neighbour slows both alike; the headline figure is their median.
    memcpy: list[float] = []
    all_cores: list[float] = []
    for profile in profiles:
        memcpy.append(memcpy_gbps(opts.memcpy_bytes))
        all_cores.append(memcpy_all_cores_gbps(opts.memcpy_bytes))
        opts.progress(f"{profile.name}: memcpy {memcpy[-1]:.2f} GB/s single thread, "
                      f"{all_cores[-1]:.2f} GB/s all cores")  # fmt: skip
        pp = plan_profile(profile, opts, memcpy[-1])
        results[profile.name] = add_ratios(measure_profile(pp, opts))
        infos[profile.name] = pp.info
    tp8 = None
    if opts.tp8_profile:
        from kvmap.tools.bench import pod  # noqa: PLC0415  (it uses this module)

        tp8 = pod.measure_pod(opts)
    return BenchResult(
        schema=SCHEMA,
        machine=machine(),
        memcpy_gbps=_median(memcpy),
        memcpy_bytes=opts.memcpy_bytes,
        repeats=opts.repeats,
        profiles=results,
        profile_info=infos,
        seconds=time.perf_counter() - started,
        memcpy_all_cores_gbps=_median(all_cores),
        tp8=tp8,
    )
