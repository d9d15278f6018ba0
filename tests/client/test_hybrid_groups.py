"""KV cache groups of vLLM's hybrid KV cache manager in the connector:
``GroupWindows`` (which blocks of each group a transfer moves), the P/D
flow with several transfer groups over in-process kvmapds (layers of
different groups sharing one KV tensor, as vLLM's hybrid allocator lays them
out; sliding-window lists with null blocks; a different block count per
group) and, where vLLM is installed, the adapter's side (``SupportsHMA``,
windows from vLLM's specs, what it refuses)."""

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
    ConnectorOptions,
    GroupWindows,
    SchedulerCore,
    WorkerCore,
)
from kvmap.client.geometry import LayerSpec, export_registration
from kvmap.v1 import types_pb2

NB, PAGE = 48, 64
P_ADDR, D_ADDR = "10.0.0.1:50051", "10.0.0.2:50051"
# Two sliding-window groups (3 window blocks each) and one full-attention
# group, one layer each in each of two KV tensors ("slots").
WINDOWS = GroupWindows((3, 3, 0))
LAYERS = {f"l.{slot}.{g}": (slot, g) for slot in (0, 1) for g in range(3)}


# GroupWindows, pure ----------------------------------------------------------

# A vLLM block list: null blocks first (out of the window), then real ones.
block_list = st.tuples(
    st.integers(0, 6), st.lists(st.integers(1, 500), max_size=10, unique=True)
).map(lambda t: (NULL_BLOCK_ID,) * t[0] + tuple(t[1]))


@given(st.lists(st.tuples(block_list, st.integers(0, 5)), min_size=1, max_size=5))
def test_clip_keeps_each_windows_last_blocks_without_nulls(
    groups: list[tuple[tuple[int, ...], int]],
) -> None:
    """clip keeps, per group, the last n blocks of a windowed group (n its window) and every block
    of a full group, in order, without the leading null blocks; without windows it changes
    nothing."""
    lists = [g for g, _ in groups]
    windows = GroupWindows(tuple(n for _, n in groups))
    out = windows.clip(lists)
    assert len(out) == len(lists)
    for ids, n, got in zip(lists, windows.blocks, out, strict=True):
        kept = ids[-n:] if n else ids
        assert got == tuple(b for b in kept if b != NULL_BLOCK_ID)
        assert ids[len(ids) - len(got) :] == got  # a suffix, in order
        assert len(got) <= (n or len(ids))
    assert GroupWindows().clip(lists) == tuple(lists)


@given(st.lists(st.tuples(block_list, block_list, st.integers(0, 5)), min_size=1, max_size=5))
def test_fit_cuts_windowed_local_groups_to_the_remote_window(
    groups: list[tuple[tuple[int, ...], tuple[int, ...], int]],
) -> None:
    """fit cuts a windowed group's local blocks to its last ones, as many as the remote group has;
    full groups are left as they are (pair_blocks checks them)."""
    local = tuple(lg for lg, _, _ in groups)
    remote = tuple(rg for _, rg, _ in groups)
    windows = GroupWindows(tuple(n for _, _, n in groups))
    out = windows.fit(local, remote)
    for lg, rg, n, got in zip(local, remote, windows.blocks, out, strict=True):
        if n:
            assert got == lg[max(0, len(lg) - len(rg)) :]
        else:
            assert got == lg


