"""Property-based fuzzing of one live kvmapd: registration, region maps,
admin and peer RPCs, and raw bytes on every method.

One daemon process and one demo worker (``engine-a``, registered with real
shared memory and attached) serve the whole module. For every example:

- the status is in the RPC's closed set (``fuzz_support.ALLOWED``), never
  UNKNOWN or INTERNAL, and arrives before the client deadline;
- a rejected request leaves the daemon's state (every worker's summary and
  region map, generations included) exactly as it was;
- an accepted one is undone (a fuzz worker is deregistered, a lease ended),
  and the daemon is back to the same state;
- the process stays alive and health stays SERVING.

Garbage memory handles are real: an fd batch on the daemon's hand-off socket
carries a good memfd, /dev/null, a pipe, a directory, a read-only file, a
socket, a write-sealed memfd and a 10-byte memfd; paths name /dev/null,
/dev/zero, /proc/self/mem, a FIFO, a directory, a symlink, a missing file.
"""

from __future__ import annotations

import fcntl
import os
import socket
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import pytest
from fuzz_support import (
    ALLOWED,
    BIDI,
    DENIED,
    INVALID,
    OK,
    SCALE,
    STREAMING,
    TCP_METHODS,
    UNIX_METHODS,
    Live,
    call,
    call_stream,
    check_rejected,
    check_status,
    fuzz_settings,
    int64s,
    is_key,
    odd_strings,
    request_class,
    short,
    uint32s,
    uint64s,
    worker_ids,
)
from hypothesis import assume, event, given
from hypothesis import strategies as st

from kvmap.client.fd_handoff import credential_metadata, sealed_memfd, send_fds
from kvmap.tools.launch import WorkerProc, start_daemon, start_worker
from kvmap.v1 import (
    admin_pb2,
    peer_pb2,
    region_maps_pb2,
    registry_pb2,
    transfers_pb2,
    types_pb2,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(int(240 * max(1.0, SCALE)))]

ENGINE = "engine-a"
GOOD_SIZE = 1 << 20


class Env:
    """The module's daemon, worker and hostile handles (a plain class: its
    repr stays one line in hypothesis' failure reports)."""

    def __init__(
        self, live: Live, worker: WorkerProc, good_path: str, bad_paths: list[str], fds: list[int]
    ) -> None:
        self.live = live
        self.worker = worker
        self.good_path = good_path
        self.small_path = str(Path(good_path).with_name("small.bin"))
        self.bad_paths = bad_paths
        self.fds = fds
        self.token = ""

    def __repr__(self) -> str:
        return f"Env(daemon={self.live.daemon.socket})"

    def refresh_token(self) -> None:
        """A fresh fd batch: the daemon discards a batch once a registration
        that used it succeeded, and expires it after two minutes."""
        self.token = send_fds(self.live.daemon.socket + ".fds", self.fds, 10)


def _hostile_fds(tmp: Path, good_file: Path) -> list[int]:
    good = sealed_memfd("kv-good", GOOD_SIZE)
    devnull = os.open("/dev/null", os.O_RDWR)
    pipe_r, pipe_w = os.pipe()
    os.close(pipe_w)
    directory = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
    readonly = os.open(good_file, os.O_RDONLY)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock_fd = sock.detach()
    sealed = os.memfd_create("kv-sealed", os.MFD_ALLOW_SEALING)
    os.ftruncate(sealed, GOOD_SIZE)
    fcntl.fcntl(sealed, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK)
    tiny = os.memfd_create("kv-tiny")
    os.ftruncate(tiny, 10)
    # Index 0 is the only good one.
    return [good, devnull, pipe_r, directory, readonly, sock_fd, sealed, tiny]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("fuzz-registry")
    files = tmp / "files"
    files.mkdir()
    good = files / "good.bin"
    good.write_bytes(b"\0" * GOOD_SIZE)
    (files / "small.bin").write_bytes(b"\0" * 10)
    (files / "link.bin").symlink_to(good)
    os.mkfifo(files / "fifo")
    (files / "dir").mkdir()
    bad_paths = [
        "/dev/null",
        "/dev/zero",
        "/proc/self/mem",
        str(files / "fifo"),
        str(files / "dir"),
        str(files / "link.bin"),
        str(files / "small.bin"),
        str(files / "missing.bin"),
        "files/good.bin",  # relative
        "",
        "/",
        "/" + "x" * 5000,  # ENAMETOOLONG
    ]
    # The good file (and the hostile ones beside it) lie under an allowed prefix.
    daemon = start_daemon(tmp / "d", "--shm-path-prefix", str(files))
    fds: list[int] = []
    try:
        worker = start_worker(
            daemon, ENGINE, "--blocks", "16", "--block-tokens", "4",
            "--mla-layers", "3", "--indexer-layers", "2",
        )  # fmt: skip
        fds = _hostile_fds(files, good)
        e = Env(Live(daemon), worker, str(good), bad_paths, fds)
        e.refresh_token()
        yield e
        e.live.assert_healthy()
        worker.stop()
        e.live.close()
        assert daemon.terminate() == 0, daemon.log()[-4000:]
    finally:
        for fd in fds:
            os.close(fd)
        daemon.kill()


