"""The worker-facing contract of kvmapd, against real ``kvmapd serve``
processes: ``KvmapdTransport`` over their Unix sockets, fds over the hand-off
socket, real shared memory, real NIXL between the two daemons on 127.0.0.1.
What a worker may send, what is accepted, rejected (with which error) and
answered. (It once also held the client's in-memory stand-in daemon to the
same answers; tests now serve the real daemon in-process instead:
``tests/support/inproc_daemon.py``.)

The two daemons: "prefill" plans with ``coalesce`` and "decode" with
``baseline`` (so pulls cross differently planned maps). The daemons live
for the module; every test names its own workers and removes them at the end.
Every call has a deadline and every wait is bounded.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import torch

from kvmap.client.geometry import LayerSpec, export_registration
from kvmap.client.transports import KvmapdTransport, Transport
from kvmap.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    KvmapError,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from kvmap.tools.launch import DaemonProc, start_daemon
from kvmap.v1 import admin_pb2, region_maps_pb2, registry_pb2, transfers_pb2, types_pb2

pytestmark = [pytest.mark.timeout(180), pytest.mark.integration]

T = 15.0  # deadline of every call, seconds
BLOCKS, LAYERS, PAGE = 16, 3, 256
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
MLA = types_pb2.CACHE_KIND_MLA


# A 127.0.0.1 port that refuses connections: bound (so no daemon started
# later can take it) but never listening.
_REFUSING = socket.socket()
_REFUSING.bind(("127.0.0.1", 0))
UNREACHABLE = f"127.0.0.1:{_REFUSING.getsockname()[1]}"


# Backends -------------------------------------------------------------------


@dataclass
class Backend:
    kind: str
    prefill_target: str
    decode_target: str
    connect: Callable[[str], Transport]  # "prefill" / "decode" -> a new transport


@pytest.fixture(scope="module")
def real_daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, DaemonProc]]:
    tmp = tmp_path_factory.mktemp("kvmapd")
    daemons: dict[str, DaemonProc] = {}
    try:
        for role, planner in (("prefill", "coalesce"), ("decode", "baseline")):
            daemons[role] = start_daemon(tmp / role, "--planner", planner, name=role)
        yield daemons
    finally:
        for d in daemons.values():
            d.stop()


@pytest.fixture(scope="module")
def backend(real_daemons: dict[str, DaemonProc]) -> Backend:
    real = real_daemons
    return Backend(
        "grpc",
        real["prefill"].tcp_target,
        real["decode"].tcp_target,
        lambda role: KvmapdTransport(real[role].socket),
    )


# Workers ----------------------------------------------------------------------


@dataclass
class Worker:
    role: str
    id: types_pb2.WorkerId
    request: registry_pb2.RegisterWorkerRequest
    fds: list[int]
    kv: torch.Tensor  # [BLOCKS, LAYERS, PAGE]: block-outermost, one layer per column

    @property
    def name(self) -> str:
        return f"{self.id.engine_id}/dp0/tp0/pp0"


def registration(worker: types_pb2.WorkerId, fill: bool) -> tuple[Worker, list[int]]:
    kv = torch.zeros(BLOCKS, LAYERS, PAGE, dtype=torch.uint8)
    if fill:
        g = torch.Generator().manual_seed(11)
        kv.copy_(torch.randint(1, 255, kv.shape, generator=g, dtype=torch.uint8))
    tensors = {name: kv[:, i] for i, name in enumerate(LAYER_NAMES)}
    specs = {name: LayerSpec(0, MLA, BLOCKS) for name in LAYER_NAMES}
    req, fds = export_registration(
        worker, tensors, specs, block_size_tokens=16, kv_cache_layout="BLHNC"
    )
    return Worker("", worker, req, fds, kv), fds


def send_and_register(
    transport: Transport,
    w: Worker,
    mutate: Callable[[registry_pb2.RegisterWorkerRequest], None] | None = None,
) -> types_pb2.RegionMap:
    """What ``KvmapClient.register`` does, with a hook to spoil the request
    after the fds are sent."""
    req = registry_pb2.RegisterWorkerRequest()
    req.CopyFrom(w.request)
    token = transport.send_fds(w.fds, T)
    for alloc in req.allocations:
        alloc.shm_fd.token = token
    if mutate is not None:
        mutate(req)
    return transport.register_worker(req, T).region_map


@dataclass
class World:
    """One test's view of a backend: its transports and its workers."""

    backend: Backend
    prefix: str
    transports: dict[str, Transport] = field(default_factory=dict)
    workers: list[Worker] = field(default_factory=list)

    def transport(self, role: str) -> Transport:
        if role not in self.transports:
            self.transports[role] = self.backend.connect(role)
        return self.transports[role]

    def worker_id(self, name: str) -> types_pb2.WorkerId:
        return types_pb2.WorkerId(engine_id=f"{self.prefix}-{name}")

    def register(self, role: str, name: str, fill: bool = False) -> Worker:
        w, _ = registration(self.worker_id(name), fill)
        w.role = role
        self.workers.append(w)
        send_and_register(self.transport(role), w)
        return w

    def region_map(self, role: str, worker: types_pb2.WorkerId) -> types_pb2.RegionMap:
        req = region_maps_pb2.GetRegionMapRequest(worker=worker)
        return self.transport(role).get_region_map(req, T).region_map

    def deregister(self, role: str, worker: types_pb2.WorkerId) -> int:
        req = registry_pb2.DeregisterWorkerRequest(worker=worker)
        return self.transport(role).deregister_worker(req, T).generation

    def stats(self, role: str) -> admin_pb2.GetStatsResponse:
        return self.transport(role).get_stats(T)

    def close(self) -> None:
        for w in self.workers:
            # Deregistered by the test already, or dropped with its stream.
            with contextlib.suppress(NotFound):
                self.deregister(w.role, w.id)
        for t in self.transports.values():
            t.close()


