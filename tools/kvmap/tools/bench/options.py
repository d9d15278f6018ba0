"""What one ``kvmapd bench`` run measures: profiles, planners, repeats and
the byte budgets that scale each series to this machine."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvmap.core import planner as planners
from kvmap.core.config import DEFAULT_NIXL_THREADS
from kvmap.tools.bench.results import CONCURRENCY

MIB = 1024 * 1024


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
    # Pod throughput (bench.throughput): this profile (None: skip), ranks
    # pulling at once, pulls each, rounds per side (ABBA).
    throughput_profile: str | None = "glm53"
    throughput_ranks: int = 8
    throughput_pulls: int = 20
    throughput_rounds: int = 2
    # Restart figures (bench.restart): samples of each (0: skip).
    restart_rounds: int = 3
    # UCX threads of every agent: the daemons' and raw NIXL's (the same lists
    # posted the same way).
    nixl_threads: int = DEFAULT_NIXL_THREADS
    # The daemons' check_before_read (False: pulls read while the owner
    # checks their BeginTransfer).
    check_before_read: bool = True
    progress: Callable[[str], None] = field(default=lambda line: None)

    def daemon_flags(self) -> tuple[str, ...]:
        """The flags every daemon of the run starts with, beyond its planner."""
        flags = ("--nixl-threads", str(self.nixl_threads))
        return flags if self.check_before_read else (*flags, "--no-check-before-read")

    def single_planner(self) -> str:
        """The planner of the series that run one planner only (the TP pod,
        the pod throughput): the daemon's default when the run measures it,
        else the last one asked for."""
        default = planners.DEFAULT_PLANNER
        return default if default in self.planners else self.planners[-1]
