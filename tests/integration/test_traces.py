"""One request's KV is one OpenTelemetry trace (issue 26): a prefill engine's
connector grants a finished request's blocks, a decode engine's connector
loads them through two real kvmapd processes (real NIXL), and every span
reaches a real OTLP/gRPC receiver (the collector's TraceService) started
here: the connector's grant and load, the owner daemon's grant and lease,
the decode daemon's pull with its handshake, plan, post and wait, each a
child of the one before it across the processes (W3C traceparent in gRPC
metadata and in kv_transfer_params), joined to vLLM's trace of the request,
and carrying the request id, transfer id, peer, agent, worker and bytes. A
refused pull's spans say PERMISSION_DENIED on all three. With no endpoint
configured nothing reaches a listening receiver."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvmap.client.connector import ConnectorOptions
from kvmap.client.connector.traces import connector_tracer
from kvmap.tools.grants import granted
from kvmap.tools.launch import DaemonProc, WorkerProc, start_daemon, start_worker
from kvmap.tools.trace_capture import load, offer
from kvmap.tools.trace_receiver import ReceivedSpan, TraceReceiver

pytestmark = pytest.mark.integration

GEO = ("--blocks", "8", "--block-tokens", "16", "--mla-layers", "2")
OWNER_WORKER = "prefill/dp0/tp0/pp0"
# vLLM's spans of the prefill and of the refused decode request (their trace_headers).
VLLM_PREFILL = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
VLLM_DECODE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
PREFILL_TRACE = {"traceparent": VLLM_PREFILL}
SERVER = 2  # SpanKind SERVER in OTLP
ERROR = 2  # Status code ERROR in OTLP


@dataclass
class Run:
    spans: list[ReceivedSpan]
    prefill: DaemonProc
    decode: DaemonProc


def _otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No standard OTel variable of the machine turns tracing on or off here."""
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # batches sent within 0.1 s


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """Spans of one good and one refused P/D load (a forged capability)."""
    tmp = tmp_path_factory.mktemp("traces")
    receiver = TraceReceiver()
    with pytest.MonkeyPatch.context() as mp:
        _otel_env(mp)
        flags = ("--otlp-traces-endpoint", receiver.endpoint)
        daemons = [start_daemon(tmp / n, *flags, name=n) for n in ("prefill", "decode")]
        workers: list[WorkerProc] = []
        try:
            workers.append(start_worker(daemons[0], "prefill", *GEO, "--fill"))
            workers.append(start_worker(daemons[1], "decode", *GEO))
            good = offer(daemons[0], receiver.endpoint, "p-ok", PREFILL_TRACE)
            forged = {
                **offer(daemons[0], receiver.endpoint, "p-bad", PREFILL_TRACE),
                "kvmap_capability": "forged",
            }
            # One after the other: the first pull's span holds the handshake.
            ok = load(daemons[1], receiver.endpoint, [("d-ok", good, "")], "decode")
            refused = load(
                daemons[1], receiver.endpoint, [("d-bad", forged, VLLM_DECODE)], "decode"
            )
            # A block the owner's worker does not have: refused by the decode
            # daemon's plan, before the owner is asked.
            beyond = {
                **offer(daemons[0], receiver.endpoint, "p-range"),
                "remote_block_ids": [[3, 99]],
            }
            unplanned = load(daemons[1], receiver.endpoint, [("d-range", beyond, "")], "decode")
            assert ok + refused + unplanned == [
                ("d-ok", True),
                ("d-bad", False),
                ("d-range", False),
            ]
            # A layer the owner's worker does not have: refused while the
            # decode daemon prepares the lists, before any plan.
            unprepared = workers[1].call(
                granted(
                    workers[0],
                    {
                        "cmd": "pull",
                        "request_id": "w-layer",
                        "remote_target": daemons[0].tcp_target,
                        "remote_worker": {"engine_id": "prefill"},
                        "groups": [{"group": 0, "local": [1], "remote": [3], "layers": ["nope"]}],
                    },
                )
            )
            assert not unprepared["ok"], unprepared
            connector_tracer(ConnectorOptions(otlp_traces_endpoint=receiver.endpoint)).flush()
        finally:
            for w in workers:
                w.stop()
            for d in daemons:
                assert d.terminate() == 0, d.log()  # a stopping daemon exports what it holds
    spans = receiver.wait_for(lambda s: sum(x.name == "kvmap.lease" for x in s) >= 2)
    receiver.stop()
    yield Run(spans, daemons[0], daemons[1])


def _rid(span: ReceivedSpan) -> object:
    return span.attributes.get("kvmap.request_id")


def _one(spans: list[ReceivedSpan], name: str, request_id: str) -> ReceivedSpan:
    (span,) = [
        s for s in spans if s.name == name and s.attributes["kvmap.request_id"] == request_id
    ]
    return span


def _children(spans: list[ReceivedSpan], parent: ReceivedSpan) -> dict[str, ReceivedSpan]:
    return {s.name: s for s in spans if s.parent_span_id == parent.span_id}


