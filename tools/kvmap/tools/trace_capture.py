"""Capture the worked example of docs/runbook.md ("Following one request"):
one slow and one refused P/D load through two real kvmapd processes and the
connector, traced to a local OTLP receiver, and printed as an operator
finds them: the connector's lines (vLLM's log), the request's trace, and
the owner daemon's JSON lines of the transfer.

    python -m kvmap.tools.trace_capture [--pause-s 1.0]

The slow load meets the prefill daemon paused (SIGSTOP) for ``--pause-s``
as its pull begins; the refused one presents a capability nobody granted.
``offer`` and ``load`` drive the connector as vLLM would, without vLLM
(tests/integration/test_traces.py uses them too)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvmap.client.client import KvmapClient
from kvmap.client.connector import ConnectorOptions, SchedulerCore, WorkerCore
from kvmap.client.connector.traces import connector_tracer
from kvmap.tools.launch import DaemonProc, WorkerProc, start_daemon, start_worker
from kvmap.tools.trace_receiver import ReceivedSpan, TraceReceiver
from kvmap.v1 import types_pb2

GEO = ("--blocks", "8", "--block-tokens", "16", "--mla-layers", "2")
# The prefill engine's blocks offered, the decode engine's they load into.
PREFILL_BLOCKS, DECODE_BLOCKS, TOKENS = [[3, 4]], [[1, 2]], 32


def offer(
    prefill: DaemonProc,
    endpoint: str,
    request_id: str,
    trace_headers: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The kv_transfer_params the prefill connector returns for a finished
    ``request_id`` (its blocks granted), under vLLM's ``trace_headers``."""
    opts = ConnectorOptions(
        socket=prefill.socket,
        peer_address=prefill.tcp_target,
        decode_tp_size=1,
        otlp_traces_endpoint=endpoint,
    )
    sched = SchedulerCore("prefill", opts, client=KvmapClient.connect(prefill.socket))
    params: dict[str, Any] = {"do_remote_decode": True}
    sched.after_alloc(request_id, params, PREFILL_BLOCKS, 0)
    keep, kv = sched.request_finished(
        request_id,
        params,
        finished_normally=True,
        block_ids=PREFILL_BLOCKS,
        num_computed_tokens=TOKENS,
        trace_headers=trace_headers,
    )
    if not keep or kv is None:
        raise RuntimeError(f"{request_id}: the prefill connector offered no KV")
    return kv


def load(
    decode: DaemonProc,
    endpoint: str,
    loads: list[tuple[str, dict[str, Any], str]],
    engine: str = "decode",
) -> list[tuple[str, bool]]:
    """The connector of decode ``engine`` loads each (request id, params,
    vLLM's traceparent of the request or "") as vLLM's scheduler and worker
    would: (request id, ok) of each, once all ended."""
    opts = ConnectorOptions(socket=decode.socket, otlp_traces_endpoint=endpoint)
    sched = SchedulerCore(engine, opts)
    client = KvmapClient.connect(decode.socket)
    worker = WorkerCore(client, types_pb2.WorkerId(engine_id=engine), opts)
    try:
        for request_id, kv, vllm_trace in loads:
            headers = {"traceparent": vllm_trace} if vllm_trace else None
            sched.num_new_matched_tokens(request_id, kv, TOKENS, 0)
            sched.after_alloc(request_id, kv, DECODE_BLOCKS, TOKENS, trace_headers=headers)
        worker.start(sched.build_meta())
        deadline = time.monotonic() + 60
        while worker.pending_loads and time.monotonic() < deadline:
            worker.poll()
            time.sleep(0.02)  # vLLM polls once a step
    finally:
        worker.shutdown()
    return [(r.request_id, r.ok) for r in worker.loads]


def _paused(daemon: DaemonProc, seconds: float) -> threading.Timer:
    """Stop ``daemon`` now and let it go on after ``seconds``."""
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    resume = threading.Timer(seconds, os.kill, (daemon.proc.pid, signal.SIGCONT))
    resume.start()
    return resume