_serial = itertools.count()


@pytest.fixture
def world(backend: Backend, request: pytest.FixtureRequest) -> Iterator[World]:
    w = World(backend, f"{request.node.originalname}-{next(_serial)}")
    yield w
    w.close()


class Events:
    """An Attach stream read on a thread, so that every wait is bounded."""

    def __init__(self, transport: Transport, worker: types_pb2.WorkerId) -> None:
        self._queue: queue.Queue[object] = queue.Queue()
        self._stream = transport.attach(registry_pb2.AttachRequest(worker=worker))
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for event in self._stream:
                self._queue.put(event)
        except KvmapError as err:
            self._queue.put(err)
        self._queue.put(None)

    def next(self) -> registry_pb2.AttachResponse:
        item = self._queue.get(timeout=T)
        assert isinstance(item, registry_pb2.AttachResponse), item
        return item

    def close(self) -> None:
        self._stream.cancel()
        self._thread.join(T)
        assert not self._thread.is_alive()


def wait_for(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + T
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {T}s"
        time.sleep(0.02)


# Registration -----------------------------------------------------------------


def test_register_publishes_the_planned_region_map(world: World) -> None:
    """A registration answers with the daemon's planned map at generation 1
    (coalesce: the three MLA layers of a block-outermost row are one full-row
    region; baseline: one region per layer), over a real mapping of the
    worker's memory, and GetRegionMap reads back the same map."""
    p = world.register("prefill", "p")
    d = world.register("decode", "d")
    pm, dm = world.region_map("prefill", p.id), world.region_map("decode", d.id)
    assert (pm.planner.name, pm.planner.version, pm.generation) == ("coalesce", 1, 1)
    row = LAYERS * PAGE
    assert [
        (
            *(r.id, r.transfer_group, r.offset_bytes, r.block_len_bytes, r.block_stride_bytes),
            *(r.num_blocks, r.full_row, list(r.layer_names), r.fallback_reason),
        )
        for r in pm.regions
    ] == [(0, 0, 0, row, row, BLOCKS, True, LAYER_NAMES, "")]
    assert [[(s.offset_in_region_bytes, s.len_bytes) for s in r.layers] for r in pm.regions] == [
        [(i * PAGE, PAGE) for i in range(LAYERS)]
    ]
    assert (pm.descriptor_count, pm.baseline_descriptor_count, pm.view_count) == (
        BLOCKS,
        LAYERS * BLOCKS,
        LAYERS,
    )
    assert (dm.planner.name, dm.generation) == ("baseline", 1)
    assert [
        (
            *(r.id, r.offset_bytes, r.block_len_bytes, r.block_stride_bytes, r.full_row),
            *(list(r.layer_names), r.fallback_reason),
        )
        for r in dm.regions
    ] == [
        (i, i * PAGE, PAGE, row, False, [LAYER_NAMES[i]], "baseline planner: one region per view")
        for i in range(LAYERS)
    ]
    assert dm.descriptor_count == dm.baseline_descriptor_count == LAYERS * BLOCKS
    for m, w in ((pm, p), (dm, d)):
        assert (m.kv_cache_layout, m.block_size_tokens, m.tp_size) == ("BLHNC", 16, 1)
        assert m.worker == w.id
        assert [(a.id, a.size_bytes, a.device.type, a.device.index) for a in m.allocations] == [
            ("kv0", BLOCKS * row, types_pb2.DEVICE_TYPE_CPU, 0)
        ]
        assert m.allocations[0].base_address > 0  # the daemon mapped it


def test_reregistration_bumps_the_generation_and_stats_count_workers(world: World) -> None:
    """Registering the same worker again replaces it at the next generation
    (the map is otherwise the same); the daemon counts each worker once."""
    before = world.stats("prefill").workers
    p = world.register("prefill", "p")
    first = world.region_map("prefill", p.id)
    again = send_and_register(world.transport("prefill"), p)
    assert again.generation == 2 == world.region_map("prefill", p.id).generation
    assert list(again.regions) == list(first.regions)
    assert world.stats("prefill").workers == before + 1


def _set(path: str, value: object) -> Callable[[registry_pb2.RegisterWorkerRequest], None]:
    """A mutation setting ``path`` (``views[1].num_blocks``) of the request."""

    def mutate(req: registry_pb2.RegisterWorkerRequest) -> None:
        target: object = req
        parts = path.replace("]", "").replace("[", ".").split(".")
        for part in parts[:-1]:
            target = target[int(part)] if part.isdigit() else getattr(target, part)  # type: ignore[index]
        setattr(target, parts[-1], value)

    return mutate


def _clear_handle(req: registry_pb2.RegisterWorkerRequest) -> None:
    req.allocations[0].ClearField("shm_fd")


def _overlap(req: registry_pb2.RegisterWorkerRequest) -> None:
    req.views[1].offset_bytes = req.views[0].offset_bytes + 1


INVALID_REGISTRATIONS = {
    "empty engine id": (
        _set("worker.engine_id", ""),
        InvalidArgument,
        "INVALID_ARGUMENT: worker.engine_id: must not be empty",
    ),
    "tp rank past tp size": (
        _set("worker.tp_rank", 2),
        InvalidArgument,
        "INVALID_ARGUMENT: worker.tp_rank: must be < tp_size (2 >= 1)",
    ),
    "zero blocks": (
        _set("views[1].num_blocks", 0),
        InvalidArgument,
        "INVALID_ARGUMENT: views[1].num_blocks: must be > 0 (got 0)",
    ),
    "stride below length": (
        _set("views[0].block_stride_bytes", PAGE - 1),
        InvalidArgument,
        "INVALID_ARGUMENT: views[0].block_stride_bytes: must be >= block_len_bytes",
    ),
    "unknown allocation": (
        _set("views[0].allocation_id", "nope"),
        InvalidArgument,
        "INVALID_ARGUMENT: views[0].allocation_id: unknown allocation 'nope'",
    ),
    "no cache kind": (
        _set("views[2].cache_kind", types_pb2.CACHE_KIND_UNSPECIFIED),
        InvalidArgument,
        "INVALID_ARGUMENT: views[2].cache_kind: must be set",
    ),
    "view past its allocation": (
        _set("views[2].num_blocks", BLOCKS + 1),
        InvalidArgument,
        "INVALID_ARGUMENT: views[2]: does not fit in allocation 'kv0'",
    ),
    "overlapping views": (
        _overlap,
        InvalidArgument,
        "INVALID_ARGUMENT: views[1]: overlaps views[0]",
    ),
    "cuda device on shared memory": (
        _set("allocations[0].device.type", types_pb2.DEVICE_TYPE_CUDA),
        InvalidArgument,
        "INVALID_ARGUMENT: allocations[0].device.type: device type CUDA contradicts the shm_fd",
    ),
    "no memory handle": (
        _clear_handle,
        InvalidArgument,
        "INVALID_ARGUMENT: allocations[0].handle: registration needs memory",
    ),
    "unknown fd token": (
        _set("allocations[0].shm_fd.token", "no-such-token"),
        NotFound,
        "NOT_FOUND: allocations[0].shm_fd.token: unknown or expired fd hand-off token",
    ),
    "fd index outside the batch": (
        _set("allocations[0].shm_fd.index", 5),
        InvalidArgument,
        "INVALID_ARGUMENT: allocations[0].shm_fd.index: index 5 outside the batch of 1 fds",
    ),
    "allocation larger than its memory": (
        _set("allocations[0].size_bytes", BLOCKS * LAYERS * PAGE + (1 << 20)),
        InvalidArgument,
        "INVALID_ARGUMENT: allocations[0].shm_fd: shared-memory object is",
    ),
}


@pytest.mark.parametrize("case", list(INVALID_REGISTRATIONS))
def test_invalid_registration_is_rejected_naming_the_field_and_changes_nothing(
    world: World, case: str
) -> None:
    """A malformed registration of a registered worker fails with the error
    class and message (naming the offending field) that the daemon's core
    gives; the worker keeps its generation-1 map and the next good
    registration is generation 2: the rejected one left no trace."""
    mutate, error, message = INVALID_REGISTRATIONS[case]
    p = world.register("prefill", "p")
    before = world.region_map("prefill", p.id)
    with pytest.raises(error) as raised:
        send_and_register(world.transport("prefill"), p, mutate)
    assert raised.value.message.startswith(message), raised.value.message
    assert world.region_map("prefill", p.id) == before
    assert send_and_register(world.transport("prefill"), p).generation == 2


def test_deregister_forgets_the_worker_but_not_its_generation(world: World) -> None:
    """Deregistering answers the last generation; the worker is then unknown
    (NOT_FOUND naming it, for reads and a second deregistration), and a new
    registration continues at the next generation."""
    p = world.register("prefill", "p")
    assert world.deregister("prefill", p.id) == 1
    unknown = f"NOT_FOUND: worker {p.name} is not registered"
    with pytest.raises(NotFound) as raised:
        world.region_map("prefill", p.id)
    assert raised.value.message == unknown
    with pytest.raises(NotFound) as raised:
        world.deregister("prefill", p.id)
    assert raised.value.message == unknown
    assert send_and_register(world.transport("prefill"), p).generation == 2


def test_calls_naming_no_worker_are_invalid(world: World) -> None:
    """Deregister and GetRegionMap without an engine id are INVALID_ARGUMENT
    naming worker.engine_id."""
    nobody = types_pb2.WorkerId()
    for call in (world.deregister, world.region_map):
        with pytest.raises(InvalidArgument) as raised:
            call("prefill", nobody)
        assert raised.value.message == "INVALID_ARGUMENT: worker.engine_id: must not be empty"


# Attach ---------------------------------------------------------------------------


def test_attach_to_an_unknown_worker_is_not_found(world: World) -> None:
    """Attaching a worker the daemon does not know fails NOT_FOUND naming it
    (at the call or on the stream's first read)."""
    nobody = world.worker_id("nobody")
    with pytest.raises(NotFound) as raised:
        stream = world.transport("prefill").attach(registry_pb2.AttachRequest(worker=nobody))
        next(iter(stream))
    assert (
        raised.value.message
        == f"NOT_FOUND: worker {nobody.engine_id}/dp0/tp0/pp0 is not registered"
    )


def test_attach_streams_attached_then_map_changes_and_its_end_drops_the_worker(
    world: World,
) -> None:
    """An Attach stream starts with ``attached`` (generation, daemon
    instance), then tells of a re-registration (new generation and planner);
    when the worker's only stream ends the daemon drops the worker."""
    p = world.register("prefill", "p")
    events = Events(world.transport("prefill"), p.id)
    try:
        first = events.next()
        assert first.WhichOneof("event") == "attached"
        assert first.attached.generation == 1
        assert first.attached.daemon_instance == world.stats("prefill").daemon_instance
        send_and_register(world.transport("prefill"), p)
        changed = events.next()
        assert changed.WhichOneof("event") == "region_map_changed"
        assert changed.region_map_changed.generation == 2
        assert changed.region_map_changed.planner.name == "coalesce"
    finally:
        events.close()

    def gone() -> bool:
        try:
            world.region_map("prefill", p.id)
        except NotFound:
            return True
        return False

    wait_for(gone, "worker dropped after its Attach stream ended")


# Transfers ----------------------------------------------------------------------


def grant(
    world: World,
    owner: Worker,
    request_id: str,
    blocks: dict[int, list[int]],
    *,
    ttl_ms: int = 0,
    max_uses: int = 0,
    write: bool = False,
) -> registry_pb2.GrantTransferResponse:
    """The owner's worker asks its daemon for a capability to read (or, with
    ``write``, to write) the blocks (it is attached)."""
    req = registry_pb2.GrantTransferRequest(
        worker=owner.id,
        request_id=request_id,
        groups=[types_pb2.BlockGrant(transfer_group=g, block_ids=ids) for g, ids in blocks.items()],
        ttl_ms=ttl_ms,
        max_uses=max_uses,
        access=registry_pb2.GRANT_ACCESS_WRITE if write else registry_pb2.GRANT_ACCESS_READ,
    )
    return world.transport(owner.role).grant_transfer(req, T)


def make_spec(
    world: World,
    request_id: str,
    local: Worker,
    remote: Worker,
    groups: list[tuple[int, list[int], list[int]]],
    *,
    capability: str | None = None,
    write: bool = False,
    **extra: object,
) -> transfers_pb2.TransferSpec:
    """A transfer of ``groups`` (group, local ids, remote ids) with a
    capability the remote worker's daemon granted for exactly its blocks of
    them, to be read or (``write``: a push) written (unless ``capability``
    is given)."""
    if capability is None:
        blocks: dict[int, list[int]] = {}
        for group, _, remote_ids in groups:
            blocks.setdefault(group, []).extend(remote_ids)
        capability = grant(world, remote, request_id, blocks, write=write).capability
    target = (
        world.backend.prefill_target if remote.role == "prefill" else world.backend.decode_target
    )
    spec = transfers_pb2.TransferSpec(
        request_id=request_id,
        local_worker=local.id,
        remote_target=target,
        remote_worker=remote.id,
        timeout_ms=int(T * 1000),
        capability=capability,
    )
    for group, local_ids, remote_ids in groups:
        spec.groups.add(
            transfer_group=group, local_block_ids=local_ids, remote_block_ids=remote_ids
        )
    for key, value in extra.items():
        setattr(spec, key, value)
    return spec


def run(
    world: World, role: str, spec: transfers_pb2.TransferSpec, push: bool = False
) -> list[transfers_pb2.TransferStatus]:
    t = world.transport(role)
    if push:
        return [r.status for r in t.push(spec, T)]
    return [r.status for r in t.pull(spec, T)]


@dataclass
class Pair:
    prefill: Worker
    decode: Worker
    events: Events


@pytest.fixture
def pair(world: World) -> Iterator[Pair]:
    """A filled prefill worker (attached, to hear of pulls) and an empty
    decode worker, on their own daemons."""
    p = world.register("prefill", "p", fill=True)
    d = world.register("decode", "d")
    events = Events(world.transport("prefill"), p.id)
    assert events.next().WhichOneof("event") == "attached"
    yield Pair(p, d, events)
    events.close()


def test_pull_copies_the_blocks_counts_them_and_tells_the_owner(world: World, pair: Pair) -> None:
    """A pull between a coalesced and a baseline map moves every selected
    layer of each block pair (one descriptor per layer per block), answers
    HANDSHAKING then DONE the first time and DONE alone once the peer's map
    is known, counts on both daemons, and the owner's worker hears
    ``transfer_finished`` (PULLED_FROM, naming the puller's agent)."""
    local, remote = [5, 0, 9], [2, 7, 3]
    decode0, prefill0 = world.stats("decode").transfers, world.stats("prefill").transfers
    states = run(
        world, "decode", make_spec(world, "r1", pair.decode, pair.prefill, [(0, local, remote)])
    )
    assert [s.state for s in states] == [
        transfers_pb2.TRANSFER_STATE_HANDSHAKING,
        transfers_pb2.TRANSFER_STATE_DONE,
    ]
    done = states[-1].stats
    assert (done.bytes, done.descriptors, done.remote_generation, done.handshaked) == (
        3 * LAYERS * PAGE,
        3 * LAYERS,
        1,
        True,
    )
    for lb, rb in zip(local, remote, strict=True):
        assert torch.equal(pair.decode.kv[lb], pair.prefill.kv[rb])
    assert int(pair.decode.kv[[b for b in range(BLOCKS) if b not in local]].count_nonzero()) == 0
    finished = pair.events.next()
    assert finished.transfer_finished.request_id == "r1"
    assert finished.transfer_finished.direction == registry_pb2.TRANSFER_DIRECTION_PULLED_FROM
    decode_stats = world.stats("decode")
    assert finished.transfer_finished.peer_agent == f"kvmapd-{decode_stats.daemon_instance}"
    c = decode_stats.transfers
    assert (c.pulls_done - decode0.pulls_done, c.blocks - decode0.blocks) == (1, 3)
    assert c.bytes - decode0.bytes == 3 * LAYERS * PAGE
    s = world.stats("prefill").transfers
    assert (s.served_done - prefill0.served_done, s.served_blocks - prefill0.served_blocks) == (
        1,
        3,
    )

    again = run(world, "decode", make_spec(world, "r2", pair.decode, pair.prefill, [(0, [1], [4])]))
    assert [s.state for s in again] == [transfers_pb2.TRANSFER_STATE_DONE]
    assert again[-1].stats.handshaked is False
    assert torch.equal(pair.decode.kv[1], pair.prefill.kv[4])
    assert pair.events.next().transfer_finished.request_id == "r2"


def test_pull_of_some_layers_moves_only_those(world: World, pair: Pair) -> None:
    """Naming layers moves those layers' bytes of each block and leaves the
    other layers of the same blocks untouched."""
    spec = make_spec(world, "r-part", pair.decode, pair.prefill, [(0, [3], [6])])
    spec.groups[0].layer_names.extend([LAYER_NAMES[1]])
    states = run(world, "decode", spec)
    assert (states[-1].stats.bytes, states[-1].stats.descriptors) == (PAGE, 1)
    assert torch.equal(pair.decode.kv[3, 1], pair.prefill.kv[6, 1])
    assert (
        int(pair.decode.kv[3, 0].count_nonzero()) == int(pair.decode.kv[3, 2].count_nonzero()) == 0
    )


def test_push_writes_the_remote_blocks_and_tells_the_owner(world: World, pair: Pair) -> None:
    """A push from the prefill daemon writes its worker's blocks into the
    decode worker's, and the decode worker (the owner) hears PUSHED_TO."""
    owner = Events(world.transport("decode"), pair.decode.id)
    try:
        assert owner.next().WhichOneof("event") == "attached"
        groups = [(0, [8, 9], [12, 2])]
        spec = make_spec(world, "push-1", pair.prefill, pair.decode, groups, write=True)
        states = run(world, "prefill", spec, push=True)
        assert states[-1].state == transfers_pb2.TRANSFER_STATE_DONE
        assert states[-1].stats.bytes == 2 * LAYERS * PAGE
        assert torch.equal(pair.decode.kv[12], pair.prefill.kv[8])
        assert torch.equal(pair.decode.kv[2], pair.prefill.kv[9])
        event = owner.next().transfer_finished
        assert (event.request_id, event.direction) == (
            "push-1",
            registry_pb2.TRANSFER_DIRECTION_PUSHED_TO,
        )
    finally:
        owner.close()


# (spec change, error, message; "{p}"/"{d}" are the workers, "{t}" the target,
# whether the daemon counts it as a failed transfer)
Change = Callable[[transfers_pb2.TransferSpec], None]


def _spec_set(**values: object) -> Change:
    def change(spec: transfers_pb2.TransferSpec) -> None:
        for key, value in values.items():
            if key in ("local_worker", "remote_worker"):
                getattr(spec, key).engine_id = str(value)
            else:
                setattr(spec, key, value)

    return change


def _group(**values: list[int] | list[str] | int) -> Change:
    def change(spec: transfers_pb2.TransferSpec) -> None:
        g = spec.groups[0]
        for key, value in values.items():
            if isinstance(value, list):
                g.ClearField(key)
                getattr(g, key).extend(value)
            else:
                setattr(g, key, value)

    return change


def _no_groups(spec: transfers_pb2.TransferSpec) -> None:
    spec.ClearField("groups")


PULL_ERRORS: dict[str, tuple[Change, type[KvmapError], str, bool]] = {
    "empty request id": (
        _spec_set(request_id=""),
        InvalidArgument,
        "INVALID_ARGUMENT: spec.request_id: must not be empty",
        False,
    ),
    "target without port": (
        _spec_set(remote_target="somewhere"),
        InvalidArgument,
        "INVALID_ARGUMENT: spec.remote_target: expected HOST:PORT",
        False,
    ),
    "no groups": (
        _no_groups,
        InvalidArgument,
        "INVALID_ARGUMENT: spec.groups: at least one transfer group is required",
        False,
    ),
    "no remote worker": (
        _spec_set(remote_worker=""),
        InvalidArgument,
        "INVALID_ARGUMENT: spec.remote_worker.engine_id: must not be empty",
        False,
    ),
    "unknown local worker": (
        _spec_set(local_worker="{d}-x"),
        NotFound,
        "NOT_FOUND: worker {d}-x/dp0/tp0/pp0 is not registered",
        False,
    ),
    "unknown remote worker": (
        _spec_set(remote_worker="{p}-x"),
        NotFound,
        "NOT_FOUND: remote daemon {t}: NOT_FOUND: worker {p}-x/dp0/tp0/pp0 is not registered",
        True,
    ),
    "unreachable remote daemon": (
        # The first try waits out the 3 s connect timeout (closed and silent
        # ports alike), then it is retried until the deadline; 8 s keeps it
        # short and leaves that first try its time on a loaded machine (at
        # 5 s a busy CI run once saw the deadline first).
        _spec_set(remote_target=UNREACHABLE, timeout_ms=8000),
        Unavailable,
        f"UNAVAILABLE: remote daemon {UNREACHABLE}: no connection within the connect timeout",
        True,
    ),
    "stale remote generation": (
        _spec_set(remote_generation=7),
        FailedPrecondition,
        "FAILED_PRECONDITION: worker {p}/dp0/tp0/pp0: region map generation 7 is stale (current 1)",
        True,
    ),
    "remote block out of range": (
        _group(remote_block_ids=[1, BLOCKS]),
        InvalidArgument,
        f"INVALID_ARGUMENT: groups[0].remote_block_ids[1]: block {BLOCKS} out of range "
        f"[0, {BLOCKS})",
        True,
    ),
    "unequal id counts": (
        _group(remote_block_ids=[1]),
        InvalidArgument,
        "INVALID_ARGUMENT: groups[0].remote_block_ids: 1 ids for 2 local ids",
        False,
    ),
    "destination block twice": (
        _group(local_block_ids=[4, 4]),
        InvalidArgument,
        "INVALID_ARGUMENT: groups[0].local_block_ids[1]: block 4 repeats "
        "groups[0].local_block_ids[0]",
        True,
    ),
    "unknown transfer group": (
        _group(transfer_group=3),
        NotFound,
        "NOT_FOUND: transfer group 3 not in local worker {d}/dp0/tp0/pp0",
        True,
    ),
    "unknown layer": (
        _group(layer_names=["nope"]),
        NotFound,
        "NOT_FOUND: groups[0].layer_names[0]: layer 'nope' not in transfer group 0 of local "
        "worker {d}/dp0/tp0/pp0",
        True,
    ),
}


@pytest.mark.parametrize("case", list(PULL_ERRORS))
def test_bad_pull_fails_with_the_daemons_error_and_moves_nothing(
    world: World, pair: Pair, case: str
) -> None:
    """A pull the daemon cannot run fails with the core's error class and
    message, writes no byte, tells the owner nothing, and counts as a failed
    transfer exactly when it got past parsing and the local worker."""
    change, error, message, counted = PULL_ERRORS[case]
    names = {"p": pair.prefill.id.engine_id, "d": pair.decode.id.engine_id}
    spec = make_spec(world, "bad", pair.decode, pair.prefill, [(0, [4, 5], [1, 2])])
    target = spec.remote_target
    change(spec)
    for key in ("local_worker", "remote_worker"):
        w = getattr(spec, key)
        w.engine_id = w.engine_id.format(**names)
    before = world.stats("decode").transfers
    with pytest.raises(error) as raised:
        run(world, "decode", spec)
    expected = message.format(t=target, **names)
    assert raised.value.message.startswith(expected), raised.value.message
    assert int(pair.decode.kv.count_nonzero()) == 0
    after = world.stats("decode").transfers
    assert (after.failed - before.failed, after.pulls_done - before.pulls_done) == (int(counted), 0)
    # The owner heard nothing: the next event it gets is of the next good pull.
    run(world, "decode", make_spec(world, "good", pair.decode, pair.prefill, [(0, [0], [0])]))
    assert pair.events.next().transfer_finished.request_id == "good"


# Capabilities ------------------------------------------------------------------------

DENIED = (
    "PERMISSION_DENIED: remote daemon {t}: PERMISSION_DENIED: "
    "capability does not allow this transfer"
)


def _refused(
    world: World, pair: Pair, spec: transfers_pb2.TransferSpec, error: type[KvmapError]
) -> str:
    """Run a pull that must be refused: its message; no byte moved, the owner
    heard nothing (its next event is of the next good pull)."""
    with pytest.raises(error) as raised:
        run(world, "decode", spec)
    assert int(pair.decode.kv.count_nonzero()) == 0
    run(world, "decode", make_spec(world, "good", pair.decode, pair.prefill, [(0, [0], [0])]))
    assert pair.events.next().transfer_finished.request_id == "good"
    pair.decode.kv.zero_()
    return raised.value.message


# name -> (spec of the refused pull from a granted capability, error, message)
REFUSED_PULLS: dict[
    str, tuple[Callable[[World, Pair], transfers_pb2.TransferSpec], type[KvmapError], str]
] = {
    "no capability": (
        lambda w, p: make_spec(w, "c", p.decode, p.prefill, [(0, [4], [1])], capability=""),
        PermissionDenied,
        "PERMISSION_DENIED: spec.capability: a transfer needs the owner's capability",
    ),
    "made-up capability": (
        lambda w, p: make_spec(w, "c", p.decode, p.prefill, [(0, [4], [1])], capability="x" * 43),
        PermissionDenied,
        DENIED,
    ),
    "another request id": (
        lambda w, p: make_spec(
            w,
            "other",
            p.decode,
            p.prefill,
            [(0, [4], [1])],
            capability=grant(w, p.prefill, "c", {0: [1]}).capability,
        ),
        PermissionDenied,
        DENIED,
    ),
    "a block outside the grant": (
        lambda w, p: make_spec(
            w,
            "c",
            p.decode,
            p.prefill,
            [(0, [4, 5], [1, 2])],
            capability=grant(w, p.prefill, "c", {0: [1, 3]}).capability,
        ),
        PermissionDenied,
        DENIED,
    ),
    "another worker's capability": (
        lambda w, p: make_spec(
            w,
            "c",
            p.decode,
            p.prefill,
            [(0, [4], [1])],
            capability=grant(w, p.decode, "c", {0: [1]}).capability,
        ),
        PermissionDenied,
        DENIED,
    ),
}


@pytest.mark.parametrize("case", list(REFUSED_PULLS))
def test_pull_without_a_capability_that_allows_it_is_refused(
    world: World, pair: Pair, case: str
) -> None:
    """A pull whose capability is missing, made up, granted for another
    request, another worker, or not for every block it names is refused
    (PERMISSION_DENIED, one message whatever the reason) and moves nothing."""
    make, error, message = REFUSED_PULLS[case]
    decode_events = Events(world.transport("decode"), pair.decode.id)  # to grant on "decode"
    try:
        assert decode_events.next().WhichOneof("event") == "attached"
        spec = make(world, pair)
        got = _refused(world, pair, spec, error)
    finally:
        decode_events.close()
    assert got == message.format(t=spec.remote_target), got


def test_a_capability_is_used_up_by_its_pulls(world: World, pair: Pair) -> None:
    """A capability is single use unless granted for more: the second pull
    with the same one is refused; one granted for two uses allows two."""
    once = make_spec(world, "once", pair.decode, pair.prefill, [(0, [4], [1])])
    run(world, "decode", once)
    assert pair.events.next().transfer_finished.request_id == "once"
    pair.decode.kv.zero_()
    target = once.remote_target
    assert _refused(world, pair, once, PermissionDenied) == DENIED.format(t=target)
    pair.decode.kv.zero_()
    cap = grant(world, pair.prefill, "twice", {0: [2]}, max_uses=2).capability
    twice = make_spec(world, "twice", pair.decode, pair.prefill, [(0, [5], [2])], capability=cap)
    for _ in range(2):
        run(world, "decode", twice)
        assert pair.events.next().transfer_finished.request_id == "twice"
    pair.decode.kv.zero_()
    assert _refused(world, pair, twice, PermissionDenied) == DENIED.format(t=target)


def test_a_capability_for_several_readers_serves_each_once(world: World, pair: Pair) -> None:
    """Decode ranks of another TP size share one prefill rank's capability
    (granted for as many uses as ranks read it): two decode workers of one
    daemon pull with it at once, each gets the bytes and the owner hears of
    both; a third pull with it, by either, is refused."""
    second = world.register("decode", "d2")
    cap = grant(world, pair.prefill, "tp", {0: [3, 6]}, max_uses=2).capability
    specs = [
        make_spec(world, "tp", d, pair.prefill, [(0, [1, 2], [3, 6])], capability=cap)
        for d in (pair.decode, second)
    ]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lambda spec: run(world, "decode", spec), specs))
    assert [states[-1].state for states in done] == [transfers_pb2.TRANSFER_STATE_DONE] * 2
    for d in (pair.decode, second):
        assert torch.equal(d.kv[[1, 2]], pair.prefill.kv[[3, 6]])
    assert [pair.events.next().transfer_finished.request_id for _ in range(2)] == ["tp", "tp"]
    pair.decode.kv.zero_()
    target = specs[0].remote_target
    assert _refused(world, pair, specs[0], PermissionDenied) == DENIED.format(t=target)


