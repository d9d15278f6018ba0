"""Domain -> protobuf: what the engine returns, as the api sends it (the
worker's events, the daemon's stats, region maps, transfer reports). As
``wire_in``, it reuses the core's writers (``core.convert``,
``core.event_wire``, ``core.transfer_wire``), which the state store and the
peer client write with too; the conversions only the api needs are here."""

from __future__ import annotations

from kvmap.core.convert import planner_info_to_proto, region_map_to_proto, worker_id_to_proto
from kvmap.core.event_wire import event_to_proto
from kvmap.core.transfer_wire import report_to_proto
from kvmap.core.worker_events import WorkerEvent
from kvmap.daemon.engine.stats import DaemonStats, TransferCounters
from kvmap.v1 import admin_pb2, registry_pb2

__all__ = [
    "attach_event",
    "attached",
    "planner_info_to_proto",
    "region_map_to_proto",
    "report_to_proto",
    "stats",
    "worker_id_to_proto",
]


def attached(generation: int, daemon_instance: str) -> registry_pb2.AttachResponse:
    """The first message of every Attach stream."""
    return registry_pb2.AttachResponse(
        attached=registry_pb2.AttachedEvent(generation=generation, daemon_instance=daemon_instance)
    )


def attach_event(event: WorkerEvent) -> registry_pb2.AttachResponse:
    """A worker's event (live, or stored while no stream was open)."""
    return event_to_proto(event)


def stats(s: DaemonStats) -> admin_pb2.GetStatsResponse:
    return admin_pb2.GetStatsResponse(
        transfers=_counters(s.transfers),
        workers=s.workers,
        remote_agents=s.remote_agents,
        daemon_instance=s.daemon_instance,
        planner=planner_info_to_proto(s.planner),
        mapped_allocations=s.mapped_allocations,
        mapped_bytes=s.mapped_bytes,
        nixl_registrations=s.nixl_registrations,
        fd_handoff_pending=s.fd_handoff_pending,
        leases=s.leases,
    )


def _counters(c: TransferCounters) -> admin_pb2.TransferCounters:
    return admin_pb2.TransferCounters(
        pulls_done=c.pulls_done,
        pushes_done=c.pushes_done,
        failed=c.failed,
        bytes=c.bytes,
        descriptors=c.descriptors,
        blocks=c.blocks,
        served_done=c.served_done,
        served_blocks=c.served_blocks,
        push_offers_relayed=c.push_offers_relayed,
        push_offers_refused=c.push_offers_refused,
    )
