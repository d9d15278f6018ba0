"""Plain-text views of ``Admin.GetStatus`` for ``kvmapctl status``,
``transfers``, ``peers`` and ``grants``: a section per list, its columns
those an operator reads first; ``-o wide`` adds the rest."""

from __future__ import annotations

import datetime
import json

from kvmap.core.peer_policy import INBOUND_DENIED
from kvmap.daemon.cli.tables import Column, bytes_text, columns_table, worker_id, workers_table
from kvmap.v1 import admin_pb2

Status = admin_pb2.GetStatusResponse


def duration(ms: float) -> str:
    """``850ms``, ``4.2s``, ``3m07s``, ``2h05m``, ``3d04h``: an age at a glance."""
    if ms < 1000:
        return f"{int(ms)}ms"
    s = ms / 1000
    if s < 60:
        return f"{s:.1f}s"
    m, sec = divmod(int(s), 60)
    if m < 60:
        return f"{m}m{sec:02d}s"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h}h{m:02d}m"
    d, h = divmod(h, 24)
    return f"{d}d{h:02d}h"


def _clock(unix_ms: int) -> str:
    """Wall time in UTC, as the daemon's JSON logs stamp it."""
    at = datetime.datetime.fromtimestamp(unix_ms / 1000, tz=datetime.UTC)
    return at.strftime("%Y-%m-%dT%H:%M:%S.") + f"{at.microsecond // 1000:03d}Z"


def _section(title: str, shown: int, total: int, table: list[str]) -> list[str]:
    count = f"{total}" if shown == total else f"{shown} of {total}"
    return ["", f"{title} ({count})", *(table if shown else ["(none)"])]


def render_transfers(st: Status, wide: bool = False) -> list[str]:
    columns: list[Column[admin_pb2.InFlightTransfer]] = [
        Column("request", lambda t: t.request_id),
        Column("kind", lambda t: t.kind),
        Column("local", lambda t: worker_id(t.local_worker)),
        Column("target", lambda t: t.remote_target),
        Column("remote", lambda t: worker_id(t.remote_worker)),
        Column("phase", lambda t: t.phase or "started"),
        Column("age", lambda t: duration(t.age_ms), numeric=True),
        Column("started", lambda t: _clock(t.started_unix_ms), wide=True),
    ]
    table = columns_table(columns, st.transfers, wide)
    return _section("TRANSFERS IN FLIGHT", len(st.transfers), st.transfers_total, table)


def render_peers(st: Status, wide: bool = False) -> list[str]:
    columns: list[Column[admin_pb2.PeerStatus]] = [
        Column("target", lambda p: p.target),
        Column("agent", lambda p: p.agent_name),
        Column("instance", lambda p: p.daemon_instance, wide=True),
        Column(
            "workers (generation)",
            lambda p: ", ".join(f"{worker_id(w.worker)} ({w.generation})" for w in p.workers),
        ),
    ]
    table = columns_table(columns, st.peers, wide)
    return _section("PEERS", len(st.peers), len(st.peers), table)


def render_leases(st: Status, wide: bool = False) -> list[str]:
    columns: list[Column[admin_pb2.LeaseStatus]] = [
        Column("request", lambda lease: lease.request_id),
        Column("worker", lambda lease: worker_id(lease.worker)),
        Column("peer agent", lambda lease: lease.peer_agent),
        Column("kind", lambda lease: "push" if lease.write else "pull"),
        Column("blocks", lambda lease: str(lease.blocks), numeric=True),
        Column("bytes", lambda lease: bytes_text(lease.bytes), numeric=True, wide=True),
        Column("expires in", lambda lease: duration(lease.expires_in_ms), numeric=True),
    ]
    table = columns_table(columns, st.leases, wide)
    return _section("LEASES", len(st.leases), st.leases_total, table)


def _uses(g: admin_pb2.GrantStatus) -> str:
    return f"{g.uses}/{g.max_uses}" if g.max_uses else f"{g.uses}/open"


def render_grants(st: Status, wide: bool = False) -> list[str]:
    columns: list[Column[admin_pb2.GrantStatus]] = [
        Column("request", lambda g: g.request_id),
        Column("worker", lambda g: worker_id(g.worker)),
        Column("gen", lambda g: str(g.generation), numeric=True, wide=True),
        Column("blocks", lambda g: str(g.blocks), numeric=True),
        Column("uses", _uses, numeric=True),
        Column("claimed by", lambda g: g.claimed_by or "-"),
        Column("active", lambda g: str(g.active), numeric=True, wide=True),
        Column("expires", lambda g: _clock(g.expires_unix_ms)),
    ]
    table = columns_table(columns, st.grants, wide)
    return _section("GRANTS", len(st.grants), st.grants_total, table)