def test_an_open_capability_takes_its_count_from_the_first_pull(world: World, pair: Pair) -> None:
    """An open grant (open_uses): the first pull declaring 2 readers fixes it, and the owner
    says 1 of 2 used; a pull declaring 3 is FAILED_PRECONDITION, with the same message
    from both transports, and moves nothing; a release declaring 2 spends the last use (the
    owner hears it released and used up) and its replay is refused."""
    req = registry_pb2.GrantTransferRequest(
        worker=pair.prefill.id, request_id="open", open_uses=True,
        groups=[types_pb2.BlockGrant(transfer_group=0, block_ids=[2])],
    )  # fmt: skip
    resp = world.transport("prefill").grant_transfer(req, T)
    assert resp.open_uses
    spec = make_spec(
        world, "open", pair.decode, pair.prefill, [(0, [5], [2])], capability=resp.capability
    )
    spec.readers = 2
    run(world, "decode", spec)
    done = pair.events.next().transfer_finished
    assert (done.uses, done.max_uses, done.exhausted, done.released) == (1, 2, False, False)
    pair.decode.kv.zero_()
    spec.readers = 3
    assert _refused(world, pair, spec, FailedPrecondition) == (
        f"FAILED_PRECONDITION: remote daemon {spec.remote_target}: FAILED_PRECONDITION: "
        "capability for request open admits 2 readers; the caller declared 3"
    )
    release = transfers_pb2.TransferSpec(
        request_id="open", local_worker=pair.decode.id, remote_target=spec.remote_target,
        remote_worker=pair.prefill.id, capability=resp.capability, readers=2, release=True,
    )  # fmt: skip
    (status,) = run(world, "decode", release)
    assert (status.state, status.message) == (transfers_pb2.TRANSFER_STATE_DONE, "released")
    done = pair.events.next().transfer_finished
    assert (done.uses, done.max_uses, done.exhausted, done.released) == (2, 2, True, True)
    assert _refused(world, pair, release, PermissionDenied) == DENIED.format(t=spec.remote_target)


