"""The figures of a ``kvmapd bench`` run, typed: what ``runner`` measures and
``report`` and ``plot`` read.

``BenchResult.to_json`` is the ``--json`` output (schema ``kvmap-bench/1``)
and ``BenchResult.from_json`` reads it back. Field names and their order are
the JSON keys and their order, so renaming or reordering a field changes the
schema; nothing else converts to or from the dict.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from kvmap.core.geometry import PlannerInfo

SCHEMA = "kvmap-bench/1"
# Figures every planner object has (the minimum, and the test's).
REQUIRED_KEYS = (
    "regions",
    "descriptors",
    "ready_seconds",
    "first_contact_seconds",
    "descriptors_per_transfer_scattered",
    "post_seconds_scattered",
    "pull_gbps",
)

# (figure, higher is better): a ratio > 1 always means "better than baseline".
RATIO_KEYS: tuple[tuple[str, bool], ...] = (
    ("regions", False),
    ("descriptors", False),
    ("nixl_registrations", False),
    ("agent_metadata_bytes", False),
    ("region_map_bytes", False),
    ("ready_seconds", False),
    ("first_contact_seconds", False),
    ("first_contact_steps_seconds", False),
    ("descriptors_per_transfer_scattered", False),
    ("post_seconds_scattered", False),
    ("completion_seconds_scattered", False),
    ("transfer_seconds_scattered", False),
    ("descriptors_per_transfer_contiguous", False),
    ("post_seconds_contiguous", False),
    ("completion_seconds_contiguous", False),
    ("transfer_seconds_contiguous", False),
    ("pull_gbps", True),
    ("post_us_per_descriptor", False),
)
# The concurrency levels of a run (``--concurrency``), as JSON keys.
CONCURRENCY = (1, 8, 32)
HIGHER_IS_BETTER = dict(RATIO_KEYS)

TIMING_NOTE = (
    "128K-token requests timed with every page divided by page_divisor; "
    "layers, blocks and block ids (so descriptors) as at full scale"
)
BANDWIDTH_NOTE = "full page size; the first blocks of the scattered request"


def ratio(base: float, value: float, higher_is_better: bool) -> float | None:
    """How many times better than baseline ``value`` is (None if undefined)."""
    num, den = (value, base) if higher_is_better else (base, value)
    if den <= 0:
        return None
    return float(num / den)


# One planner in one profile ------------------------------------------------------


@dataclass(frozen=True)
class Rss:
    """A daemon pair's own resident memory, bytes."""

    prefill: int
    decode: int


@dataclass(frozen=True)
class SeriesSamples:
    """Every timed pull of one request, as the daemon reported it."""

    post_seconds: list[float]
    completion_seconds: list[float]
    wall: list[float]


@dataclass(frozen=True)
class LatencySamples:
    """Every pull of one concurrency level (all rounds): the daemon's post
    seconds and the decode worker's Pull-to-DONE seconds; the same for raw
    NIXL posting the same lists (its post, and first post to DONE)."""

    post_seconds: list[float]
    pull_seconds: list[float]
    raw_post_seconds: list[float]
    raw_pull_seconds: list[float]


@dataclass(frozen=True)
class Samples:
    """The raw samples behind the medians and percentiles."""

    ready_seconds: list[float]
    first_contact_steps: dict[str, list[float]]
    bandwidth: SeriesSamples
    scattered: SeriesSamples
    contiguous: SeriesSamples
    # The scattered request at negligible bytes per descriptor.
    descriptor_cost: SeriesSamples
    concurrency: dict[str, LatencySamples]
    raw_bandwidth_seconds: list[float]
    raw_descriptor_cost_post_seconds: list[float]

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Samples:
        return cls(
            ready_seconds=d["ready_seconds"],
            first_contact_steps=d["first_contact_steps"],
            bandwidth=SeriesSamples(**d["bandwidth"]),
            scattered=SeriesSamples(**d["scattered"]),
            contiguous=SeriesSamples(**d["contiguous"]),
            descriptor_cost=SeriesSamples(**d["descriptor_cost"]),
            concurrency={n: LatencySamples(**c) for n, c in d["concurrency"].items()},
            raw_bandwidth_seconds=d["raw_bandwidth_seconds"],
            raw_descriptor_cost_post_seconds=d["raw_descriptor_cost_post_seconds"],
        )


