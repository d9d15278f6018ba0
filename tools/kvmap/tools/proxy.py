"""An OpenAI-compatible prefill/decode proxy in front of vLLM servers.

    python -m kvmap.tools.proxy --prefill URL --decode URL --mode pull|push \\
        [--prefill-params JSON] [--host 127.0.0.1] [--port 8000]

``POST /v1/completions`` and ``/v1/chat/completions`` go through a prefill
and a decode server (each of ``--prefill`` and ``--decode`` may be given
several times: round-robin); ``GET /v1/models`` and ``/health`` go to a
decode server as they are. The client's ``kv_transfer_params`` are always
replaced by the proxy's.

pull (sequential, vLLM's NixlConnector and kvmap's connector alike): the
body goes to prefill with ``max_tokens`` 1 (``max_completion_tokens`` 1 for
chat), ``stream`` false and ``kv_transfer_params`` ``{"do_remote_decode":
true, "do_remote_prefill": false}``; the ``kv_transfer_params`` of its JSON
answer go with the original body to decode. A prefill that refuses the
request (status 400 and up) answers the client itself: decode would refuse
the same body.

push (concurrent): prefill (as above, with ``{"do_remote_decode": true,
"transfer_mode": "push", "kvmap_push_id": ID}``) and decode (the original
body, with ``{"do_remote_prefill": true, "transfer_mode": "push",
"kvmap_push_id": ID}`` and the ``--prefill-params`` object of that prefill)
are sent at once, with one push id and one ``X-Request-Id`` (vLLM's
NixlPushConnector matches the two by the base request id). A prefill that
fails is only logged: the decode's connector gives up on the push after its
timeout and recomputes, so the client still gets its answer.

Decode's answer (SSE chunks as they come, or the JSON) goes back unchanged,
status included. Bodies over 8 MiB get 413, bodies that are not a JSON
object 400, an upstream that cannot be reached 502 (a JSON error each). A
client that goes away cancels the upstream requests; nothing is retried (a
retried POST could run, and bill, twice).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import secrets
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

LOG = logging.getLogger("kvmap.proxy")

MAX_BODY_BYTES = 8 << 20
# A prefill's answer is one token's JSON; a larger one is not a prefill's.
MAX_PREFILL_ANSWER_BYTES = 8 << 20
CHUNK_BYTES = 64 << 10
CONNECT_TIMEOUT_S = 10.0
# Between two chunks of an upstream answer: a long generation streams, a stuck one ends.
READ_TIMEOUT_S = 600.0
# Push mode: how long after decode's answer the prefill's may still take (for its log line).
PREFILL_GRACE_S = 30.0
MAX_UPSTREAM_CONNECTIONS = 1024
# What the proxy itself puts in push-mode kv_transfer_params; --prefill-params may not override.
RESERVED_KEYS = frozenset(
    {"do_remote_decode", "do_remote_prefill", "transfer_mode", "kvmap_push_id", "remote_request_id"}
)
RELAYED_HEADERS = ("Content-Type", "Content-Encoding", "Cache-Control")
MODES = ("pull", "push")


@dataclass(frozen=True)
class Prefill:
    url: str
    # Push mode: merged into the decode's kv_transfer_params (where to receive from).
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Config:
    prefills: tuple[Prefill, ...]
    decodes: tuple[str, ...]
    mode: str


@dataclass
class Trace:
    """One request's log line."""

    mode: str
    request_id: str
    push_id: str = "-"
    prefill: str = "-"
    decode: str = "-"
    prefill_ms: float = -1.0
    prefill_status: str = "-"
    status: str = "-"
    # Logged by push mode's prefill finisher, not by the handler.
    detached: bool = False

    def log(self) -> None:
        LOG.info(
            "mode=%s request_id=%s push_id=%s prefill=%s decode=%s prefill_ms=%.1f "
            "prefill_status=%s status=%s",
            self.mode,
            self.request_id,
            self.push_id,
            self.prefill,
            self.decode,
            self.prefill_ms,
            self.prefill_status,
            self.status,
        )