def render_errors(st: Status, wide: bool = False) -> list[str]:
    columns: list[Column[admin_pb2.RecentError]] = [
        Column("time", lambda e: _clock(e.at_unix_ms)),
        Column("listener", lambda e: e.listener, wide=True),
        Column("method", lambda e: e.method),
        Column("code", lambda e: e.code),
        Column("request", lambda e: e.request_id, wide=True),
        Column("message", lambda e: e.message if wide else _cut(e.message, 100)),
    ]
    table = columns_table(columns, st.recent_errors, wide)
    return _section("RECENT ERRORS", len(st.recent_errors), len(st.recent_errors), table)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _head(st: Status) -> list[str]:
    c = st.stats.transfers
    state = "draining" if st.draining else "serving"
    planner = st.stats.planner
    return [
        f"kvmapd {st.version}  instance {st.daemon_instance}  agent {st.agent_name}  "
        f"up {duration(st.uptime_seconds * 1000)}  {state}",
        f"planner {planner.name} v{planner.version}  socket {_config(st, 'socket')}  "
        f"listen {_config(st, 'listen')}",
        f"transfers done: {c.pulls_done} pulls, {c.pushes_done} pushes, {c.failed} failed, "
        f"{bytes_text(c.bytes)}; served to peers: {c.served_done}",
        *peer_lines(st),
    ]


# What admits peers, and where to read how (the same fix on both sides).
PEER_FIX = (
    "start every kvmapd with the same --peer-secret-file (each peer's address in the "
    "other's --peer-accept), or with mutual TLS and --peer-identity (docs/security.md)"
)


def peer_lines(st: Status) -> list[str]:
    """How peers are authenticated and whether any are refused, either way:
    peers this daemon refused (``peer_calls_refused``) and calls of its own
    that remote daemons refused (among the recent errors). A daemon with no
    peer authentication refuses every peer, so every load from it fails."""
    auth = st.peer_authentication
    refused = st.peer_calls_refused
    last = st.last_peer_refusal
    latest = (
        f"; last {_clock(last.at_unix_ms)} from {last.peer}: {last.reason}" if last.peer else ""
    )
    if auth == admin_pb2.PEER_AUTHENTICATION_NONE:
        lines = [
            "peers: NO PEER AUTHENTICATION (no --peer-secret-file, no mutual TLS): every peer "
            f"daemon is refused ({refused} calls so far), so no load from this daemon succeeds;",
            f"  fix: {PEER_FIX}",
        ]
    elif auth == admin_pb2.PEER_AUTHENTICATION_UNSPECIFIED:
        lines = []  # a daemon that predates the fields
    else:
        how = "mutual TLS" if auth == admin_pb2.PEER_AUTHENTICATION_MUTUAL_TLS else "peer secret"
        lines = [f"peers: authenticated by {how}; {refused} calls refused{latest}"]
        if refused:
            lines.append(f"  a refused peer daemon cannot load from this one: {PEER_FIX}")
    outbound = [e for e in st.recent_errors if e.listener != "tcp" and INBOUND_DENIED in e.message]
    if outbound:
        lines += [
            f"peers: remote daemons refused {len(outbound)} recent calls of this daemon "
            "(not an authorized peer there; RECENT ERRORS);",
            f"  fix: {PEER_FIX}",
        ]
    return lines


def _config(st: Status, key: str) -> str:
    """A config value as the operator typed it (strings unquoted)."""
    raw = st.config.get(key)
    if raw is None:
        return "-"
    value = json.loads(raw)
    return value if isinstance(value, str) else raw


def render_status(st: Status, wide: bool = False) -> str:
    table = workers_table(st.workers, wide)
    lines = [*_head(st), *_section("WORKERS", len(st.workers), len(st.workers), table)]
    for part in (render_transfers, render_peers, render_leases, render_grants, render_errors):
        lines += part(st, wide)
    if wide:
        lines += ["", "CONFIG", *(f"{k} = {v}" for k, v in sorted(st.config.items()))]
    return "\n".join(lines) + "\n"