# Registrations ---------------------------------------------------------------

BLOCKS, MLA_LEN, IDX_LEN = 16, 64, 32


def template(engine_id: str = "fz-ok") -> registry_pb2.RegisterWorkerRequest:
    """A valid registration of 3 MLA layers (a0) and 1 indexer layer (a1)."""
    req = registry_pb2.RegisterWorkerRequest(
        worker=types_pb2.WorkerId(engine_id=engine_id),
        kv_cache_layout="BLHNC",
        block_size_tokens=16,
    )
    cpu = types_pb2.Device(type=types_pb2.DEVICE_TYPE_CPU)
    req.allocations.add(id="a0", size_bytes=3 * MLA_LEN * BLOCKS, device=cpu)
    req.allocations.add(id="a1", size_bytes=IDX_LEN * BLOCKS, device=cpu)
    for i in range(3):
        req.views.add(
            layer_name=f"m{i}", allocation_id="a0", transfer_group=0,
            cache_kind=types_pb2.CACHE_KIND_MLA, dtype="uint8", offset_bytes=i * MLA_LEN,
            block_len_bytes=MLA_LEN, block_stride_bytes=3 * MLA_LEN, num_blocks=BLOCKS,
        )  # fmt: skip
    req.views.add(
        layer_name="i0", allocation_id="a1", transfer_group=1,
        cache_kind=types_pb2.CACHE_KIND_INDEXER, dtype="uint8", offset_bytes=0,
        block_len_bytes=IDX_LEN, block_stride_bytes=IDX_LEN, num_blocks=BLOCKS,
    )  # fmt: skip
    return req


VIEW_INTS = ["offset_bytes", "block_len_bytes", "block_stride_bytes", "num_blocks"]
KINDS = [-1, 0, 1, 2, 3, 4, 5, 6, 99, 2**31 - 1]
DEVICE_TYPES = [-1, 0, 1, 2, 3, 99]


@st.composite
def mutations(draw: st.DrawFn) -> tuple[Any, ...]:
    kind = draw(
        st.sampled_from(
            [
                "view_int",
                "view_int",
                "view_group",
                "view_kind",
                "view_alloc",
                "view_name",
                "view_dup",
                "view_alias",
                "view_shift",
                "alloc_size",
                "alloc_id",
                "alloc_device",
                "drop_allocs",
                "drop_views",
                "extra_views",
                "extra_allocs",
                "header",
            ]
        )
    )
    i = draw(st.integers(0, 7))
    if kind == "view_int":
        return (kind, i, draw(st.sampled_from(VIEW_INTS)), draw(int64s))
    if kind == "view_group":
        return (kind, i, draw(uint32s))
    if kind == "view_kind":
        return (kind, i, draw(st.sampled_from(KINDS)))
    if kind == "view_alloc":
        return (kind, i, draw(st.sampled_from(["a0", "a1", "", "nope"]) | odd_strings))
    if kind == "view_name":
        return (kind, i, draw(st.sampled_from(["m0", "m1", "i0", ""]) | odd_strings))
    if kind == "view_shift":
        return (kind, i, draw(st.sampled_from([-1, 1, 31, 63, 65, MLA_LEN])))
    if kind == "alloc_size":
        return (kind, i, draw(int64s))
    if kind == "alloc_id":
        return (kind, i, draw(st.sampled_from(["a0", "a1", ""]) | odd_strings))
    if kind == "alloc_device":
        return (kind, i, draw(st.sampled_from(DEVICE_TYPES)), draw(uint32s))
    if kind == "extra_views":
        views = draw(
            st.lists(
                st.tuples(
                    odd_strings,
                    st.sampled_from(["a0", "a1", "zz"]),
                    uint32s,
                    st.sampled_from(KINDS),
                    int64s,
                    int64s,
                    int64s,
                    int64s,
                ),
                min_size=1,
                max_size=40,
            )
        )
        return (kind, views)
    if kind == "extra_allocs":
        return (kind, draw(st.lists(st.tuples(odd_strings, int64s), min_size=1, max_size=5)))
    if kind == "header":
        return (
            kind,
            draw(st.sampled_from(["tp_size", "block_size_tokens", "kv_cache_layout"])),
            draw(uint32s),
            draw(int64s),
            draw(odd_strings),
        )
    return (kind, i)


