"""``Admin.GetStatus``: the daemon's live view in one message (what
``kvmapctl status``, ``transfers``, ``peers`` and ``grants`` print, and
what grpcurl shows on the Unix socket).

Read-only: it copies what the engine's tables hold now and changes
nothing. Served on the Unix socket only (``services.add_unix_services``):
it names peers, request ids and grants, which nothing on the network needs.
Each list is cut at ``MAX_LISTED`` entries (the totals count them all), so
the answer stays far below the message limit however busy the daemon is."""

from __future__ import annotations

import json
import time

from kvmap.core import convert
from kvmap.core.config import effective
from kvmap.core.geometry import WorkerKey
from kvmap.daemon.api import wire_out
from kvmap.daemon.engine.app import DaemonApp
from kvmap.daemon.engine.workers import WorkerRecord
from kvmap.daemon.version import VERSION
from kvmap.v1 import admin_pb2, region_maps_pb2

# Entries of each list the answer carries.
MAX_LISTED = 1000


def worker_summary(record: WorkerRecord) -> region_maps_pb2.WorkerSummary:
    m = record.model
    return region_maps_pb2.WorkerSummary(
        worker=convert.worker_id_to_proto(record.key),
        generation=m.generation,
        planner=convert.planner_info_to_proto(m.planner),
        region_count=len(m.regions),
        view_count=m.view_count,
        descriptor_count=m.descriptor_count,
        baseline_descriptor_count=m.baseline_descriptor_count,
        registered_bytes=record.memory.size_bytes,
    )


def status(app: DaemonApp) -> admin_pb2.GetStatusResponse:
    activity = app.activity
    resp = admin_pb2.GetStatusResponse(
        version=VERSION,
        daemon_instance=app.instance,
        agent_name=app.agent_name,
        started_unix_ms=activity.started_unix_ms,
        uptime_seconds=activity.uptime_s(),
        draining=app.draining,
        config={key: json.dumps(value) for key, value in effective(app.config).items()},
        stats=wire_out.stats(app.stats()),
        workers=[worker_summary(r) for r in app.table.records()],
    )
    _add_transfers(app, resp)
    _add_peers(app, resp)
    _add_peer_refusals(app, resp)
    _add_leases(app, resp)
    _add_grants(app, resp)
    for failure in activity.failures():
        resp.recent_errors.add(
            at_unix_ms=failure.at_unix_ms,
            listener=failure.listener,
            method=failure.method,
            code=failure.code,
            message=failure.message,
            request_id=failure.request_id,
        )
    return resp


def _add_transfers(app: DaemonApp, resp: admin_pb2.GetStatusResponse) -> None:
    activity = app.activity
    transfers = activity.transfers()
    resp.transfers_total = len(transfers)
    for t in transfers[:MAX_LISTED]:
        resp.transfers.add(
            request_id=t.request_id,
            kind=t.kind,
            local_worker=convert.worker_id_to_proto(t.local),
            remote_target=t.target,
            remote_worker=convert.worker_id_to_proto(t.remote),
            started_unix_ms=t.started_unix_ms,
            age_ms=int(activity.age_s(t) * 1000),
            phase=t.phase,
        )


def _add_peers(app: DaemonApp, resp: admin_pb2.GetStatusResponse) -> None:
    # The handshake cache is bounded (one entry per remote worker met lately).
    by_target: dict[str, admin_pb2.PeerStatus] = {}
    for target, worker, hs in sorted(app.engine.peer_handshakes(), key=_peer_order):
        peer = by_target.get(target)
        if peer is None:
            peer = by_target[target] = resp.peers.add(
                target=target, agent_name=hs.agent_name, daemon_instance=hs.daemon_instance
            )
        peer.workers.add(worker=convert.worker_id_to_proto(worker), generation=hs.generation)


def _add_peer_refusals(app: DaemonApp, resp: admin_pb2.GetStatusResponse) -> None:
    """How TCP peers are authenticated, and how many were refused: a daemon
    with no peer authentication, or whose peers present the wrong secret,
    fails every load from it, and this is where an operator sees why."""
    if app.config.mutual_tls:
        resp.peer_authentication = admin_pb2.PEER_AUTHENTICATION_MUTUAL_TLS
    elif app.config.peer_secret_file:
        resp.peer_authentication = admin_pb2.PEER_AUTHENTICATION_PEER_SECRET
    else:
        resp.peer_authentication = admin_pb2.PEER_AUTHENTICATION_NONE
    resp.peer_calls_refused = app.activity.peer_calls_refused
    last = app.activity.last_peer_refusal
    if last is not None:
        resp.last_peer_refusal.at_unix_ms = last.at_unix_ms
        resp.last_peer_refusal.peer = last.peer
        resp.last_peer_refusal.reason = last.reason


def _peer_order(entry: tuple[str, WorkerKey, object]) -> tuple[str, str]:
    return entry[0], str(entry[1])


def _add_leases(app: DaemonApp, resp: admin_pb2.GetStatusResponse) -> None:
    leases = sorted(app.leases.snapshot(), key=lambda lease: lease.expires_at)
    resp.leases_total = len(leases)
    now = time.monotonic()
    for lease in leases[:MAX_LISTED]:
        resp.leases.add(
            request_id=lease.request_id,
            worker=convert.worker_id_to_proto(lease.record.key),
            peer_agent=lease.peer_agent,
            write=lease.write,
            blocks=lease.blocks,
            bytes=lease.bytes,
            expires_in_ms=max(0, int((lease.expires_at - now) * 1000)),
        )


def _add_grants(app: DaemonApp, resp: admin_pb2.GetStatusResponse) -> None:
    grants = sorted(app.grants.snapshot(), key=lambda g: g[0].expires_unix_ms)
    resp.grants_total = len(grants)
    for grant, claimed_by, active in grants[:MAX_LISTED]:
        resp.grants.add(
            request_id=grant.request_id,
            worker=convert.worker_id_to_proto(grant.worker),
            generation=grant.generation,
            blocks=grant.block_count,
            uses=grant.uses,
            max_uses=0 if grant.open else grant.max_uses,
            expires_unix_ms=grant.expires_unix_ms,
            claimed_by=claimed_by,
            active=active,
        )