class ProxyError(Exception):
    """An answer of the proxy's own: an HTTP status and a message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def response(self) -> web.Response:
        kind = "invalid_request_error" if self.status < 500 else "upstream_error"
        body = {"error": {"message": self.message, "type": kind, "code": self.status}}
        return web.json_response(body, status=self.status)


@dataclass
class Answer:
    """A prefill's whole answer."""

    status: int
    raw: bytes
    content_type: str

    def json(self) -> dict[str, Any]:
        try:
            value = json.loads(self.raw)
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN and Infinity: Python's json takes them


def parse_body(data: bytes) -> dict[str, Any]:
    """The request's JSON object, or a 400."""
    try:
        value = json.loads(data, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as err:  # RecursionError: hostile nesting depth
        raise ProxyError(400, f"request body is not JSON: {type(err).__name__}") from None
    if not isinstance(value, dict):
        raise ProxyError(400, "request body is not a JSON object")
    return value


async def read_body(request: web.Request) -> dict[str, Any]:
    """At most MAX_BODY_BYTES of the request's body, read as a JSON object."""
    too_large = ProxyError(413, f"request body over {MAX_BODY_BYTES} bytes")
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise too_large
    data = bytearray()
    while chunk := await request.content.read(CHUNK_BYTES):  # chunked bodies have no length
        data += chunk
        if len(data) > MAX_BODY_BYTES:
            raise too_large
    return parse_body(bytes(data))


def prefill_body(body: dict[str, Any], chat: bool, kv: dict[str, Any]) -> dict[str, Any]:
    """The body a prefill gets: one token, no stream, the proxy's kv_transfer_params."""
    out = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": kv}
    if chat:
        out["max_completion_tokens"] = 1
    # vLLM refuses stream_options without stream and min_tokens above max_tokens.
    out.pop("stream_options", None)
    out.pop("min_tokens", None)
    return out


def decode_body(body: dict[str, Any], kv: dict[str, Any] | None) -> dict[str, Any]:
    """The original body with the proxy's kv_transfer_params (none: decode computes alone)."""
    out = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if kv is not None:
        out["kv_transfer_params"] = kv
    return out


def push_params(
    push_id: str, prefill: Prefill, request_id: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Push mode's kv_transfer_params: the prefill's and the decode's. The
    decode's also name the request (``remote_request_id``, the X-Request-Id
    both upstreams get), which vLLM's NixlPushConnector requires; kvmap's
    connector links the two by the push id alone."""
    common = {"transfer_mode": "push", "kvmap_push_id": push_id}
    return (
        {"do_remote_decode": True, **common},
        {**prefill.params, "do_remote_prefill": True, "remote_request_id": request_id, **common},
    )


class Proxy:
    """The proxy's routes over one client session of upstream connections."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self._prefills = itertools.cycle(config.prefills)
        self._decodes = itertools.cycle(config.decodes)
        self._session: aiohttp.ClientSession | None = None
        # Push mode's prefill finishers (the loop keeps only weak references to tasks).
        self._finishers: set[asyncio.Task[None]] = set()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_get("/v1/models", self.passthrough)
        app.router.add_get("/health", self.passthrough)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(sock_connect=CONNECT_TIMEOUT_S, sock_read=READ_TIMEOUT_S)
        self._session = aiohttp.ClientSession(
            timeout=timeout,
            connector=aiohttp.TCPConnector(limit=MAX_UPSTREAM_CONNECTIONS),
            # Bodies pass through as the upstream encoded them.
            auto_decompress=False,
        )

    async def _close(self, _app: web.Application) -> None:
        for finisher in list(self._finishers):
            finisher.cancel()
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the app has not started"
        return self._session

    async def completions(self, request: web.Request) -> web.StreamResponse:
        trace = Trace(self.config.mode, uuid.uuid4().hex)
        try:
            body = await read_body(request)
            chat = request.path.endswith("/chat/completions")
            if self.config.mode == "push":
                return await self._push(request, body, chat, trace)
            return await self._pull(request, body, chat, trace)
        except ProxyError as err:
            trace.status = str(err.status)
            return err.response()
        except asyncio.CancelledError:
            trace.status = "client-gone"
            raise
        finally:
            if not trace.detached:
                trace.log()

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        url = next(self._decodes)
        try:
            return await self._relay(request, "GET", url, None, Trace("get", uuid.uuid4().hex))
        except ProxyError as err:
            return err.response()

    async def _pull(
        self, request: web.Request, body: dict[str, Any], chat: bool, trace: Trace
    ) -> web.StreamResponse:
        prefill, decode = next(self._prefills), next(self._decodes)
        kv = {"do_remote_decode": True, "do_remote_prefill": False}
        answer = await self._prefill(request, prefill.url, prefill_body(body, chat, kv), trace)
        if answer.status >= 400:
            trace.status = str(answer.status)
            return web.Response(
                status=answer.status, body=answer.raw, content_type=answer.content_type
            )
        params = answer.json().get("kv_transfer_params")
        if not isinstance(params, dict):  # a prefill without a connector: decode computes
            LOG.warning("request_id=%s: prefill returned no kv_transfer_params", trace.request_id)
            params = None
        return await self._relay(request, "POST", decode, decode_body(body, params), trace)

    async def _push(
        self, request: web.Request, body: dict[str, Any], chat: bool, trace: Trace
    ) -> web.StreamResponse:
        prefill, decode = next(self._prefills), next(self._decodes)
        trace.push_id = secrets.token_urlsafe(18)
        p_kv, d_kv = push_params(trace.push_id, prefill, trace.request_id)
        task = asyncio.create_task(
            self._push_prefill(request, prefill.url, prefill_body(body, chat, p_kv), trace)
        )
        try:
            resp = await self._relay(request, "POST", decode, decode_body(body, d_kv), trace)
        except BaseException:  # decode unreachable or the client gone: the prefill is moot
            task.cancel()
            raise
        # The client has its whole answer and may close now (which cancels this handler):
        # the prefill's end is awaited, and the request logged, apart from it.
        trace.detached = True
        finisher = asyncio.create_task(self._finish_prefill(task, trace))
        self._finishers.add(finisher)
        finisher.add_done_callback(self._finishers.discard)
        return resp

    async def _finish_prefill(self, task: asyncio.Task[None], trace: Trace) -> None:
        """Push mode, after decode's answer: the prefill's for PREFILL_GRACE_S at most."""
        try:
            await asyncio.wait({task}, timeout=PREFILL_GRACE_S)
        finally:
            task.cancel()  # a no-op once it finished
            trace.log()

    async def _push_prefill(
        self, request: web.Request, url: str, payload: dict[str, Any], trace: Trace
    ) -> None:
        """Push mode's prefill: its failure is logged, never the client's (decode goes on)."""
        try:
            answer = await self._prefill(request, url, payload, trace)
        except ProxyError as err:
            LOG.warning("request_id=%s: prefill failed: %s", trace.request_id, err.message)
            return
        if answer.status >= 400:
            LOG.warning(
                "request_id=%s: prefill answered %d: %s",
                trace.request_id,
                answer.status,
                answer.raw[:500].decode(errors="replace"),
            )

    def _headers(self, request: web.Request, request_id: str) -> dict[str, str]:
        headers = {"X-Request-Id": request_id}
        if "Authorization" in request.headers:  # vLLM's --api-key
            headers["Authorization"] = request.headers["Authorization"]
        return headers

    async def _prefill(
        self, request: web.Request, url: str, payload: dict[str, Any], trace: Trace
    ) -> Answer:
        """POST ``payload`` to a prefill server and read its whole (small) answer."""
        trace.prefill = url
        start = time.monotonic()
        try:
            async with self.session.post(
                url + request.path, json=payload, headers=self._headers(request, trace.request_id)
            ) as up:
                raw = bytearray()
                while chunk := await up.content.read(CHUNK_BYTES):
                    raw += chunk
                    if len(raw) > MAX_PREFILL_ANSWER_BYTES:
                        raise ProxyError(502, f"prefill {url}: answer over the limit")
                trace.prefill_status = str(up.status)
                return Answer(up.status, bytes(raw), up.content_type)
        except (aiohttp.ClientError, TimeoutError) as err:
            trace.prefill_status = type(err).__name__
            raise ProxyError(502, f"prefill {url} unreachable: {type(err).__name__}") from None
        finally:
            trace.prefill_ms = (time.monotonic() - start) * 1000

    async def _relay(
        self,
        request: web.Request,
        method: str,
        url: str,
        payload: dict[str, Any] | None,
        trace: Trace,
    ) -> web.StreamResponse:
        """Send ``payload`` to ``url`` and stream its answer back unchanged. An error
        before the answer started is a 502; after, the client's connection breaks
        (the answer must not look complete)."""
        trace.decode = url
        resp: web.StreamResponse | None = None
        try:
            async with self.session.request(
                method,
                url + request.path_qs,
                json=payload,
                headers=self._headers(request, trace.request_id),
            ) as up:
                trace.status = str(up.status)
                resp = web.StreamResponse(status=up.status, reason=up.reason)
                for name in RELAYED_HEADERS:
                    if name in up.headers:
                        resp.headers[name] = up.headers[name]
                resp.headers["X-Request-Id"] = trace.request_id
                if up.content_length is not None:
                    resp.content_length = up.content_length
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        except (aiohttp.ClientError, TimeoutError) as err:
            if resp is None or not resp.prepared:
                trace.status = "502"
                raise ProxyError(502, f"upstream {url} unreachable: {type(err).__name__}") from None
            trace.status = f"{trace.status}-broken"
            LOG.warning("request_id=%s: relay from %s broke off: %r", trace.request_id, url, err)
            raise


def _url(value: str) -> str:
    if not value.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"{value!r}: expected an http:// or https:// URL")
    return value.rstrip("/")