def _apply(req: registry_pb2.RegisterWorkerRequest, m: tuple[Any, ...]) -> None:
    kind = m[0]
    views, allocs = req.views, req.allocations
    view = views[m[1] % len(views)] if views and isinstance(m[1], int) else None
    alloc = allocs[m[1] % len(allocs)] if allocs and isinstance(m[1], int) else None
    if kind == "view_int" and view is not None:
        setattr(view, m[2], m[3])
    elif kind == "view_group" and view is not None:
        view.transfer_group = m[2]
    elif kind == "view_kind" and view is not None:
        view.cache_kind = m[2]
    elif kind == "view_alloc" and view is not None:
        view.allocation_id = m[2]
    elif kind == "view_name" and view is not None:
        view.layer_name = m[2]
    elif kind in ("view_dup", "view_alias") and view is not None:
        copy = views.add()
        copy.CopyFrom(view)
        if kind == "view_alias":
            copy.layer_name = view.layer_name + "-alias"
    elif kind == "view_shift" and view is not None:
        view.offset_bytes = max(-(2**63), min(2**63 - 1, view.offset_bytes + m[2]))
    elif kind == "alloc_size" and alloc is not None:
        alloc.size_bytes = m[2]
    elif kind == "alloc_id" and alloc is not None:
        alloc.id = m[2]
    elif kind == "alloc_device" and alloc is not None:
        alloc.device.type = m[2]
        alloc.device.index = m[3]
    elif kind == "drop_allocs":
        del allocs[:]
    elif kind == "drop_views":
        del views[:]
    elif kind == "extra_views":
        for name, alloc_id, group, ck, off, ln, stride, nb in m[1]:
            views.add(
                layer_name=name, allocation_id=alloc_id, transfer_group=group, cache_kind=ck,
                dtype="uint8", offset_bytes=off, block_len_bytes=ln,
                block_stride_bytes=stride, num_blocks=nb,
            )  # fmt: skip
    elif kind == "extra_allocs":
        for alloc_id, size in m[1]:
            allocs.add(id=alloc_id, size_bytes=size)
    elif kind == "header":
        _, name, u32, i64, text = m
        if name == "tp_size":
            req.tp_size = u32
        elif name == "block_size_tokens":
            req.block_size_tokens = i64
        else:
            req.kv_cache_layout = text


# A handle is drawn symbolically and made concrete per example, because the
# live fd token changes when a registration succeeds.
FD_TOKENS = ["<live>", "<live>", "", "garbage", "0" * 32, "<live>x"]


def handles() -> st.SearchStrategy[tuple[Any, ...]]:
    good = st.sampled_from([("good_fd",), ("good_path",)])
    bad_fd = st.tuples(
        st.just("fd"),
        st.sampled_from(FD_TOKENS) | odd_strings,
        st.integers(0, 9) | uint32s,
        st.sampled_from([0, 0, 0, 4096, -1, GOOD_SIZE]) | int64s,
    )
    bad_path = st.tuples(
        st.just("path"),
        st.integers(0, 11),
        st.sampled_from([0, 0, 0, 4096, -1, GOOD_SIZE]) | int64s,
    )
    other = st.one_of(
        st.tuples(
            st.just("random_path"),
            odd_strings.map(lambda s: "/" + s),
            int64s,
        ),
        st.tuples(st.just("cuda"), st.binary(max_size=128), int64s, int64s),
        st.sampled_from([("none",), ("unset",)]),
    )
    # Mostly good memory or one precise kind of garbage, so that valid
    # geometries reach the memory import with it.
    return st.one_of(good, good, bad_fd, bad_fd, bad_path, other)


def _set_handle(env: Env, alloc: types_pb2.Allocation, h: tuple[Any, ...]) -> None:
    kind = h[0]
    if kind == "good_fd":
        alloc.shm_fd.CopyFrom(types_pb2.ShmFdHandle(token=env.token, index=0))
    elif kind == "good_path":
        alloc.shm_path.CopyFrom(types_pb2.ShmPathHandle(path=env.good_path))
    elif kind == "fd":
        token = h[1].replace("<live>", env.token)
        alloc.shm_fd.CopyFrom(types_pb2.ShmFdHandle(token=token, index=h[2], offset_bytes=h[3]))
    elif kind == "path":
        path = env.bad_paths[h[1] % len(env.bad_paths)]
        alloc.shm_path.CopyFrom(types_pb2.ShmPathHandle(path=path, offset_bytes=h[2]))
    elif kind == "random_path":
        alloc.shm_path.CopyFrom(types_pb2.ShmPathHandle(path=h[1], offset_bytes=h[2]))
    elif kind == "cuda":
        alloc.cuda_ipc.CopyFrom(
            types_pb2.CudaIpcHandle(handle=h[1], offset_bytes=h[2], block_size_bytes=h[3])
        )
    elif kind == "none":
        alloc.none.SetInParent()


def _could_be_memory(env: Env, alloc: types_pb2.Allocation) -> bool:
    """Whether the handle names real, mappable memory (the good memfd, the
    good file or the small file)."""
    which = alloc.WhichOneof("handle")
    if which == "shm_fd":
        return alloc.shm_fd.token == env.token and alloc.shm_fd.index == 0
    if which == "shm_path":
        return alloc.shm_path.path in (env.good_path, env.small_path)
    return False


@st.composite
def registrations(draw: st.DrawFn) -> tuple[Any, ...]:
    """(worker id, mutations, handles): a template registration broken in up
    to four ways, or left valid, with good or garbage memory handles."""
    plain = st.sampled_from(
        [types_pb2.WorkerId(engine_id="fz-ok"), types_pb2.WorkerId(engine_id=ENGINE)]
    )
    worker = draw(st.one_of(plain, plain, plain, worker_ids([ENGINE, "fz-ok"])))
    muts = draw(st.just([]) | st.lists(mutations(), min_size=1, max_size=4))
    hs = draw(st.lists(handles(), min_size=8, max_size=8))
    return worker, muts, hs


