"""What one planner's pair measured in one profile (``PlannerRun``): its
timed pull series and concurrency rounds, and the ABBA order in which
planners take turns."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvmap.tools.bench.pair import Pair
from kvmap.tools.bench.results import (
    Concurrency,
    LatencySamples,
    Rss,
    SeriesSamples,
)
from kvmap.v1 import peer_pb2


def median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def abba(runs: list[PlannerRun], i: int) -> list[PlannerRun]:
    """The planners in round ``i``: reversed every other round (ABBA), so that
    a change in machine load while the bench runs hits every planner alike."""
    return runs if i % 2 == 0 else runs[::-1]


def interleaved(runs: list[PlannerRun], n: int) -> list[PlannerRun]:
    return [run for i in range(n) for run in abba(runs, i)]


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


@dataclass
class Latency:
    """Every pull of one concurrency level: kvmap's and raw NIXL's, and the
    CPU time the rounds took (``CPU_PLACES``)."""

    post: list[float] = field(default_factory=list)
    pull: list[float] = field(default_factory=list)
    raw_post: list[float] = field(default_factory=list)
    raw_pull: list[float] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)
    # Raw NIXL's CPU seconds over its rounds (RAW_CPU_PLACES).
    raw_cpu: dict[str, float] = field(default_factory=dict)
    # The owner daemon's CPU seconds over the rounds' grants (GRANT_CPU_PLACES).
    grant_cpu: dict[str, float] = field(default_factory=dict)
    # Context switches over the rounds, kvmap's (pair.SWITCH_PLACES) and raw
    # NIXL's (RAW_CPU_PLACES).
    switches: dict[str, float] = field(default_factory=dict)
    raw_switches: dict[str, float] = field(default_factory=dict)

    def figures(self) -> Concurrency:
        return Concurrency(
            post_p50_seconds=pct(self.post, 50),
            post_p95_seconds=pct(self.post, 95),
            post_max_seconds=max(self.post, default=0.0),
            pull_p50_seconds=pct(self.pull, 50),
            pull_p95_seconds=pct(self.pull, 95),
            cpu_seconds_per_pull=per_pull(self.cpu, len(self.pull)),
            raw_nixl_cpu_seconds_per_pull=per_pull(self.raw_cpu, len(self.raw_pull)),
            raw_nixl_post_p95_seconds=pct(self.raw_post, 95),
            raw_nixl_pull_p50_seconds=pct(self.raw_pull, 50),
            raw_nixl_pull_p95_seconds=pct(self.raw_pull, 95),
            # One grant per pull.
            cpu_seconds_per_grant=per_pull(self.grant_cpu, len(self.pull)),
            context_switches_per_pull=per_pull(self.switches, len(self.pull)),
            raw_nixl_context_switches_per_pull=per_pull(self.raw_switches, len(self.raw_pull)),
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


# Where raw NIXL's CPU time is counted: the process that posts and polls
# (NixlConnector's decode worker) and the one that owns the memory.
RAW_CPU_PLACES = ("initiator", "target")


def per_pull(cpu: dict[str, float], pulls: int) -> dict[str, float]:
    """CPU seconds (or context switches) per pull by place, and their
    ``total``; {} without pulls."""
    if not pulls:
        return {}
    out = {k: v / pulls for k, v in cpu.items()}
    out["total"] = sum(out.values())
    return out


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0