@given(st.integers(1, 4096), st.integers(1, 512))
def test_window_blocks_cover_any_placement_of_the_window(window: int, block: int) -> None:
    """from_windows gives each sliding-window group enough trailing blocks for its window starting
    anywhere in a block (cdiv(window, block) + 1), and a full group 0 (all blocks)."""
    n = GroupWindows.from_windows([(window, block), (0, block)]).blocks
    worst = -(-(window + block - 1) // block)  # the window starting on a block's last token
    assert n[0] >= worst and n[0] == -(-window // block) + 1
    assert n[1] == 0


def test_group_windows_refuse_bad_input() -> None:
    """A negative window or block size, and a block list with another number of groups, raise."""
    with pytest.raises(ValueError):
        GroupWindows.from_windows([(-1, 16)])
    with pytest.raises(ValueError):
        GroupWindows.from_windows([(64, 0)])
    with pytest.raises(ValueError):
        GroupWindows((-1,))
    with pytest.raises(ValueError, match="2 KV cache groups, 3 known"):
        WINDOWS.clip([[1], [2]])


# The P/D flow with several groups, in-process kvmapds ---------------------------


@dataclass
class Side:
    daemon: InprocDaemon
    sched: SchedulerCore
    worker: WorkerCore
    kv: dict[str, torch.Tensor]
    grants: RecordingTransport


def make_side(net: InprocNetwork, addr: str, engine: str, fill: bool) -> Side:
    """A worker laid out as vLLM's hybrid allocator lays out one: each KV tensor
    (slot) is shared by one layer of every group; the groups' block ids come
    from one pool, so they never collide within a request."""
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
    storage = torch.zeros(2 * NB * PAGE, dtype=torch.uint8)
    if fill:
        g = torch.Generator().manual_seed(11)
        storage.copy_(torch.randint(0, 255, storage.shape, generator=g, dtype=torch.uint8))
    slots = [storage[i * NB * PAGE : (i + 1) * NB * PAGE].view(NB, PAGE) for i in (0, 1)]
    kv = {name: slots[slot] for name, (slot, _) in LAYERS.items()}
    specs = {name: LayerSpec(g, types_pb2.CACHE_KIND_MHA, NB) for name, (_, g) in LAYERS.items()}
    wid = types_pb2.WorkerId(engine_id=engine)
    worker = WorkerCore(daemon.client(), wid, opts)
    req, fds = export_registration(wid, kv, specs, block_size_tokens=16)
    worker.register(req, fds)
    grants = RecordingTransport(daemon)
    sched = SchedulerCore(engine, opts, client=KvmapClient(grants), windows=WINDOWS)
    return Side(daemon, sched, worker, kv, grants)


@pytest.fixture
def pair() -> Iterator[tuple[Side, Side]]:
    with InprocNetwork() as net:
        p = make_side(net, P_ADDR, "prefill", fill=True)
        d = make_side(net, D_ADDR, "decode", fill=False)
        yield p, d
        for s in (p, d):
            s.worker.shutdown()


# vLLM's lists at the end of an 80-token prefill (5 blocks of 16): the
# sliding-window groups' out-of-window blocks are the null block.
PREFILL_BLOCKS = ([0, 0, 0, 13, 14], [0, 0, 0, 23, 24], [1, 2, 3, 4, 5])
OFFERED = [[13, 14], [23, 24], [1, 2, 3, 4, 5]]


def prefill(p: Side, rid: str = "req-p") -> dict[str, Any]:
    params: dict[str, Any] = {"do_remote_decode": True}
    p.sched.after_alloc(rid, params, [list(g) for g in PREFILL_BLOCKS], 0)
    p.worker.start(p.sched.build_meta())
    keep, kv = p.sched.request_finished(
        rid, params, finished_normally=True, block_ids=PREFILL_BLOCKS, num_computed_tokens=80
    )
    assert keep and kv is not None
    p.worker.start(p.sched.build_meta())
    return kv


def load(d: Side, kv: dict[str, Any], local: list[list[int]]) -> Any:
    """Decode: allocate ``local`` for the request, start and wait for its pull."""
    params = dict(kv)
    assert d.sched.num_new_matched_tokens("req-d", params, 80, 0) == (80, True)
    d.sched.after_alloc("req-d", params, local, 80)
    d.worker.start(d.sched.build_meta())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # a hang guard; the load's end is the event
        r = d.worker.poll()
        if r.finished_recving:
            return r
        time.sleep(0.01)
    raise AssertionError("no load finished")


def assert_moved(p: Side, d: Side, local: list[list[int]], remote: list[list[int]]) -> None:
    for name, (_, g) in LAYERS.items():
        for lb, rb in zip(local[g], remote[g], strict=True):
            assert torch.equal(d.kv[name][lb], p.kv[name][rb]), (name, lb, rb)


def test_prefill_offers_and_grants_only_each_groups_needed_blocks(
    pair: tuple[Side, Side],
) -> None:
    """The prefill side offers one list per group, the sliding-window groups only their window's
    real blocks (no null block), the full group every block; and its grant names exactly those
    blocks of every group."""
    p, _ = pair
    kv = prefill(p)
    assert kv["remote_block_ids"] == OFFERED
    assert p.sched.wait_for_grants(10)  # made off the scheduler's thread
    (grant,) = p.grants.grants
    assert {g.transfer_group: list(g.block_ids) for g in grant.groups} == dict(enumerate(OFFERED))


@pytest.mark.parametrize(
    "sliding",
    [
        # Decode allocations as the hybrid manager may hand them: null blocks
        # where the window does not reach, or real blocks everywhere.
        ([0, 0, 0, 6, 7], [0, 0, 0, 16, 17]),
        ([8, 9, 10, 6, 7], [18, 19, 20, 16, 17]),
    ],
)
def test_decode_loads_every_group_and_only_the_window(
    pair: tuple[Side, Side], sliding: tuple[list[int], list[int]]
) -> None:
    """The decode side pulls each sliding-window group's window blocks and every full-attention
    block into the matching local blocks (bytes equal, layer by layer of every group); local
    blocks before the window and the null block are never written; the daemons count every
    group's blocks."""
    p, d = pair
    kv = prefill(p)
    local = [sliding[0], sliding[1], [30, 31, 32, 33, 34]]
    r = load(d, kv, local)
    assert r.finished_recving == {"req-d"} and not r.failed_recving
    loaded = [[6, 7], [16, 17], [30, 31, 32, 33, 34]]
    assert d.worker.loads[-1].local_block_ids == tuple(tuple(g) for g in loaded)
    assert_moved(p, d, loaded, OFFERED)
    untouched = {NULL_BLOCK_ID, 8, 9, 10, 18, 19, 20}
    for name in LAYERS:
        for b in untouched:
            assert not d.kv[name][b].any(), (name, b)
    assert d.daemon.get_stats().transfers.blocks == 9
    assert p.daemon.get_stats().transfers.served_blocks == 9


def test_groups_with_a_local_prefix_hit_pull_their_own_tail(pair: tuple[Side, Side]) -> None:
    """Groups load different block counts: the full group, whose first three blocks the decode
    side had cached, pulls only the last two remote blocks; the window groups their window."""
    p, d = pair
    kv = prefill(p)
    r = load(d, kv, [[0, 0, 0, 6, 7], [0, 0, 0, 16, 17], [30, 31]])
    assert not r.failed_recving
    remote = [[13, 14], [23, 24], [4, 5]]
    assert d.worker.loads[-1].remote_block_ids == tuple(tuple(g) for g in remote)
    assert_moved(p, d, [[6, 7], [16, 17], [30, 31]], remote)
    assert d.daemon.get_stats().transfers.blocks == 6


def test_a_block_outside_a_groups_grant_is_refused(pair: tuple[Side, Side]) -> None:
    """Params naming a sliding-window block the prefill side did not offer (out of the window, so
    not granted) fail the load with PERMISSION_DENIED and write nothing: the grant covers each
    group's offered blocks and no other."""
    p, d = pair
    kv = prefill(p)
    kv["remote_block_ids"] = [[12, 13, 14], *OFFERED[1:]]
    r = load(d, kv, [[5, 6, 7], [0, 0, 0, 16, 17], [30, 31, 32, 33, 34]])
    assert r.failed_recving == {"req-d"}
    assert "PERMISSION_DENIED" in d.worker.loads[-1].error
    for name in LAYERS:
        assert not d.kv[name].any()


def test_group_count_mismatch_is_a_load_failure(pair: tuple[Side, Side]) -> None:
    """A decode engine with another number of KV cache groups than the prefill engine's params
    (e.g. its hybrid manager off) does not pull: a failed load naming the counts."""
    p, d = pair
    kv = prefill(p)
    r = load(d, kv, [[30, 31, 32, 33, 34]])
    assert r.failed_recving == {"req-d"}
    assert "1 local KV cache groups, 3 remote" in d.worker.loads[-1].error


# The vLLM adapter -------------------------------------------------------------


@pytest.fixture
def vllm_iface() -> Any:
    return pytest.importorskip("vllm.v1.kv_cache_interface", reason="vllm is not installed")


@pytest.mark.vllm
def test_connector_supports_hma_and_windows_from_vllm_specs(vllm_iface: Any) -> None:
    """KVMapConnector declares SupportsHMA (vLLM keeps its hybrid manager with it); with the hybrid
    manager its windows come from the sliding-window specs of the transfer groups, in group
    order; without it nothing is windowed."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    from kvmap.client.vllm_connector import KVMapConnector, group_windows

    v = vllm_iface
    assert supports_hma(KVMapConnector)
    full = v.FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
    swa = v.SlidingWindowSpec(
        block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=64
    )
    config = v.KVCacheConfig(
        num_blocks=100,
        kv_cache_tensors=[],
        kv_cache_groups=[
            v.KVCacheGroupSpec(["l.0"], swa),
            v.KVCacheGroupSpec(["l.1"], full),
            v.KVCacheGroupSpec(["l.2"], swa),
        ],
    )
    assert group_windows(config, hybrid=True) == GroupWindows((3, 0, 3))
    assert group_windows(config, hybrid=False) == GroupWindows()


@pytest.mark.vllm
def test_connector_refuses_only_the_mamba_state_it_cannot_move(vllm_iface: Any) -> None:
    """A KV cache with Mamba / linear-attention state passes with the hybrid manager and prefix
    caching off (mamba_cache_mode 'none'), its state group marked in the windows; without the
    hybrid manager, or with prefix caching on ('align', 'all'), it is refused at start-up with an
    error naming Mamba state and the setting; attention-only caches pass."""
    from kvmap.client.vllm_connector import check_hybrid_supported, group_windows

    v = vllm_iface
    full = v.FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
    mamba = v.MambaSpec(
        block_size=32, shapes=((4, 64), (2, 8, 16)), dtypes=(torch.float32, torch.float32)
    )
    groups = [v.KVCacheGroupSpec(["a"], full), v.KVCacheGroupSpec(["m"], mamba)]
    config = v.KVCacheConfig(num_blocks=10, kv_cache_tensors=[], kv_cache_groups=groups)
    check_hybrid_supported(config, hybrid=True, mamba_cache_mode="none")
    assert group_windows(config, hybrid=True) == GroupWindows((0, 0), (None, 0))
    with pytest.raises(NotImplementedError, match=r"Mamba .*hybrid KV cache manager"):
        check_hybrid_supported(config, hybrid=False)
    for mode in ("align", "all"):
        with pytest.raises(NotImplementedError, match=r"Mamba .*enable_prefix_caching=False"):
            check_hybrid_supported(config, hybrid=True, mamba_cache_mode=mode)
    attention_only = v.KVCacheConfig(num_blocks=10, kv_cache_tensors=[], kv_cache_groups=groups[:1])
    check_hybrid_supported(attention_only, hybrid=True, mamba_cache_mode="align")


@pytest.mark.parametrize(("remote_block_size", "fitted"), [(16, True), (0, True), (32, False)])
def test_decode_cuts_window_groups_to_the_remote_window_only_on_one_block_grid(
    remote_block_size: int, fitted: bool
) -> None:
    """The decode scheduler clips its sliding-window groups to the window and drops null blocks;
    it cuts them further to the remote group's length only when both engines use the same block
    size (or the prefill side does not say): on other block grids the token mapping aligns the
    trailing blocks."""
    opts = ConnectorOptions(socket="/unused")
    sched = SchedulerCore("decode", opts, windows=WINDOWS, block_size=16)
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "remote_target": P_ADDR,
        "remote_engine_id": "prefill",
        "remote_request_id": "req-p",
        "remote_block_ids": [[13, 14], [23, 24], [1, 2, 3, 4, 5]],
    }
    if remote_block_size:
        params["remote_block_size"] = remote_block_size
    sched.after_alloc("req-d", params, [[8, 9, 10, 6, 7], [0, 0, 0, 16, 17], [1, 2, 3, 4, 5]], 80)
    (task,) = sched.build_meta().recv
    window = ((6, 7), (16, 17)) if fitted else ((10, 6, 7), (16, 17))
    assert task.local_block_ids == (*window, (1, 2, 3, 4, 5))