def build_registration(env: Env, drawn: tuple[Any, ...]) -> registry_pb2.RegisterWorkerRequest:
    worker, muts, hs = drawn
    req = template()
    req.worker.CopyFrom(worker)
    for m in muts:
        _apply(req, m)
    for alloc, h in zip(req.allocations, hs, strict=False):
        _set_handle(env, alloc, h)
    if is_key(req.worker, ENGINE) and any(_could_be_memory(env, a) for a in req.allocations):
        # Good memory could make this valid: never replace the live worker.
        req.worker.engine_id = "fz-ok"
    return req


def _me(env: Env) -> tuple[tuple[str, str]]:
    """A fresh credential token of this process's uid, as gRPC metadata."""
    return credential_metadata(env.live.daemon.socket)


def _undo_registration(env: Env, req: registry_pb2.RegisterWorkerRequest, before: str) -> None:
    """An accepted registration: it is listed, then removed again."""
    live = env.live
    assert not is_key(req.worker, ENGINE)
    got = live.maps.GetRegionMap(region_maps_pb2.GetRegionMapRequest(worker=req.worker), timeout=10)
    assert got.region_map.generation >= 1
    assert len(got.region_map.allocations) == len(req.allocations)
    deregister = partial(live.registry.DeregisterWorker, metadata=_me(env))
    out = call(deregister, registry_pb2.DeregisterWorkerRequest(worker=req.worker), "Deregister")
    assert out.code is OK, out
    env.refresh_token()
    assert live.snapshot() == before


@fuzz_settings(250)
@given(drawn=registrations())
def test_register_worker(env: Env, drawn: tuple[Any, ...]) -> None:
    """Fuzzed registrations (hostile geometries, fds and paths): every status is in RegisterWorker's
    closed set, never a hang; a rejected one leaves the daemon's state exactly as it was; an
    accepted one is undone; the daemon stays healthy."""
    live = env.live
    req = build_registration(env, drawn)
    before = live.snapshot()
    method = "/kvmap.v1.Registry/RegisterWorker"
    # As the test's own uid (a path registration needs the caller's credentials).
    out = call(partial(live.registry.RegisterWorker, metadata=_me(env)), req, method)
    event(f"RegisterWorker {out.code.name}: {out.details[:40]}")
    check_rejected(live, method, out, req, before)
    if out.code is OK:
        _undo_registration(env, req, before)
    live.assert_healthy()


@fuzz_settings(120)
@given(drawn=registrations(), planner=st.sampled_from(["", "coalesce", "baseline"]) | odd_strings,
       tcp=st.booleans())  # fmt: skip
def test_plan_preview(env: Env, drawn: tuple[Any, ...], planner: str, tcp: bool) -> None:
    """Fuzzed PlanPreview requests on both listeners: statuses in the closed set; an accepted
    preview is an unregistered plan (generation 0, no addresses) whose descriptor count is its
    blocks; the daemon's state never changes."""
    live = env.live
    req = region_maps_pb2.PlanPreviewRequest(spec=build_registration(env, drawn), planner=planner)
    before = live.snapshot()
    method = "/kvmap.v1.RegionMaps/PlanPreview"
    out = call((live.tcp_maps if tcp else live.maps).PlanPreview, req, method)
    check_status(live, method, out, req)
    if out.code is OK:
        m = out.response.region_map
        assert m.generation == 0 and all(a.base_address == 0 for a in m.allocations)
        assert m.descriptor_count == sum(r.num_blocks for r in m.regions)
    assert live.snapshot() == before, "PlanPreview changed the daemon's state"
    live.assert_healthy()


# Worker lookups -----------------------------------------------------------------

others = worker_ids([ENGINE]).filter(lambda w: not is_key(w, ENGINE))


@fuzz_settings(60)
@given(worker=others)
def test_deregister_unknown_workers(env: Env, worker: types_pb2.WorkerId) -> None:
    """Deregistering any worker id other than the registered one is refused with a closed-set status
    and changes nothing."""
    live = env.live
    req = registry_pb2.DeregisterWorkerRequest(worker=worker)
    before = live.snapshot()
    method = "/kvmap.v1.Registry/DeregisterWorker"
    out = call(live.registry.DeregisterWorker, req, method)
    check_rejected(live, method, out, req, before)
    assert out.code is not OK, f"deregistered a worker that was never registered: {short(req)}"


@fuzz_settings(60)
@given(worker=others)
def test_attach_unknown_workers(env: Env, worker: types_pb2.WorkerId) -> None:
    """Attaching any worker id other than the registered one is refused with a closed-set status and
    changes nothing."""
    live = env.live
    req = registry_pb2.AttachRequest(worker=worker)
    before = live.snapshot()
    method = "/kvmap.v1.Registry/Attach"
    out = call_stream(live.registry.Attach, req, method, first_only=True)
    check_rejected(live, method, out, req, before)
    assert out.code is not OK, f"attached to a worker that was never registered: {short(req)}"


