"""The connector's log lines name a transfer with the ids and field names
of kvmapd's JSON lines (issue 26): a successful load's line carries the
transfer id the decode daemon made (the one both daemons log), a failed
load's warning the daemons' request id, this engine's, the prefill daemon
and the worker."""

from __future__ import annotations

import logging
import re

import pytest
from test_pd_connector import Side, pair, prefill_request, step

from kvmap.core.errors import PermissionDenied, Unavailable
from kvmap.core.peer_policy import INBOUND_DENIED
from kvmap.v1 import transfers_pb2

__all__ = ["pair"]  # the fixture, used by name


def _lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level]


def test_a_loaded_request_is_logged_with_its_transfer_id(
    pair: tuple[Side, Side], caplog: pytest.LogCaptureFixture
) -> None:
    """At debug, the load's line names the prefill request, this engine's
    request, the prefill daemon, its worker and a transfer id, the one the
    decode daemon answered with (what its logs and the owner's name)."""
    p, d = pair
    kv = prefill_request(p, "req-p", [1, 2], tokens=20)
    with caplog.at_level(logging.DEBUG, logger="kvmap.client.connector"):
        d.sched.after_alloc("req-d", dict(kv), [[7, 8]], 20)
        r = step(d)
    assert r.finished_recving == {"req-d"} and not r.failed_recving
    (line,) = [m for m in _lines(caplog, logging.DEBUG) if "loaded" in m]
    found = re.match(
        r"request_id=req-p local_request_id=req-d transfer_id=(\w+) "
        rf"peer={re.escape(p.daemon.target)} worker=prefill/dp0/tp0/pp0: loaded \d+ bytes$",
        line,
    )
    assert found, line
    assert len(found.group(1)) == 16  # the daemon's id, not an empty field


def test_a_failed_load_is_a_warning_with_the_request_and_peer_ids(
    pair: tuple[Side, Side], caplog: pytest.LogCaptureFixture
) -> None:
    """A pull the daemon fails is logged at warning with the same words:
    the daemons' request id, this engine's, the prefill daemon and worker."""
    p, d = pair
    kv = prefill_request(p, "req-p", [1, 2], tokens=20)

    def fail(spec: transfers_pb2.TransferSpec) -> None:
        raise Unavailable("UNAVAILABLE: peer unreachable")

    d.daemon.pull_hook = fail
    with caplog.at_level(logging.WARNING, logger="kvmap.client.connector"):
        d.sched.after_alloc("req-d", dict(kv), [[7, 8]], 20)
        r = step(d)
    assert r.failed_recving == {"req-d"}
    (line,) = [m for m in _lines(caplog, logging.WARNING) if "load failure" in m]
    assert line.startswith(
        f"request_id=req-p local_request_id=req-d peer={p.daemon.target} "
        "worker=prefill/dp0/tp0/pp0: loading its KV failed"
    ), line


def test_a_load_refused_as_an_unauthorized_peer_names_the_cause_and_the_fix(
    pair: tuple[Side, Side], caplog: pytest.LogCaptureFixture
) -> None:
    """When the prefill daemon refused the decode daemon as a peer (the error
    a decode kvmapd returns for it: tests/integration/test_refused_peers.py),
    the failed load's warning ends with the cause and the fix: the same
    --peer-secret-file on both daemons, or mutual TLS."""
    p, d = pair
    kv = prefill_request(p, "req-p", [1, 2], tokens=20)

    def refuse(spec: transfers_pb2.TransferSpec) -> None:
        raise PermissionDenied(
            f"PERMISSION_DENIED: remote daemon {p.daemon.target}: PERMISSION_DENIED: "
            f"{INBOUND_DENIED}"
        )

    d.daemon.pull_hook = refuse
    with caplog.at_level(logging.WARNING, logger="kvmap.client.connector"):
        d.sched.after_alloc("req-d", dict(kv), [[7, 8]], 20)
        r = step(d)
    assert r.failed_recving == {"req-d"}
    (line,) = [m for m in _lines(caplog, logging.WARNING) if "load failure" in m]
    assert "reported as a load failure. Cause: the remote kvmapd does not accept" in line, line
    assert "the same --peer-secret-file" in line and "mutual TLS" in line, line
