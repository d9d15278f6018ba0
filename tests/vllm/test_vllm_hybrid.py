"""End to end with vLLM's hybrid KV cache manager on: a tiny random-weight
Gemma-3 (two sliding-window layers, window 64 tokens, and one
full-attention layer; ``tiny_gemma3.json``), so that vLLM makes one KV cache
group per layer kind and hands the connector one block list per group, the
sliding-window groups' lists holding only the window's blocks as real ones.

First vLLM's own NixlConnector (``kv_buffer_device: cpu``) as the reference,
then KVMapConnector with a real kvmapd each side: the decode engine must
produce the single engine's tokens from loaded KV (its prompt counted as
cached), hold the prefill engine's bytes in every block it pulled, and the
sliding-window groups must move only the window's blocks.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_harness import (
    BLOCK,
    BothConnectors,
    blocks_of,
    build_model,
    flat,
    print_timings,
    reference_and_both_connectors,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

HERE = Path(__file__).resolve().parent
CONFIG = json.loads((HERE / "tiny_gemma3.json").read_text())
WINDOW = int(CONFIG["sliding_window"])
# The blocks a sliding-window group offers at most: cdiv(window, block) + 1.
WINDOW_BLOCKS = -(-WINDOW // BLOCK) + 1
MAX_TOKENS = 12
# Longer than the window (out-of-window blocks are null), about the window,
# less than a block, one block.
PROMPT_LENGTHS = {"long": 250, "over-window": 160, "partial": 77, "short": 9, "one-block": 32}


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BothConnectors]:
    tmp = tmp_path_factory.mktemp("vllm-hybrid")
    model = build_model(tmp, config=HERE / "tiny_gemma3.json")
    rng = random.Random(5)
    prompts = {k: [rng.randrange(3, 1000) for _ in range(n)] for k, n in PROMPT_LENGTHS.items()}
    runs = reference_and_both_connectors(tmp, model, prompts, MAX_TOKENS)
    nixl, kvmap = runs.nixl, runs.kvmap
    print_timings("vLLM hybrid e2e timings", runs.timings)
    for k, prompt in prompts.items():
        sizes = {
            name: [len(g) for g in pd.params[k]["remote_block_ids"]]
            for name, pd in (("nixl", nixl), ("kvmap", kvmap))
        }
        print(
            f"  {k} ({len(prompt)} tokens): blocks per group {sizes}, "
            f"loads nixl {nixl.recv[k]} kvmap {kvmap.recv[k]}"
        )
    yield runs


def test_nixl_reference_loads_hybrid_kv_and_matches_single_engine(hybrid: BothConnectors) -> None:
    """The reference: with NixlConnector the prefill engine offers one block list per KV cache
    group (the hybrid manager is on), and the decode engine loads every prompt's KV (one load
    finished, none failed, no block unloadable) and gives the single engine's tokens."""
    for k in hybrid.prompts:
        kv = hybrid.nixl.params[k]
        assert len(kv["remote_block_ids"]) == 3, kv  # two sliding-window groups, one full
        assert hybrid.nixl.recv[k] == (1, 0, 0), (k, hybrid.nixl.recv[k])
        assert hybrid.nixl.decoded[k] == hybrid.reference[k], k
    assert len({tuple(t) for t in hybrid.reference.values()}) == len(hybrid.reference)


def test_kvmap_decode_equals_single_engine_with_kv_loaded(hybrid: BothConnectors) -> None:
    """With KVMapConnector the prefill engine's first token and the decode engine's tokens equal
    the single engine's, and every prompt's KV was loaded: the connector reported one finished
    load to vLLM, no failed one and no unloadable block (vLLM recomputed nothing)."""
    for k in hybrid.prompts:
        assert hybrid.kvmap.first[k] == hybrid.reference[k][:1], k
        assert hybrid.kvmap.decoded[k] == hybrid.reference[k], k
        assert hybrid.kvmap.loads[k]["ok"], hybrid.kvmap.loads[k]
        assert hybrid.kvmap.recv[k] == (1, 0, 0), (k, hybrid.kvmap.recv[k])


def test_kvmap_offers_one_list_per_group_and_only_the_window(hybrid: BothConnectors) -> None:
    """kvmap's kv_transfer_params carry one block list per KV cache group: the full-attention
    group every block of the prompt, each sliding-window group at most cdiv(window, block) + 1
    blocks, none of them vLLM's null block, and exactly NixlConnector's real (non-null) blocks
    in number."""
    for k, prompt in hybrid.prompts.items():
        kv, ref = hybrid.kvmap.params[k], hybrid.nixl.params[k]
        groups = kv["remote_block_ids"]
        assert len(groups) == 3
        # The full-attention group: every block of the prompt.
        assert any(len(ids) == blocks_of(len(prompt)) for ids in groups), groups
        for g, ids in enumerate(groups):
            assert ids and 0 not in ids, (k, g, ids)
            assert len(ids) == len([b for b in ref["remote_block_ids"][g] if b != 0]), (k, g)
            assert len(ids) <= max(WINDOW_BLOCKS, blocks_of(len(prompt)))
        windowed = [ids for ids in groups if len(ids) < blocks_of(len(prompt))]
        if blocks_of(len(prompt)) > WINDOW_BLOCKS:
            # The window's blocks only, in both sliding-window groups.
            assert len(windowed) == 2 and all(len(w) <= WINDOW_BLOCKS for w in windowed), groups


def test_kvmap_pulled_bytes_identical_in_every_group(hybrid: BothConnectors) -> None:
    """Every block the decode engine pulled, in every group, holds the bytes of the prefill block
    it was paired with, layer by layer (the blocks were read on both sides before any later
    forward), and the load paired every offered block."""
    for k in hybrid.prompts:
        load = hybrid.kvmap.loads[k]
        assert load["remote_block_ids"] == hybrid.kvmap.params[k]["remote_block_ids"], k
        assert [len(g) for g in load["local_block_ids"]] == [
            len(g) for g in load["remote_block_ids"]
        ]
        p, d = hybrid.kvmap.prefill_slots[k], hybrid.kvmap.decode_slots[k]
        assert sorted(p) == sorted(d) and len(p) == CONFIG["num_hidden_layers"]
        for layer in p:
            bad = [i for i, (a, b) in enumerate(zip(p[layer], d[layer], strict=True)) if a != b]
            assert not bad, f"{k} {layer}: pulled blocks {bad} differ"


def test_kvmap_daemons_count_every_groups_blocks_and_free_by_pull(hybrid: BothConnectors) -> None:
    """Both daemons count one pull per prompt and every block of every group, no failure; the
    prefill engine freed its held blocks because they were pulled (no lease expired)."""
    expected = sum(len(flat(kv["remote_block_ids"])) for kv in hybrid.kvmap.params.values())
    assert hybrid.kvmap.decode_stats is not None and hybrid.kvmap.prefill_stats is not None
    d, p = hybrid.kvmap.decode_stats.transfers, hybrid.kvmap.prefill_stats.transfers
    assert (d.pulls_done, d.failed, d.blocks) == (len(hybrid.prompts), 0, expected)
    assert (p.served_done, p.served_blocks) == (len(hybrid.prompts), expected)
    s = hybrid.kvmap.prefill_session
    assert (s["pending_sends"], s["leases_expired"]) == (0, 0)