def test_a_strangers_attach_ending_does_not_remove_a_live_worker(env: Env) -> None:
    """Other Attach streams to the live worker that open and end (another process of its uid; any
    other caller is refused) leave it registered: the state is unchanged."""
    live = env.live
    before = live.snapshot()
    req = registry_pb2.AttachRequest(worker=types_pb2.WorkerId(engine_id=ENGINE))
    for _ in range(3):
        attach = partial(live.registry.Attach, metadata=_me(env))
        out = call_stream(attach, req, "Attach", first_only=True)
        assert out.code is OK and out.response.WhichOneof("event") == "attached", out
    assert live.snapshot() == before


@fuzz_settings(80)
@given(worker=worker_ids([ENGINE]), tcp=st.booleans(), peer=st.booleans())
def test_get_region_map_and_agent_metadata(
    env: Env, worker: types_pb2.WorkerId, tcp: bool, peer: bool
) -> None:
    """GetRegionMap (both listeners) and GetAgentMetadata answer OK exactly for the registered
    worker id, with this daemon's agent and matching generations; other ids are refused; nothing
    changes."""
    live = env.live
    before = live.snapshot()
    if peer:
        method = "/kvmap.v1.Peer/GetAgentMetadata"
        req: Any = peer_pb2.GetAgentMetadataRequest(worker=worker)
        out = call(live.peer.GetAgentMetadata, req, method)
    else:
        method = "/kvmap.v1.RegionMaps/GetRegionMap"
        req = region_maps_pb2.GetRegionMapRequest(worker=worker)
        out = call((live.tcp_maps if tcp else live.maps).GetRegionMap, req, method)
    check_rejected(live, method, out, req, before)
    assert (out.code is OK) == is_key(worker, ENGINE), (out.code, short(req))
    if out.code is OK and peer:
        assert out.response.agent_name == live.daemon.agent
        assert out.response.generation == out.response.region_map.generation


# Admin ----------------------------------------------------------------------------

KNOWN_PLANNERS = {"", "coalesce", "baseline"}


@fuzz_settings(40)
@given(planner=odd_strings.filter(lambda p: p not in KNOWN_PLANNERS))
def test_replan_with_unknown_planners(env: Env, planner: str) -> None:
    """Replan to an unknown planner name is INVALID_ARGUMENT naming the planner, and changes
    nothing."""
    live = env.live
    req = admin_pb2.ReplanRequest(planner=planner)
    before = live.snapshot()
    method = "/kvmap.v1.Admin/Replan"
    out = call(live.admin.Replan, req, method)
    check_rejected(live, method, out, req, before)
    assert out.code is INVALID and "planner" in out.details, out


def test_replan_with_known_planners_bumps_generation_once_each(env: Env) -> None:
    """Each replan to a known planner bumps the worker's generation by exactly one and the daemon
    reports the new planner."""
    live = env.live
    gen = live.generation(ENGINE)
    for i, planner in enumerate(["baseline", "coalesce"], start=1):
        out = call(live.admin.Replan, admin_pb2.ReplanRequest(planner=planner), "Replan")
        assert out.code is OK, out
        assert [w.generation for w in out.response.workers] == [gen + i]
        assert live.generation(ENGINE) == gen + i
    stats = call(live.admin.GetStats, admin_pb2.GetStatsRequest(), "GetStats")
    assert stats.code is OK and stats.response.planner.name == "coalesce"


# Peer ------------------------------------------------------------------------------


# Owner's blocks a BeginTransfer names; GRANTED is what "<granted>" allows.
GRANTED = {0: [1, 2]}
BLOCK_CHOICES = [
    [], [(0, [1])], [(0, [1, 2])], [(0, [2, 1])], [(0, [1, 3])], [(1, [1])], [(0, [-1])],
    [(0, [1]), (1, [])], [(7, [1])],
]  # fmt: skip


@st.composite
def begin_fields(draw: st.DrawFn) -> dict[str, Any]:
    """BeginTransfer fields; "<current>", "<agent>" and the capabilities
    ("<granted>": the worker's grant of ``GRANTED`` for this request id,
    "<other-request>": one for another request) are filled in per example."""
    return {
        "capability": draw(
            st.sampled_from(["<granted>", "<granted>", "<other-request>", ""]) | odd_strings
        ),
        "groups": draw(st.sampled_from(BLOCK_CHOICES)),
        "request_id": draw(odd_strings),
        "worker": draw(worker_ids([ENGINE])),
        "generation": draw(st.sampled_from(["<current>", "<current+1>"]) | uint64s),
        "agent_name": draw(st.sampled_from(["", "<agent>", "kvmapd-other"]) | odd_strings),
        "peer_agent": draw(st.sampled_from(["", "peer-a"]) | odd_strings),
        "write": draw(st.booleans()),
        "lease_ms": draw(st.sampled_from([0, 1, 100]) | uint32s),
        "blocks": draw(int64s),
        "bytes": draw(int64s),
    }