def test_a_pd_load_is_one_trace_across_the_connector_and_both_daemons(run: Run) -> None:
    """vLLM's prefill span > connector grant > owner daemon's grant; the
    grant > connector load > decode daemon's pull > its handshake, plan,
    post and wait, and the owner daemon's lease (notified, its worker told):
    one trace id, each span the child of the one it names."""
    spans = run.spans
    grant = _one(spans, "kvmap.connector.grant", "p-ok")
    trace_id, vllm_span = VLLM_PREFILL.split("-")[1:3]
    assert (grant.trace_id, grant.parent_span_id, grant.service) == (
        trace_id, vllm_span, "kvmap-connector",
    )  # fmt: skip
    assert _one(spans, "kvmap.grant", "p-ok").parent_span_id == grant.span_id
    load = _one(spans, "kvmap.connector.load", "p-ok")
    assert load.parent_span_id == grant.span_id and load.status[0] != ERROR
    pull = _one(spans, "kvmap.pull", "p-ok")
    assert (pull.parent_span_id, pull.kind, pull.service) == (load.span_id, SERVER, "kvmapd")
    parts = _children(spans, pull)
    assert {
        "kvmap.handshake", "kvmap.plan", "kvmap.post", "kvmap.wait", "kvmap.lease", "kvmap.notify"
    } <= set(parts), sorted(parts)  # fmt: skip
    lease = parts["kvmap.lease"]
    assert {"notified", "worker_told"} <= set(lease.events) and lease.status[0] != ERROR
    # Told after the caller heard DONE: the notify span may end after the pull's.
    notify = parts["kvmap.notify"]
    assert "owner_notified" in notify.events and notify.status[0] != ERROR
    assert {s.trace_id for s in (grant, load, pull, *parts.values())} == {trace_id}


def test_the_spans_carry_the_ids_the_logs_name(run: Run) -> None:
    """The pull and the lease carry the vLLM request id, the one transfer id
    the decode daemon made, the peer's address and agent, the owner's worker,
    and the blocks and bytes; the connector's load the same transfer id."""
    pull = _one(run.spans, "kvmap.pull", "p-ok").attributes
    lease = _one(run.spans, "kvmap.lease", "p-ok").attributes
    load = _one(run.spans, "kvmap.connector.load", "p-ok").attributes
    assert pull["kvmap.transfer_id"] == lease["kvmap.transfer_id"] == load["kvmap.transfer_id"]
    assert (pull["kvmap.peer"], pull["kvmap.peer_agent"], pull["kvmap.worker"]) == (
        run.prefill.tcp_target, run.prefill.agent, OWNER_WORKER,
    )  # fmt: skip
    assert (lease["kvmap.peer"], lease["kvmap.peer_agent"], lease["kvmap.worker"]) == (
        "127.0.0.1", run.decode.agent, OWNER_WORKER,
    )  # fmt: skip
    assert pull["kvmap.blocks"] == lease["kvmap.blocks"] == 2
    assert pull["kvmap.bytes"] == lease["kvmap.bytes"] == load["kvmap.bytes"] > 0
    assert load["kvmap.local_request_id"] == "d-ok" and load["kvmap.peer"] == run.prefill.tcp_target


def test_a_refused_pull_is_an_error_span_on_all_three_under_vllms_decode_trace(run: Run) -> None:
    """The forged capability's load, pull and lease are ERROR spans named
    PERMISSION_DENIED; the load joins vLLM's trace of the decode request
    and links to the prefill's grant span."""
    load = _one(run.spans, "kvmap.connector.load", "p-bad")
    pull = _one(run.spans, "kvmap.pull", "p-bad")
    # One lease span per attempt: the decode asks again while the grant may
    # still be on its way (core.retry.GRANT_RACE_S), each refused.
    leases = [s for s in run.spans if s.name == "kvmap.lease" and _rid(s) == "p-bad"]
    assert leases
    for span in (load, pull, *leases):
        assert span.status == (ERROR, "PERMISSION_DENIED"), span
    trace_id, vllm_span = VLLM_DECODE.split("-")[1:3]
    assert (load.trace_id, load.parent_span_id) == (trace_id, vllm_span)
    assert load.links == (_one(run.spans, "kvmap.connector.grant", "p-bad").span_id,)
    assert pull.parent_span_id == load.span_id
    assert {lease.parent_span_id for lease in leases} == {pull.span_id}


def test_a_refused_plan_is_an_error_span_under_the_pull(run: Run) -> None:
    """A pull its own daemon refuses while planning (a remote block out of
    range) or while preparing its lists (a layer the owner lacks) ends its
    plan span as an ERROR, a child of the pull, which fails the same way;
    the owner never saw it (no lease)."""
    for request_id in ("p-range", "w-layer"):
        pull = _one(run.spans, "kvmap.pull", request_id)
        plan = _children(run.spans, pull)["kvmap.plan"]
        assert plan.status == pull.status and plan.status[0] == ERROR, (plan, pull)
        assert plan.status[1] in {"INVALID_ARGUMENT", "NOT_FOUND"}, plan
        assert not [
            s
            for s in run.spans
            if s.name == "kvmap.lease" and s.attributes["kvmap.request_id"] == request_id
        ]


def test_with_tracing_off_nothing_reaches_a_listening_receiver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the standard variables naming a listening receiver but the SDK
    disabled (OTEL_SDK_DISABLED=true), a daemon and connectors with no
    endpoint of their own grant, refuse a load (the worker reading itself
    through its daemon, with a forged capability) and stop without sending
    the receiver anything; the offered params carry no traceparent."""
    _otel_env(monkeypatch)
    receiver = TraceReceiver()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    daemon = start_daemon(tmp_path / "d", name="off")
    worker = start_worker(daemon, "prefill", *GEO, "--fill")
    try:
        kv = offer(daemon, "", "p-off", PREFILL_TRACE)
        assert "kvmap_traceparent" not in kv
        forged = {**kv, "kvmap_capability": "forged"}
        assert load(daemon, "", [("d-off", forged, VLLM_DECODE)], "prefill") == [("d-off", False)]
    finally:
        worker.stop()
        assert daemon.terminate() == 0, daemon.log()
    time.sleep(0.3)  # three of the batches' schedule delays
    assert receiver.exports == 0
    receiver.stop()