class _Lines(logging.Handler):
    """The connector's log lines, as vLLM's log shows them."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self.setFormatter(logging.Formatter("%(levelname)s [%(name)s] %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def _tree(spans: list[ReceivedSpan], trace_id: str) -> list[str]:
    """The trace's spans, each under its parent, by start time (a span whose
    parent is not exported, vLLM's or none, at the top)."""
    mine = sorted((s for s in spans if s.trace_id == trace_id), key=lambda s: s.start_ns)
    ids = {s.span_id for s in mine}
    children: dict[str, list[ReceivedSpan]] = {}
    for s in mine:
        children.setdefault(s.parent_span_id if s.parent_span_id in ids else "", []).append(s)
    out: list[str] = []

    def walk(parent: str, depth: int) -> None:
        for s in children.get(parent, []):
            out.append(_span_line(s, depth))
            walk(s.span_id, depth + 1)

    walk("", 0)
    return out


_SHOWN = ("request_id", "transfer_id", "peer", "peer_agent", "worker", "blocks", "bytes", "code")


def _span_line(s: ReceivedSpan, depth: int) -> str:
    attrs = " ".join(
        f"{k}={s.attributes[f'kvmap.{k}']}" for k in _SHOWN if f"kvmap.{k}" in s.attributes
    )
    status = " ERROR" if s.status[0] == 2 else ""
    events = f" events={','.join(s.events)}" if s.events else ""
    return f"{'  ' * depth}{s.name} [{s.service}] {s.ms:.1f} ms{status} {attrs}{events}"


def _owner_lines(daemon: DaemonProc, transfer_id: str) -> list[str]:
    """The daemon's JSON lines about ``transfer_id``."""
    found = []
    for raw in daemon.log().splitlines():
        if raw.startswith("{") and json.loads(raw).get("transfer_id") == transfer_id:
            found.append(raw)
    return found


def _report(title: str, request_id: str, run: dict[str, Any]) -> None:
    """One request, followed from the connector's line to the owner's."""
    spans: list[ReceivedSpan] = run["spans"]
    print(f"\n=== {title}: {request_id} ===\n-- vLLM's log (the decode connector):")
    for line in run["connector"]:
        if f"request_id={request_id}" in line:
            print(line)
    pull = next(
        s
        for s in spans
        if s.name == "kvmap.pull" and s.attributes["kvmap.request_id"] == request_id
    )
    print(f"-- the trace ({pull.trace_id}):")
    print("\n".join(_tree(spans, pull.trace_id)))
    print(f"-- the owner daemon's lines of transfer {pull.attributes['kvmap.transfer_id']}:")
    print("\n".join(_owner_lines(run["prefill"], str(pull.attributes["kvmap.transfer_id"]))))


def capture(workdir: Path, pause_s: float) -> dict[str, Any]:
    """Run both requests; the spans, the connector's lines and the daemons."""
    receiver = TraceReceiver()
    lines = _Lines()
    logging.getLogger("kvmap.client.connector").addHandler(lines)
    logging.getLogger("kvmap.client.connector").setLevel(logging.DEBUG)
    flags = ("--otlp-traces-endpoint", receiver.endpoint, "--log-level", "debug")
    daemons = [start_daemon(workdir / n, *flags, name=n) for n in ("prefill", "decode")]
    workers: list[WorkerProc] = []
    try:
        workers.append(start_worker(daemons[0], "prefill", *GEO, "--fill"))
        workers.append(start_worker(daemons[1], "decode", *GEO))
        slow = offer(daemons[0], receiver.endpoint, "cmpl-slow-1")
        resume = _paused(daemons[0], pause_s)
        load(daemons[1], receiver.endpoint, [("cmpl-slow-1-d", slow, "")])
        resume.join()
        refused = offer(daemons[0], receiver.endpoint, "cmpl-refused-2")
        refused["kvmap_capability"] = "forged"  # a capability nobody granted
        load(daemons[1], receiver.endpoint, [("cmpl-refused-2-d", refused, "")])
        connector_tracer(ConnectorOptions(otlp_traces_endpoint=receiver.endpoint)).flush()
    finally:
        for w in workers:
            w.stop()
        for d in daemons:
            d.terminate()
    spans = receiver.wait_for(lambda s: sum(x.name == "kvmap.lease" for x in s) >= 2)
    receiver.stop()
    return {"spans": spans, "connector": lines.lines, "prefill": daemons[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--pause-s", type=float, default=1.0, help="how long the owner is paused")
    args = parser.parse_args(argv)
    os.environ.setdefault("OTEL_BSP_SCHEDULE_DELAY", "100")
    with tempfile.TemporaryDirectory(prefix="kvmap-trace-") as tmp:
        run = capture(Path(tmp), args.pause_s)
        _report("slow load (owner paused)", "cmpl-slow-1", run)
        _report("refused load (forged capability)", "cmpl-refused-2", run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
