"""One transfer is one story across both daemons' JSON logs (issue 26): a
successful pull and a refused one (a capability the owner never granted)
between two real daemons, and every line about each, on the decode daemon
and on the prefill (owner) daemon, carries the vLLM request id, one
transfer id the decode daemon made and sent, the peer's address and
agent, and the worker, under the same field names; the refusal is at
warning on both sides; ``request_id`` never holds an RPC's own id."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from kvmap.tools.grants import granted
from kvmap.tools.launch import DaemonProc, WorkerProc, start_daemon, start_worker

pytestmark = pytest.mark.integration

GEO = ("--blocks", "8", "--block-tokens", "16", "--mla-layers", "2")
IDS = ("request_id", "transfer_id", "peer", "peer_agent", "worker")
OWNER_WORKER = "prefill/dp0/tp0/pp0"


@dataclass
class Logs:
    decode: list[dict[str, Any]]
    prefill: list[dict[str, Any]]
    prefill_target: str
    decode_agent: str
    prefill_agent: str


def _json_lines(daemon: DaemonProc) -> list[dict[str, Any]]:
    """The daemon's own lines (those of Python's logging, gRPC's debug
    chatter, carry a ``logger`` field)."""
    lines = []
    for raw in daemon.log().splitlines():
        if raw.startswith("{"):
            lines.append(json.loads(raw))
    return [line for line in lines if "logger" not in line]


def _pull(prefill: WorkerProc, decode: WorkerProc, target: str, **extra: Any) -> dict[str, Any]:
    cmd = {
        "cmd": "pull",
        "remote_target": target,
        "remote_worker": {"engine_id": "prefill"},
        "groups": [{"group": 0, "local": [1, 2], "remote": [3, 4]}],
        "timeout_ms": 5000,
        **extra,
    }
    if "capability" not in cmd:
        cmd = granted(prefill, cmd)
    return decode.call(cmd)


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Logs]:
    """Both daemons' log lines after one good pull and one refused pull (at
    debug, so that successful transfers log too)."""
    tmp = tmp_path_factory.mktemp("corr")
    debug = ("--log-level", "debug")
    daemons = [start_daemon(tmp / n, *debug, name=n) for n in ("prefill", "decode")]
    workers: list[WorkerProc] = []
    try:
        workers.append(start_worker(daemons[0], "prefill", *GEO, "--fill"))
        workers.append(start_worker(daemons[1], "decode", *GEO))
        target = daemons[0].tcp_target
        ok = _pull(workers[0], workers[1], target, request_id="corr-ok")
        assert ok["ok"], ok
        bad = _pull(workers[0], workers[1], target, request_id="corr-bad", capability="forged")
        assert not bad["ok"] and "PERMISSION_DENIED" in json.dumps(bad), bad
    finally:
        for w in workers:
            w.stop()
        for d in daemons:
            assert d.terminate() == 0, d.log()
    yield Logs(
        decode=_json_lines(daemons[1]),
        prefill=_json_lines(daemons[0]),
        prefill_target=daemons[0].tcp_target,
        decode_agent=daemons[1].agent,
        prefill_agent=daemons[0].agent,
    )


def _about(lines: list[dict[str, Any]], key: str, value: str) -> list[dict[str, Any]]:
    return [line for line in lines if line.get(key) == value]


def test_a_pull_is_logged_under_the_same_ids_on_both_daemons(logs: Logs) -> None:
    """The decode daemon's lines of the good pull (handshake, completion)
    name the owner's address, agent and worker and one transfer id; the
    owner's lines under that transfer id (lease begun, notification) name
    the same request and worker, the caller's address and agent."""
    decode = _about(logs.decode, "request_id", "corr-ok")
    assert {"peer_handshake", "transfer_done"} <= {line["event"] for line in decode}
    (transfer_id,) = {line["transfer_id"] for line in decode}
    assert transfer_id
    for line in decode:
        assert (line["peer"], line["peer_agent"], line["worker"]) == (
            logs.prefill_target,
            logs.prefill_agent,
            OWNER_WORKER,
        ), line
    owner = _about(logs.prefill, "transfer_id", transfer_id)
    assert {"transfer_begun", "transfer_finished"} <= {line["event"] for line in owner}
    for line in owner:
        assert {k: line[k] for k in IDS} == {
            "request_id": "corr-ok",
            "transfer_id": transfer_id,
            "peer": "127.0.0.1",
            "peer_agent": logs.decode_agent,
            "worker": OWNER_WORKER,
        }, line


def test_a_refused_pull_is_a_warning_with_the_same_ids_on_both_daemons(logs: Logs) -> None:
    """The refusal is logged at warning by both daemons, each line with the
    vLLM request id and the one transfer id, the peer and the worker; the
    RPC's own id is in rpc_id, never in request_id."""
    (decode,) = [
        line
        for line in _about(logs.decode, "request_id", "corr-bad")
        if line["event"] == "rpc_rejected"
    ]
    assert decode["level"] == "warning" and decode["code"] == "PERMISSION_DENIED"
    assert decode["rpc_id"] and decode["rpc_id"] != decode["request_id"]
    assert (decode["peer"], decode["peer_agent"], decode["worker"]) == (
        logs.prefill_target,
        logs.prefill_agent,
        OWNER_WORKER,
    )
    # The decode asks again while the grant may still be on its way
    # (core.retry.GRANT_RACE_S): the owner refuses each attempt, every line
    # with the same ids.
    owner_lines = _about(logs.prefill, "transfer_id", decode["transfer_id"])
    assert owner_lines
    for owner in owner_lines:
        assert owner["event"] == "rpc_rejected" and owner["level"] == "warning"
        assert {k: owner[k] for k in IDS} == {
            "request_id": "corr-bad",
            "transfer_id": decode["transfer_id"],
            "peer": "127.0.0.1",
            "peer_agent": logs.decode_agent,
            "worker": OWNER_WORKER,
        }


def test_request_id_only_ever_means_the_vllm_request(logs: Logs) -> None:
    """On every line of either daemon (registrations, grants, attaches and
    the pulls alike) a request_id is one of the vLLM ids the test used."""
    seen = {line["request_id"] for line in logs.decode + logs.prefill if "request_id" in line}
    assert seen <= {"corr-ok", "corr-bad"} and "corr-bad" in seen