def _grant(live: Live, request_id: str) -> str:
    """The worker's capability for ``GRANTED`` of ``request_id``; "" when the
    daemon refuses that request id (then the example has no capability)."""
    req = registry_pb2.GrantTransferRequest(
        worker=types_pb2.WorkerId(engine_id=ENGINE),
        request_id=request_id,
        groups=[types_pb2.BlockGrant(transfer_group=g, block_ids=b) for g, b in GRANTED.items()],
    )
    # As the worker's own uid: a grant is honoured only from the uid that registered it.
    grant = partial(live.registry.GrantTransfer, metadata=credential_metadata(live.daemon.socket))
    out = call(grant, req, "/kvmap.v1.Registry/GrantTransfer")
    if out.code is INVALID:
        return ""
    assert out.code is OK, out
    return str(out.response.capability)


def begin_request(live: Live, fields: dict[str, Any]) -> peer_pb2.BeginTransferRequest:
    f = dict(fields)
    if f["capability"] == "<granted>":
        f["capability"] = _grant(live, f["request_id"])
    elif f["capability"] == "<other-request>":
        f["capability"] = _grant(live, f["request_id"] + "-other")
    f["groups"] = [types_pb2.BlockGrant(transfer_group=g, block_ids=b) for g, b in f["groups"]]
    current = live.generation(ENGINE)
    if f["generation"] == "<current>":
        f["generation"] = current
    elif f["generation"] == "<current+1>":
        f["generation"] = current + 1
    if f["agent_name"] == "<agent>":
        f["agent_name"] = live.daemon.agent
    return peer_pb2.BeginTransferRequest(**f)


@fuzz_settings(120)
@given(fields=begin_fields())
def test_begin_transfer(env: Env, fields: dict[str, Any]) -> None:
    """Fuzzed BeginTransfer: statuses in the closed set; only a request with non-negative sizes for
    the live worker at its current generation (this agent or none), carrying the worker's
    capability for this request id and naming only granted blocks, pins it, and ending the lease
    restores the state; negative sizes are INVALID_ARGUMENT, a missing, fuzzed or other request's
    capability PERMISSION_DENIED with one message, and with the right capability a stale
    generation FAILED_PRECONDITION."""
    live = env.live
    req = begin_request(live, fields)
    granted = fields["capability"] == "<granted>" and bool(req.capability)
    # No capability the daemon ever handed out: refused before anything else is looked at.
    unknown = fields["capability"] not in ("<granted>", "<other-request>") or not req.capability
    inside = any(ids for _, ids in fields["groups"]) and all(
        g in GRANTED and set(ids) <= set(GRANTED[g]) for g, ids in fields["groups"]
    )
    before = live.snapshot()
    method = "/kvmap.v1.Peer/BeginTransfer"
    out = call(live.peer.BeginTransfer, req, method)
    check_rejected(live, method, out, req, before)
    if out.code is OK:
        # Only a request naming the live worker at its current generation
        # (and this daemon's agent, or none) with sizes that are not
        # negative may pin it.
        assert req.blocks >= 0 and req.bytes >= 0, short(req)
        assert is_key(req.worker, ENGINE), short(req)
        assert req.generation == live.generation(ENGINE), short(req)
        assert req.agent_name in ("", live.daemon.agent), short(req)
        assert granted and inside, f"pinned without a capability for it: {short(req)}"
        token = out.response.transfer_token
        assert len(token) >= 32, token
        end = call(live.peer.EndTransfer, peer_pb2.EndTransferRequest(transfer_token=token), "End")
        assert end.code is OK, end
        assert live.snapshot() == before
    elif req.blocks < 0 or req.bytes < 0:
        # Bad arguments whatever the daemon's state: checked first.
        assert out.code is grpc.StatusCode.INVALID_ARGUMENT, out
    elif req.peer_agent and unknown:
        assert (out.code, out.details) == (DENIED, "capability does not allow this transfer"), out
    elif (
        req.peer_agent
        and granted  # another request's capability is refused before the generation is read
        and inside
        and is_key(req.worker, ENGINE)
        and req.agent_name in ("", live.daemon.agent)
        and req.generation != live.generation(ENGINE)
    ):
        assert out.code is grpc.StatusCode.FAILED_PRECONDITION, out


@fuzz_settings(40)
@given(token=st.sampled_from(["", "0" * 32]) | odd_strings, completed=st.booleans())
def test_end_transfer_with_unknown_tokens(env: Env, token: str, completed: bool) -> None:
    """EndTransfer with tokens that were never handed out answers a closed-set status and changes
    nothing."""
    live = env.live
    req = peer_pb2.EndTransferRequest(transfer_token=token, completed=completed)
    before = live.snapshot()
    method = "/kvmap.v1.Peer/EndTransfer"
    out = call(live.peer.EndTransfer, req, method)
    check_rejected(live, method, out, req, before)
    assert live.snapshot() == before


# Raw bytes -------------------------------------------------------------------------


