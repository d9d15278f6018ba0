"""Scaffolding of test_proxy.py: stand-in upstream servers that record what
they receive, beside the real processes of ``kvmap.tools.vllm_servers``
(the proxy, vLLM's OpenAI server and a small blocking HTTP client, re-exported
here for the tests). Every wait is bounded.

The stand-ins are aiohttp servers on 127.0.0.1 in one event loop, in a
thread of the test process; a test sets an upstream's ``answer`` (an async
function of the stand-in, the request and its parsed body) to script it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvmap.tools.vllm_servers import (
    HOST,
    Proc,
    Reply,
    external_prompt_tokens,
    free_port,
    request,
    sse_events,
    start_proxy,
    start_vllm_server,
    stopping,
    tail,
    tokens_of,
    wait_healthy,
)

__all__ = [
    "PREFILL_KV",
    "Proc",
    "Reply",
    "StandIn",
    "StandIns",
    "external_prompt_tokens",
    "free_port",
    "request",
    "settled",
    "sse_events",
    "start_proxy",
    "start_vllm_server",
    "stopping",
    "tail",
    "tokens_of",
    "wait_healthy",
    "wait_until",
]

# The kv_transfer_params a stand-in prefill answers with (what a pull-mode decode gets).
PREFILL_KV = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[3, 4]],
    "remote_engine_id": "stand-in-prefill",
    "remote_request_id": "cmpl-stand-in",
    "remote_host": HOST,
    "remote_port": 1,
}


# --- stand-in upstream servers -------------------------------------------------------------


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: Any


Answer = Callable[["StandIn", web.Request, Any], Awaitable[web.StreamResponse]]


@dataclass
class StandIn:
    """A stand-in vLLM server: records each request, answers with ``answer``."""

    name: str
    answer: Answer
    port: int = 0
    seen: list[Seen] = field(default_factory=list)
    # Set, in the stand-ins' loop, when a request arrives.
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    # What a scripted answer noted (e.g. whether decode's request came first).
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw) if raw else None
        headers = {k.lower(): v for k, v in request.headers.items()}
        self.seen.append(Seen(request.path, headers, body))
        self.arrived.set()
        return await self.answer(self, request, body)


async def prefill_answer(stand_in: StandIn, request: web.Request, body: Any) -> web.StreamResponse:
    """A prefill's answer: one token and PREFILL_KV."""
    return web.json_response(
        {"id": "p", "choices": [{"text": "a"}], "kv_transfer_params": PREFILL_KV}
    )


async def decode_answer(stand_in: StandIn, request: web.Request, body: Any) -> web.StreamResponse:
    """A decode's answer: the kv_transfer_params it got, as JSON or as three SSE events."""
    kv = (body or {}).get("kv_transfer_params")
    if not (body or {}).get("stream"):
        return web.json_response({"id": "d", "got_kv": kv, "choices": [{"text": "abc"}]})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for text in ("a", "b", "c"):
        await resp.write(f"data: {json.dumps({'choices': [{'text': text}]})}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    return resp


class StandIns:
    """Stand-in servers by name, served from one event loop in a thread."""

    def __init__(self, answers: dict[str, Answer]) -> None:
        self.defaults = dict(answers)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.servers: dict[str, StandIn] = self.call(self._start())

    def call(self, coro: Awaitable[Any], timeout: float = 30.0) -> Any:
        """Run ``coro`` in the stand-ins' loop and return its result."""

        async def run() -> Any:
            return await coro

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    async def _start(self) -> dict[str, StandIn]:
        self._runners: list[web.AppRunner] = []
        servers = {}
        for name, answer in self.defaults.items():
            stand_in = StandIn(name, answer)
            app = web.Application(client_max_size=64 << 20)
            app.router.add_route("*", "/{tail:.*}", stand_in.handle)
            runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, HOST, 0)
            await site.start()
            stand_in.port = runner.addresses[0][1]
            self._runners.append(runner)
            servers[name] = stand_in
        return servers

    def __getitem__(self, name: str) -> StandIn:
        return self.servers[name]

    def reset(self) -> None:
        """Every stand-in back to its default answer, nothing seen."""

        async def clear() -> None:
            for name, s in self.servers.items():
                s.answer, s.seen, s.notes = self.defaults[name], [], {}
                s.arrived = asyncio.Event()

        self.call(clear())

    def close(self) -> None:
        async def stop() -> None:
            for runner in self._runners:
                await runner.cleanup()

        with contextlib.suppress(Exception):
            self.call(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout}s")
        time.sleep(0.02)


def settled(read: Callable[[], Any], timeout: float = 10.0, pause: float = 0.5) -> Any:
    """What ``read`` returns once two reads ``pause`` apart agree (counters
    that a peer's late report still moves), or its last value after ``timeout``."""
    last, deadline = read(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(pause)
        now = read()
        if now == last:
            return now
        last = now
    return last
