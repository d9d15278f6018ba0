"""The prefill connector's end of a request's trace: freeing the kept blocks
is a span under the grant's (OK once a peer pulled them, ERROR
DEADLINE_EXCEEDED when the lease ran out), exported to a real OTLP/gRPC
receiver on 127.0.0.1; and the params it reads from outside never carry a
malformed traceparent into a pull."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmap.client.client import KvmapClient
from kvmap.client.connector import ConnectorMeta, ConnectorOptions, RemoteSource, WorkerCore
from kvmap.client.transports import GrpcTransport
from kvmap.tools.trace_receiver import ReceivedSpan, TraceReceiver
from kvmap.v1 import registry_pb2, types_pb2

GRANT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def receiver() -> Iterator[TraceReceiver]:
    """A receiver for this module's spans."""
    r = TraceReceiver()
    yield r
    r.stop()


def _frees(worker: WorkerCore, receiver: TraceReceiver, n: int) -> list[ReceivedSpan]:
    worker.tracer.flush()
    spans = receiver.wait_for(lambda s: sum(x.name == "kvmap.connector.free" for x in s) >= n)
    return [s for s in spans if s.name == "kvmap.connector.free"]


def test_freeing_kept_blocks_is_a_span_under_the_grant(
    receiver: TraceReceiver, tmp_path: Path
) -> None:
    """A kept request freed by a peer's pull (the daemon's TransferFinished
    event) and one freed because its lease ran out are each a
    ``kvmap.connector.free`` span in the grant's trace, the second failed
    DEADLINE_EXCEEDED; a request kept without a trace makes no span."""
    clock = Clock()
    # No daemon: the expired grant's revoke fails (logged), as it may.
    client = KvmapClient(GrpcTransport(f"{tmp_path}/none.sock"), timeout_s=0.5)
    opts = ConnectorOptions(socket="/unused", otlp_traces_endpoint=receiver.endpoint)
    worker = WorkerCore(client, types_pb2.WorkerId(engine_id="p"), opts, clock=clock)
    try:
        worker.start(
            ConnectorMeta(
                send={"pulled": 10.0, "expired": 10.0, "untraced": 10.0},
                in_batch={"pulled", "expired", "untraced"},
                send_traces={"pulled": GRANT, "expired": GRANT},
            )
        )
        done = registry_pb2.TransferFinishedEvent(
            request_id="pulled", direction=registry_pb2.TRANSFER_DIRECTION_PULLED_FROM
        )
        worker.on_event(registry_pb2.AttachResponse(transfer_finished=done))
        worker.on_event(
            registry_pb2.AttachResponse(
                transfer_finished=registry_pb2.TransferFinishedEvent(
                    request_id="untraced", direction=registry_pb2.TRANSFER_DIRECTION_PULLED_FROM
                )
            )
        )
        assert worker.poll().finished_sending == {"pulled", "untraced"}
        clock.now += 11
        assert worker.poll().finished_sending == {"expired"}
        frees = {s.attributes["kvmap.request_id"]: s for s in _frees(worker, receiver, 2)}
    finally:
        worker.shutdown()
    assert set(frees) == {"pulled", "expired"}
    for span in frees.values():
        assert (span.trace_id, span.parent_span_id) == tuple(GRANT.split("-")[1:3])
    assert frees["pulled"].status[0] != 2
    assert frees["expired"].status == (2, "DEADLINE_EXCEEDED")


@pytest.mark.parametrize("value", [GRANT.upper(), GRANT[:-1], 42, "00-" + "0" * 32 + "-1-01"])
def test_a_malformed_traceparent_in_the_params_is_dropped(value: object) -> None:
    """``kvmap_traceparent`` comes through the client's HTTP body: anything
    but a well-formed W3C traceparent is read as none."""
    params = {
        "remote_target": "10.0.0.1:50051",
        "remote_engine_id": "p",
        "remote_request_id": "r",
        "remote_block_ids": [[1]],
    }
    assert RemoteSource.parse({**params, "kvmap_traceparent": GRANT}).traceparent == GRANT
    assert RemoteSource.parse({**params, "kvmap_traceparent": value}).traceparent == ""