def _seed_requests() -> dict[str, bytes]:
    """A well-formed request per method, to truncate and corrupt: harmless
    ones (unknown workers), so that no corruption of them can be valid
    and change state, except Replan, which may legitimately re-plan."""
    ghost = types_pb2.WorkerId(engine_id="ghost", dp_rank=3, tp_rank=1, pp_rank=2)
    spec = transfers_pb2.TransferSpec(
        request_id="r", local_worker=ghost, remote_target="127.0.0.1:1", remote_worker=ghost,
        groups=[transfers_pb2.GroupBlocks(transfer_group=0, local_block_ids=[1, 2, 300],
                                          remote_block_ids=[4, 5, 6], layer_names=["m0"])],
        remote_generation=3, timeout_ms=2000, capability="c" * 43,
    )  # fmt: skip
    reg = template("ghost")
    for a in reg.allocations:
        a.shm_fd.CopyFrom(types_pb2.ShmFdHandle(token="0" * 32, index=1, offset_bytes=4096))
    # A well-formed push offer of the ghost worker's blocks to an engine.
    offer = types_pb2.PushOffer(
        push_id="p" * 24,
        prefill_engine_id="ghost",
        decode_worker=ghost,
        decode_target=spec.remote_target,
        decode_tp_size=1,
        decode_block_size=16,
        num_tokens=32,
        groups=[types_pb2.BlockGrant(transfer_group=0, block_ids=[1, 2])],
        capability="c" * 43,
        request_id="r",
    )
    msgs: dict[str, Any] = {
        "/kvmap.v1.Registry/RegisterWorker": reg,
        "/kvmap.v1.Registry/DeregisterWorker": registry_pb2.DeregisterWorkerRequest(worker=ghost),
        "/kvmap.v1.Registry/Attach": registry_pb2.AttachRequest(worker=ghost),
        "/kvmap.v1.Registry/GrantTransfer": registry_pb2.GrantTransferRequest(
            worker=ghost,
            request_id="r",
            groups=[types_pb2.BlockGrant(transfer_group=0, block_ids=[1, 2])],
            ttl_ms=1000,
            max_uses=1,
        ),
        "/kvmap.v1.Registry/RevokeTransfer": registry_pb2.RevokeTransferRequest(
            worker=ghost, request_id="r"
        ),
        "/kvmap.v1.RegionMaps/ListWorkers": region_maps_pb2.ListWorkersRequest(),
        "/kvmap.v1.RegionMaps/GetRegionMap": region_maps_pb2.GetRegionMapRequest(worker=ghost),
        "/kvmap.v1.RegionMaps/PlanPreview": region_maps_pb2.PlanPreviewRequest(
            spec=template("ghost"), planner="baseline"
        ),
        "/kvmap.v1.Admin/Replan": admin_pb2.ReplanRequest(planner="nonexistent-planner"),
        "/kvmap.v1.Admin/GetStats": admin_pb2.GetStatsRequest(),
        "/kvmap.v1.Admin/GetStatus": admin_pb2.GetStatusRequest(),
        "/kvmap.v1.Transfers/Pull": transfers_pb2.PullRequest(spec=spec),
        "/kvmap.v1.Transfers/Push": transfers_pb2.PushRequest(spec=spec),
        "/kvmap.v1.Transfers/Release": transfers_pb2.ReleaseRequest(
            request_id="r",
            local_worker=ghost,
            remote_target=spec.remote_target,
            remote_worker=ghost,
            capability="c" * 43,
            readers=1,
        ),
        "/kvmap.v1.Peer/GetAgentMetadata": peer_pb2.GetAgentMetadataRequest(worker=ghost),
        "/kvmap.v1.Peer/BeginTransfer": peer_pb2.BeginTransferRequest(
            request_id="r",
            worker=ghost,
            generation=5,
            agent_name="a",
            peer_agent="p",
            lease_ms=10,
            blocks=3,
            bytes=300,
            capability="c" * 43,
            groups=[types_pb2.BlockGrant(transfer_group=0, block_ids=[4, 5, 6])],
        ),
        "/kvmap.v1.Peer/EndTransfer": peer_pb2.EndTransferRequest(transfer_token="t" * 32),
        "/kvmap.v1.Peer/OfferPush": peer_pb2.PeerOfferPushRequest(offer=offer),
        "/kvmap.v1.Transfers/OfferPush": transfers_pb2.OfferPushRequest(
            target=spec.remote_target, offer=offer, timeout_ms=500
        ),
    }
    begin = msgs["/kvmap.v1.Peer/BeginTransfer"]
    assert isinstance(begin, peer_pb2.BeginTransferRequest)
    msgs["/kvmap.v1.Peer/BeginTransfers"] = peer_pb2.BeginTransfersRequest(calls=[begin, begin])
    msgs["/kvmap.v1.Peer/BeginTransferStream"] = peer_pb2.BeginTransferStreamRequest(
        calls=[begin, begin]
    )
    return {m: msg.SerializeToString() for m, msg in msgs.items()}


SEEDS = _seed_requests()
ROUTES = [(m, False) for m in UNIX_METHODS] + [(m, True) for m in TCP_METHODS]


