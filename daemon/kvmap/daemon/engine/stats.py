"""The daemon's counters and its stats (``Admin.GetStats``), as domain
types: the engine counts into ``TransferCounters`` and answers with a
``DaemonStats`` snapshot; ``api.wire_out`` writes both as the wire's
``GetStatsResponse``."""

from __future__ import annotations

from dataclasses import dataclass

from kvmap.core.geometry import PlannerInfo


@dataclass
class TransferCounters:
    """Running totals since start, counted by the transfer engine (this
    daemon's own transfers) and the owner's side (its peers')."""

    pulls_done: int = 0
    pushes_done: int = 0
    failed: int = 0
    bytes: int = 0
    descriptors: int = 0
    blocks: int = 0
    # Transfers by remote peers against this daemon's workers that finished.
    served_done: int = 0
    served_blocks: int = 0
    # Push offers relayed to this daemon's prefill workers, and refused.
    push_offers_relayed: int = 0
    push_offers_refused: int = 0


@dataclass(frozen=True)
class DaemonStats:
    """What the daemon holds and has done, at one moment (``transfers`` is
    a copy of the counters then, never the live ones)."""

    transfers: TransferCounters
    workers: int
    remote_agents: int
    daemon_instance: str
    planner: PlannerInfo
    mapped_allocations: int
    mapped_bytes: int
    nixl_registrations: int
    fd_handoff_pending: int
    leases: int