def _params(value: str) -> dict[str, Any]:
    try:
        params = json.loads(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(params, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    if reserved := sorted(RESERVED_KEYS & params.keys()):
        raise argparse.ArgumentTypeError(f"keys set by the proxy itself: {reserved}")
    return params


def parse_args(argv: Sequence[str] | None = None) -> tuple[Config, str, int]:
    """The proxy's configuration, host and port from its command line."""
    parser = argparse.ArgumentParser(
        prog="python -m kvmap.tools.proxy", description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    parser.add_argument("--prefill", type=_url, action="append", required=True)
    parser.add_argument("--decode", type=_url, action="append", required=True)
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument(
        "--prefill-params",
        type=_params,
        action="append",
        default=[],
        help="push mode: a JSON object merged into the decode's kv_transfer_params; once for "
        "every prefill, or once per --prefill in their order",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    params: list[dict[str, Any]] = args.prefill_params or [{}]
    if len(params) == 1:
        params = params * len(args.prefill)
    if len(params) != len(args.prefill):
        parser.error("--prefill-params: give it once, or once per --prefill")
    prefills = tuple(Prefill(u, p) for u, p in zip(args.prefill, params, strict=True))
    return Config(prefills, tuple(args.decode), args.mode), args.host, args.port


async def serve(config: Config, host: str, port: int) -> None:
    """Run the proxy until cancelled."""
    # handler_cancellation: a client that disconnects cancels its handler,
    # which closes the upstream connections (vLLM then aborts the request).
    runner = web.AppRunner(Proxy(config).app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        LOG.info("proxy (%s mode) listening on http://%s:%d", config.mode, host, port)
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> None:
    config, host, port = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a user stops it
        asyncio.run(serve(config, host, port))


if __name__ == "__main__":
    main()