@dataclass(frozen=True)
class Concurrency:
    """N scattered 128K-token pulls in flight at once (distinct blocks)."""

    post_p50_seconds: float
    post_p95_seconds: float
    post_max_seconds: float
    pull_p50_seconds: float
    pull_p95_seconds: float
    # CPU time per pull over the level's rounds, by where it was spent
    # (pair.CPU_PLACES) and their "total"; absent ({}) in results from
    # before it was measured.
    cpu_seconds_per_pull: dict[str, float] = field(default_factory=dict)
    # Raw NIXL posting the same lists at the same level: its CPU per pull
    # (series.RAW_CPU_PLACES and "total"), post p95 and pull p50/p95. Zero
    # or {} in results from before they were kept.
    raw_nixl_cpu_seconds_per_pull: dict[str, float] = field(default_factory=dict)
    raw_nixl_post_p95_seconds: float = 0.0
    raw_nixl_pull_p50_seconds: float = 0.0
    raw_nixl_pull_p95_seconds: float = 0.0
    # The owner daemon's CPU per grant over the level's rounds (each pull
    # has its own, made before the pulls and outside their timing and
    # ``cpu_seconds_per_pull``), by place (pair.GRANT_CPU_PLACES) and
    # "total"; {} in results from before it was measured.
    cpu_seconds_per_grant: dict[str, float] = field(default_factory=dict)
    # Context switches per pull over the level's rounds (the same window as
    # ``cpu_seconds_per_pull``): kvmap's by place (pair.SWITCH_PLACES) and
    # raw NIXL's (series.RAW_CPU_PLACES), each with a "total"; {} in results
    # from before they were counted.
    context_switches_per_pull: dict[str, float] = field(default_factory=dict)
    raw_nixl_context_switches_per_pull: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RawNixl:
    """Two bare NIXL agents posting the lists this planner's daemon posts:
    ``pull_seconds`` the pull p95 at the highest concurrency (first post to
    DONE), ``gbps`` the full-page bandwidth request, ``post_seconds`` the
    negligible-bytes scattered request's post (medians over the rounds)."""

    pull_seconds: float
    gbps: float
    post_seconds: float


@dataclass(frozen=True)
class PlannerResult:
    """What one planner's daemons measured in one profile (docs/benchmarks.md
    says what each figure is)."""

    planner: PlannerInfo
    regions: int
    descriptors: int
    baseline_descriptors: int
    nixl_registrations: int
    agent_metadata_bytes: int
    region_map_bytes: int
    registration_request_bytes: int
    plan_seconds: float
    ready_seconds: float
    first_contact_seconds: float
    first_contact_steps_seconds: float
    first_contact_steps: dict[str, float]
    first_contact_handshaked: bool
    descriptors_per_transfer_scattered: int
    descriptors_per_transfer_scattered_full_scale: int
    post_seconds_scattered: float
    completion_seconds_scattered: float
    transfer_seconds_scattered: float
    bytes_scattered: int
    descriptors_per_transfer_contiguous: int
    descriptors_per_transfer_contiguous_full_scale: int
    post_seconds_contiguous: float
    completion_seconds_contiguous: float
    transfer_seconds_contiguous: float
    bytes_contiguous: int
    pull_gbps: float
    pull_gbps_wall: float
    pull_bytes: int
    pull_descriptors: int
    daemon_rss_bytes: Rss
    daemon_rss_ready_bytes: Rss
    bytes_verified: int
    bad_blocks: int
    verified: bool
    pulls: int
    owner_notified: int
    repeats: int
    samples: Samples
    concurrency: dict[str, Concurrency]
    # The scattered request at a page scale where bytes are negligible.
    post_us_per_descriptor: float
    raw_nixl: RawNixl
    # kvmap's pull p95 at the highest concurrency / raw NIXL's (> 1: slower).
    pull_vs_raw_nixl: float
    # Gain over baseline per RATIO_KEYS figure; None for baseline itself
    # (and then absent from the JSON).
    vs_baseline: dict[str, float | None] | None = None

    def figure(self, key: str) -> float:
        """The numeric figure named ``key`` (a RATIO_KEYS or table key)."""
        value = getattr(self, key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"{key} is not a numeric figure")
        return float(value)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        if self.vs_baseline is None:
            del out["vs_baseline"]
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PlannerResult:
        return cls(
            **{
                **d,
                "planner": PlannerInfo(**d["planner"]),
                "daemon_rss_bytes": Rss(**d["daemon_rss_bytes"]),
                "daemon_rss_ready_bytes": Rss(**d["daemon_rss_ready_bytes"]),
                "samples": Samples.from_json(d["samples"]),
                "concurrency": {n: Concurrency(**c) for n, c in d["concurrency"].items()},
                "raw_nixl": RawNixl(**d["raw_nixl"]),
            }
        )


# One profile ---------------------------------------------------------------------


@dataclass(frozen=True)
class TimingScale:
    page_divisor: int
    page_bytes: list[int]
    request_bytes: int
    note: str = TIMING_NOTE


@dataclass(frozen=True)
class BandwidthRequest:
    blocks: list[int]
    bytes: int
    note: str = BANDWIDTH_NOTE


@dataclass(frozen=True)
class Fragmentation:
    model: str
    ascending_pairs_local: float
    ascending_pairs_remote: float
    ascending_pairs_both: float