def test_revoked_and_expired_capabilities_are_refused(world: World, pair: Pair) -> None:
    """A revoked capability is refused like an unknown one; an expired one
    fails FAILED_PRECONDITION. Revoking is idempotent."""
    cap = grant(world, pair.prefill, "rev", {0: [1]}).capability
    revoke = registry_pb2.RevokeTransferRequest(worker=pair.prefill.id, request_id="rev")
    world.transport("prefill").revoke_transfer(revoke, T)
    world.transport("prefill").revoke_transfer(revoke, T)
    spec = make_spec(world, "rev", pair.decode, pair.prefill, [(0, [4], [1])], capability=cap)
    assert _refused(world, pair, spec, PermissionDenied) == DENIED.format(t=spec.remote_target)

    short = grant(world, pair.prefill, "exp", {0: [1]}, ttl_ms=1)
    # Wait for the wall clock to pass the expiry the daemon stated.
    wait_for(lambda: time.time_ns() // 1_000_000 > short.expires_unix_ms, "grant expiry")
    spec = make_spec(
        world, "exp", pair.decode, pair.prefill, [(0, [4], [1])], capability=short.capability
    )
    assert _refused(world, pair, spec, FailedPrecondition).startswith("FAILED_PRECONDITION: ")


# (grant request change, error, message)
GrantChange = Callable[[registry_pb2.GrantTransferRequest], None]


def _grant_set(**values: object) -> GrantChange:
    def change(req: registry_pb2.GrantTransferRequest) -> None:
        for key, value in values.items():
            if key == "block_ids":
                req.groups[0].block_ids.append(int(str(value)))
            elif key == "transfer_group":
                req.groups[0].transfer_group = int(str(value))
            elif key == "worker":
                req.worker.engine_id = str(value)
            else:
                setattr(req, key, value)

    return change


BAD_GRANTS: dict[str, tuple[GrantChange, type[KvmapError], str]] = {
    "no request id": (
        _grant_set(request_id=""),
        InvalidArgument,
        "INVALID_ARGUMENT: request_id: must not be empty",
    ),
    "long request id": (
        _grant_set(request_id="r" * 257),
        InvalidArgument,
        "INVALID_ARGUMENT: request_id: 257 characters; at most 256",
    ),
    "no groups": (
        lambda req: req.ClearField("groups"),
        InvalidArgument,
        "INVALID_ARGUMENT: groups: at least one transfer group is required",
    ),
    "unknown group": (
        _grant_set(transfer_group=3),
        InvalidArgument,
        "INVALID_ARGUMENT: groups[0].transfer_group: worker has no group 3",
    ),
    "block out of range": (
        _grant_set(block_ids=BLOCKS),
        InvalidArgument,
        f"INVALID_ARGUMENT: groups[0].block_ids[2]: block {BLOCKS} out of range [0, {BLOCKS})",
    ),
    "block twice": (
        _grant_set(block_ids=1),
        InvalidArgument,
        "INVALID_ARGUMENT: groups[0].block_ids: block ids must be distinct",
    ),
    "ttl over the maximum": (
        _grant_set(ttl_ms=3_600_001),
        InvalidArgument,
        "INVALID_ARGUMENT: ttl_ms: 3600001 ms; at most 3600000",
    ),
    "too many uses": (
        _grant_set(max_uses=65),
        InvalidArgument,
        "INVALID_ARGUMENT: max_uses: 65; at most 64",
    ),
    "unknown worker": (
        _grant_set(worker="nobody"),
        NotFound,
        "NOT_FOUND: worker nobody/dp0/tp0/pp0 is not registered",
    ),
}


@pytest.mark.parametrize("case", list(BAD_GRANTS))
def test_bad_grant_is_rejected_naming_the_field(world: World, pair: Pair, case: str) -> None:
    """A grant request the daemon cannot honour fails with the core's class
    and message and mints nothing."""
    change, error, message = BAD_GRANTS[case]
    req = registry_pb2.GrantTransferRequest(
        worker=pair.prefill.id,
        request_id="g",
        groups=[types_pb2.BlockGrant(transfer_group=0, block_ids=[1, 2])],
    )
    change(req)
    with pytest.raises(error) as raised:
        world.transport("prefill").grant_transfer(req, T)
    assert raised.value.message == message, raised.value.message


def test_grant_needs_an_attached_worker(world: World) -> None:
    """A worker with no Attach stream gets no capability (its blocks' pull
    could never be reported to it): FAILED_PRECONDITION."""
    p = world.register("prefill", "p")
    req = registry_pb2.GrantTransferRequest(
        worker=p.id, request_id="g", groups=[types_pb2.BlockGrant(block_ids=[1])]
    )
    with pytest.raises(FailedPrecondition) as raised:
        world.transport("prefill").grant_transfer(req, T)
    assert raised.value.message == f"FAILED_PRECONDITION: worker {p.name} has no Attach stream open"