@st.composite
def raw_requests(draw: st.DrawFn) -> tuple[str, bool, bytes]:
    method, tcp = draw(st.sampled_from(ROUTES))
    seed = SEEDS[method]
    how = draw(st.sampled_from(["random", "truncate", "flip", "append", "seed"]))
    if how == "random":
        data = draw(st.binary(max_size=300))
    elif how == "truncate":
        data = seed[: draw(st.integers(0, max(0, len(seed) - 1)))]
    elif how == "flip" and seed:
        i = draw(st.integers(0, len(seed) - 1))
        data = seed[:i] + bytes([seed[i] ^ draw(st.integers(1, 255))]) + seed[i + 1 :]
    elif how == "append":
        data = seed + draw(st.binary(min_size=1, max_size=64))
    else:
        data = seed
    return method, tcp, data


def _decodes(method: str, data: bytes) -> bool:
    try:
        request_class(method).FromString(data)
    except Exception:
        return False
    return True


def _raw_call(live: Live, method: str, tcp: bool, data: bytes) -> Any:
    if method in STREAMING:
        return call_stream(live.raw_stream(method, tcp), data, method, first_only=True)
    if method in BIDI:
        return call_stream(live.raw_bidi(method, tcp), data, method)
    return call(live.raw_unary(method, tcp), data, method)


@fuzz_settings(300)
@given(raw=raw_requests())
def test_raw_bytes_that_decode(env: Env, raw: tuple[str, bool, bytes]) -> None:
    """Truncated, corrupted and random bytes that still parse as the method's
    request (proto3 parses many): the same rules as any request."""
    method, tcp, data = raw
    assume(_decodes(method, data))
    live = env.live
    before = live.snapshot()
    out = _raw_call(live, method, tcp, data)
    if method == "/kvmap.v1.Admin/Replan" and out.code is OK:
        return  # an empty planner name re-plans with the configured planner
    check_rejected(live, method, out, data, before)
    if method == "/kvmap.v1.Peer/BeginTransfer" and out.code is OK:
        token = peer_pb2.BeginTransferResponse.FromString(out.response).transfer_token
        call(live.peer.EndTransfer, peer_pb2.EndTransferRequest(transfer_token=token), "End")
    if method in ("/kvmap.v1.Peer/BeginTransfers", "/kvmap.v1.Peer/BeginTransferStream"):
        for answer in out.responses if out.code is OK else []:
            for result in peer_pb2.BeginTransfersResponse.FromString(answer).results:
                end = peer_pb2.EndTransferRequest(transfer_token=result.transfer_token)
                if result.transfer_token:
                    call(live.peer.EndTransfer, end, "End")
    if method in ("/kvmap.v1.Registry/RegisterWorker", "/kvmap.v1.Registry/DeregisterWorker"):
        assert out.code is not OK, f"{method} accepted raw bytes {data!r}"
    live.assert_healthy()


@fuzz_settings(150)
@given(raw=raw_requests())
def test_raw_bytes_that_do_not_decode_are_invalid_argument(
    env: Env, raw: tuple[str, bool, bytes]
) -> None:
    """Bytes that are not the method's request message at all: INVALID_ARGUMENT
    (the request is malformed), nothing changes, the daemon lives on."""
    method, tcp, data = raw
    assume(not _decodes(method, data))
    live = env.live
    before = live.snapshot()
    out = _raw_call(live, method, tcp, data)
    assert out.code is INVALID, (
        f"{method} answered {out.code.name} ({out.details!r}) to undecodable bytes {data[:64]!r}"
    )
    assert live.snapshot() == before
    live.assert_healthy()


def test_every_method_of_the_api_is_fuzzed() -> None:
    """Every RPC of the API has a closed set of statuses and a seed request for the raw-bytes
    fuzzing: a new method cannot go unfuzzed."""
    methods = set()
    for module in (registry_pb2, region_maps_pb2, admin_pb2, transfers_pb2, peer_pb2):
        for svc in module.DESCRIPTOR.services_by_name.values():
            methods |= {f"/{svc.full_name}/{m}" for m in svc.methods_by_name}
    assert methods == set(ALLOWED) == set(SEEDS)


@pytest.mark.parametrize(("method", "tcp"), ROUTES)
def test_undecodable_request_is_invalid_argument(env: Env, method: str, tcp: bool) -> None:
    """Bytes that parse as no request are INVALID_ARGUMENT on every method and listener, change
    nothing, and the daemon stays healthy."""
    live = env.live
    data = b"\xff\xff\xff"  # field 0x1fffff... with an invalid wire type: never parses
    assert not _decodes(method, data)
    before = live.snapshot()
    out = _raw_call(live, method, tcp, data)
    assert live.snapshot() == before
    live.assert_healthy()
    assert out.code is INVALID, (out.code, out.details)


def test_a_shm_path_with_a_nul_byte_is_invalid_argument(env: Env) -> None:
    """A shared-memory path with a NUL byte is INVALID_ARGUMENT naming the field, and changes
    nothing."""
    live = env.live
    req = template()
    for a in req.allocations:
        a.shm_path.CopyFrom(types_pb2.ShmPathHandle(path=env.good_path + "\x00.bin"))
    before = live.snapshot()
    out = call(live.registry.RegisterWorker, req, "RegisterWorker")
    assert live.snapshot() == before
    live.assert_healthy()
    assert out.code is INVALID, (out.code, out.details)
    assert out.details.startswith("allocations[0].shm_path"), out.details