@dataclass(frozen=True)
class ProfileInfo:
    """A profile's geometry and requests: everything that does not depend on
    the planner."""

    title: str
    source: str
    kv_cache_layout: str
    views: int
    allocations: int
    blocks: int
    block_tokens: int
    page_bytes: list[int]
    allocated_bytes: int
    request_tokens: int
    request_blocks: list[int]
    request_bytes_full_scale: int
    timing_scale: TimingScale
    bandwidth_request: BandwidthRequest
    fragmentation: Fragmentation
    memcpy_gbps: float
    # The page divisors of the concurrency and the descriptor-cost requests,
    # and how many worker pairs hold the concurrency requests' distinct blocks.
    concurrency_divisor: int
    concurrency_workers: int
    descriptor_cost_divisor: int

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ProfileInfo:
        return cls(
            **{
                **d,
                "timing_scale": TimingScale(**d["timing_scale"]),
                "bandwidth_request": BandwidthRequest(**d["bandwidth_request"]),
                "fragmentation": Fragmentation(**d["fragmentation"]),
            }
        )


# The run ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Machine:
    cpu: str
    cpus: int | None
    memory_bytes: int
    kernel: str
    python: str
    transport: str


@dataclass(frozen=True)
class Tp8:
    """A TP pod's workers (full scale, sparse) registered with one daemon at
    once, and a peer's first pulls from all of them."""

    planner: str
    profile: str
    workers: int
    ready_seconds_total: float
    ready_seconds_max: float
    daemon_rss_bytes: int
    region_map_bytes: int
    agent_metadata_bytes: int
    first_contact_seconds: float


@dataclass(frozen=True)
class Throughput:
    """A TP pod's pulls at saturation on ``cores`` cores (every process
    pinned to them): ``ranks`` decode ranks, each pulling one scattered
    request after another from its own prefill rank, through one kvmapd per
    side, next to one raw NIXL agent pair per rank (NixlConnector's model)
    posting the same lists. Medians of ``samples`` (pulls per second)."""

    cores: int
    ranks: int
    pulls_per_rank: int
    kvmap_pulls_per_second: float
    raw_nixl_pulls_per_second: float
    samples: dict[str, list[float]]


@dataclass(frozen=True)
class Restart:
    """``ready_seconds``: ``kvmapd serve`` started until it serves (ready
    file written); ``unreachable_seconds``: a prefill daemon stopped with
    SIGTERM (an upgrade) and started again on its state and port, from the
    stop until a decode worker's pull from it succeeds again;
    ``added_pull_seconds``: the slowest pull across that gap minus the
    median pull before it (``kvmap.tools.upgrade_gap``). Medians of
    ``samples``."""

    ready_seconds: float
    unreachable_seconds: float
    added_pull_seconds: float
    samples: dict[str, list[float]]


@dataclass(frozen=True)
class BenchResult:
    """A whole ``kvmapd bench`` run: per profile, per planner (baseline first)."""

    schema: str
    machine: Machine
    memcpy_gbps: float
    memcpy_bytes: int
    repeats: int
    profiles: dict[str, dict[str, PlannerResult]]
    profile_info: dict[str, ProfileInfo]
    seconds: float
    # Every core copying its share of the memcpy buffers at once.
    memcpy_all_cores_gbps: float
    tp8: Tp8 | None
    # Keyed by cores ("1", "2"); None when not measured (--throughput-pulls 0).
    throughput: dict[str, Throughput] | None = None
    restart: Restart | None = None
    # UCX threads of every agent of the run (daemons and raw NIXL alike);
    # None in results from before it was recorded.
    nixl_threads: int | None = None
    # The daemons' check_before_read; None in results from before it was
    # recorded (they checked first).
    check_before_read: bool | None = None

    @property
    def verified(self) -> bool:
        """Every byte of every timed pull of every planner was right."""
        return all(r.verified for rs in self.profiles.values() for r in rs.values())

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` output, keys in field order."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["machine"] = asdict(self.machine)
        out["profiles"] = {
            name: {planner: r.to_json() for planner, r in results.items()}
            for name, results in self.profiles.items()
        }
        out["profile_info"] = {name: asdict(info) for name, info in self.profile_info.items()}
        out["tp8"] = asdict(self.tp8) if self.tp8 is not None else None
        out["throughput"] = (
            {cores: asdict(t) for cores, t in self.throughput.items()}
            if self.throughput is not None
            else None
        )
        out["restart"] = asdict(self.restart) if self.restart is not None else None
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> BenchResult:
        """Read back a ``--json`` output of this schema."""
        if d.get("schema") != SCHEMA:
            raise ValueError(f"not a {SCHEMA} result: schema {d.get('schema')!r}")
        return cls(
            **{
                **d,
                "machine": Machine(**d["machine"]),
                "profiles": {
                    name: {p: PlannerResult.from_json(r) for p, r in results.items()}
                    for name, results in d["profiles"].items()
                },
                "profile_info": {
                    name: ProfileInfo.from_json(info) for name, info in d["profile_info"].items()
                },
                "tp8": Tp8(**d["tp8"]) if d.get("tp8") is not None else None,
                "throughput": (
                    {c: Throughput(**t) for c, t in d["throughput"].items()}
                    if d.get("throughput") is not None
                    else None
                ),
                "restart": Restart(**d["restart"]) if d.get("restart") is not None else None,
            }
        )
