"""convert: proto <-> core, JSON, and what a peer's region map may not do."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from importlib import resources
from pathlib import Path

import pytest
from geometry_strategies import geometries
from google.protobuf import json_format
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from kvmap.core import convert
from kvmap.core.errors import InvalidArgument
from kvmap.core.geometry import (
    AllocationSpec,
    CacheKind,
    CudaIpcHandle,
    DeviceKind,
    DeviceRef,
    HeadLayout,
    NoHandle,
    PlacedAllocation,
    ShmFdHandle,
    ShmPathHandle,
    TokenLayout,
    ViewSpec,
    WorkerGeometry,
    WorkerKey,
)
from kvmap.core.planner import BASELINE, COALESCE, Planner
from kvmap.v1 import registry_pb2, types_pb2

EXAMPLES = Path(str(resources.files("kvmap.daemon.examples")))


def _request(**changes: object) -> registry_pb2.RegisterWorkerRequest:
    req = registry_pb2.RegisterWorkerRequest(
        worker=types_pb2.WorkerId(engine_id="e", dp_rank=1, tp_rank=1, pp_rank=0),
        kv_cache_layout="BLHNC",
        block_size_tokens=64,
        tp_size=2,
        allocations=[
            types_pb2.Allocation(
                id="kv",
                size_bytes=800,
                device=types_pb2.Device(type=types_pb2.DEVICE_TYPE_CUDA, index=3, uuid="GPU-1"),
                cuda_ipc=types_pb2.CudaIpcHandle(handle=b"x"),
            )
        ],
        views=[
            types_pb2.View(
                layer_name=f"l{i}",
                allocation_id="kv",
                transfer_group=0,
                cache_kind=types_pb2.CACHE_KIND_MLA,
                dtype="uint8",
                offset_bytes=100 * i,
                block_len_bytes=100,
                block_stride_bytes=200,
                num_blocks=4,
            )
            for i in range(2)
        ],
    )
    for name, value in changes.items():
        setattr(req, name, value)
    return req


def _invalid(call: Callable[[], object]) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as err:
        call()
    return err.value


# Registration --------------------------------------------------------------


def test_geometry_from_proto_copies_every_field() -> None:
    """A valid RegisterWorkerRequest converts to a WorkerGeometry carrying its worker key, layout,
    block size, tp size, allocations (with device) and views unchanged."""
    g = convert.parse_and_validate(_request())
    assert g.worker == WorkerKey("e", 1, 1, 0)
    assert (g.kv_cache_layout, g.block_size_tokens, g.tp_size) == ("BLHNC", 64, 2)
    assert g.allocations == (AllocationSpec("kv", 800, DeviceRef(DeviceKind.CUDA, 3, "GPU-1")),)
    assert g.views[1] == ViewSpec("l1", "kv", 0, CacheKind.MLA, "uint8", 100, 100, 200, 4)


def test_each_handle_is_kept_and_takes_no_part_in_equality() -> None:
    """Each allocation handle of a request (shm_fd, shm_path, cuda_ipc, none, or none set) is
    read into the allocation's domain handle with every field; two registrations of one layout
    over other handles (a memfd's token is new each time) are still equal geometries."""
    cases = {
        "shm_fd": types_pb2.Allocation(
            shm_fd=types_pb2.ShmFdHandle(token="t", index=2, offset_bytes=8)
        ),
        "shm_path": types_pb2.Allocation(
            shm_path=types_pb2.ShmPathHandle(path="/dev/shm/k", offset_bytes=4)
        ),
        "cuda_ipc": types_pb2.Allocation(
            cuda_ipc=types_pb2.CudaIpcHandle(handle=b"h", offset_bytes=16, block_size_bytes=4096)
        ),
        "none": types_pb2.Allocation(none=types_pb2.NoHandle()),
        "unset": types_pb2.Allocation(),
    }
    want = {
        "shm_fd": ShmFdHandle("t", 2, 8),
        "shm_path": ShmPathHandle("/dev/shm/k", 4),
        "cuda_ipc": CudaIpcHandle(b"h", 16, 4096),
        "none": NoHandle(),
        "unset": None,
    }
    for name, allocation in cases.items():
        allocation.id, allocation.size_bytes = "kv", 800
        req = _request()
        req.allocations[0].CopyFrom(allocation)
        (got,) = convert.geometry_from_proto(req).allocations
        assert got.handle == want[name], name
    other = _request()
    other.allocations[0].cuda_ipc.handle = b"another block"
    assert convert.geometry_from_proto(other) == convert.geometry_from_proto(_request())


@settings(max_examples=examples(100), deadline=None)
@given(geometries(), st.data())
def test_a_registration_written_for_the_store_reads_back_exactly(
    g: WorkerGeometry, data: st.DataObject
) -> None:
    """For random geometries, each allocation with a handle its device allows, a head layout or
    none and any TP size: ``geometry_to_proto``, serialised and read back, is the same geometry
    with the same handles, and a valid one stays valid (how the state store keeps a worker)."""
    handles = {
        DeviceKind.CPU: st.sampled_from([ShmFdHandle("tok", 1, 64), ShmPathHandle("/dev/shm/x")]),
        DeviceKind.CUDA: st.just(CudaIpcHandle(b"\x01" * 64, 128, 1 << 20)),
    }
    allocations = tuple(replace(a, handle=data.draw(handles[a.device.kind])) for a in g.allocations)
    heads = data.draw(st.sampled_from([None, HeadLayout(8, 64, 128, TokenLayout.HEADS_OUTER)]))
    g = replace(
        g, allocations=allocations, tp_size=data.draw(st.sampled_from([1, 2, 8])), heads=heads
    )
    wire = registry_pb2.RegisterWorkerRequest.FromString(
        convert.geometry_to_proto(g).SerializeToString()
    )
    back = convert.geometry_from_proto(wire)
    assert back == g
    assert [a.handle for a in back.allocations] == [a.handle for a in g.allocations]


def test_tp_size_zero_means_one() -> None:
    """An unset (zero) tp_size in a request is read as tp_size 1."""
    req = _request(tp_size=0)
    req.worker.tp_rank = 0
    assert convert.geometry_from_proto(req).tp_size == 1


def test_missing_worker_is_named() -> None:
    """A request without a worker id is INVALID_ARGUMENT on the "worker" field."""
    req = _request()
    req.ClearField("worker")
    assert _invalid(lambda: convert.geometry_from_proto(req)).field == "worker"


@pytest.mark.parametrize(
    ("number", "problem"),
    [(0, "must be set (one of CACHE_KIND_MLA, "), (42, "unknown cache kind 42")],
)
def test_cache_kind_must_be_known(number: int, problem: str) -> None:
    """A view with an unset or unknown cache kind is INVALID_ARGUMENT on that view's cache_kind,
    saying which."""
    req = _request()
    req.views[1].cache_kind = number  # type: ignore[assignment]
    err = _invalid(lambda: convert.geometry_from_proto(req))
    assert err.field == "views[1].cache_kind" and err.problem.startswith(problem)


@pytest.mark.parametrize(
    ("handle", "kind"),
    [("cuda_ipc", DeviceKind.CUDA), ("shm_path", DeviceKind.CPU), ("none", DeviceKind.CPU)],
)
def test_unspecified_device_type_follows_the_handle(handle: str, kind: DeviceKind) -> None:
    """An allocation with no device type gets CUDA for a cuda_ipc handle and CPU for shared memory
    or no handle."""
    allocation = types_pb2.Allocation(id="kv", size_bytes=800)
    getattr(allocation, handle).SetInParent()
    req = _request()
    del req.allocations[:]
    req.allocations.append(allocation)
    assert convert.geometry_from_proto(req).allocations[0].device.kind is kind


def test_device_type_contradicting_the_handle_or_unknown_is_rejected() -> None:
    """A CPU device type on a cuda_ipc allocation, or an unknown device type number, is
    INVALID_ARGUMENT on allocations[i].device.type."""
    req = _request()
    req.allocations[0].device.type = types_pb2.DEVICE_TYPE_CPU
    err = _invalid(lambda: convert.geometry_from_proto(req))
    assert err.field == "allocations[0].device.type" and "cuda_ipc" in err.problem
    req.allocations[0].device.type = 9  # type: ignore[assignment]
    err = _invalid(lambda: convert.geometry_from_proto(req))
    assert (err.field, err.problem) == ("allocations[0].device.type", "unknown device type 9")


def test_parse_and_validate_prefixes_field_paths() -> None:
    """Validation errors from parse_and_validate carry the caller's field prefix in both the field
    and the message."""
    req = _request()
    req.views[0].num_blocks = 0
    err = _invalid(lambda: convert.parse_and_validate(req, field_prefix="spec."))
    assert err.field == "spec.views[0].num_blocks"
    assert str(err) == "spec.views[0].num_blocks: must be > 0 (got 0)"


def test_geometry_from_json_accepts_proto3_json() -> None:
    """The proto3 JSON form of a request converts to the same geometry as the message itself."""
    text = json_format.MessageToJson(_request())
    assert convert.geometry_from_json(text) == convert.geometry_from_proto(_request())


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("{", "invalid RegisterWorkerRequest JSON"),
        ('{"workr": {}}', "workr"),
        ('{"views": [{"cache_kind": "CACHE_KIND_NOPE"}]}', "CACHE_KIND_NOPE"),
        ('{"block_size_tokens": "many"}', "block_size_tokens"),
    ],
)
def test_json_errors_carry_the_parsers_message(text: str, fragment: str) -> None:
    """Malformed JSON, unknown fields, unknown enum names and wrongly typed values are
    INVALID_ARGUMENT quoting the parser's complaint."""
    err = _invalid(lambda: convert.geometry_from_json(text))
    assert "invalid RegisterWorkerRequest JSON" in err.problem and fragment in err.problem


# Region maps ---------------------------------------------------------------


def _model_proto() -> types_pb2.RegionMap:
    g = convert.geometry_from_json((EXAMPLES / "glm-tiny.json").read_text())
    model = convert.model_from_plan(g, COALESCE.plan(g), 7, {"kv-mla": 1 << 40})
    return convert.region_map_to_proto(model)


def test_model_from_plan_fills_the_map() -> None:
    """model_from_plan records generation, planner, view and descriptor counts (coalesced and
    baseline) and base addresses (0 when unknown), and the proto form keeps full_row and layer
    names."""
    g = convert.geometry_from_json((EXAMPLES / "glm-tiny.json").read_text())
    plan = COALESCE.plan(g)
    model = convert.model_from_plan(g, plan, 7, {"kv-mla": 4096})
    assert (model.generation, model.planner, model.view_count) == (7, plan.planner, 6)
    assert model.allocations[0] == PlacedAllocation("kv-mla", 2_686_976, DeviceRef(), 4096)
    assert model.allocations[1].base_address == 0
    assert (model.descriptor_count, model.baseline_descriptor_count) == (128, 384)
    msg = convert.region_map_to_proto(model)
    assert (msg.descriptor_count, msg.regions[0].full_row) == (128, True)
    assert list(msg.regions[0].layer_names) == [p.layer_name for p in model.regions[0].layers]


@settings(max_examples=examples(100), deadline=None)
@given(geometries(), st.integers(0, 2**64 - 1), st.sampled_from([BASELINE, COALESCE]))
def test_region_map_round_trip_is_exact(
    g: WorkerGeometry, generation: int, planner: Planner
) -> None:
    """For random geometries and either planner, a region map survives conversion to proto,
    serialisation and conversion back unchanged."""
    addresses = {a.id: 4096 * (i + 1) for i, a in enumerate(g.allocations)}
    model = convert.model_from_plan(g, planner.plan(g), generation, addresses)
    msg = convert.region_map_to_proto(model)
    assert convert.region_map_from_proto(msg) == model
    wire = types_pb2.RegionMap.FromString(msg.SerializeToString())
    assert convert.region_map_from_proto(wire) == model


def _tampered(edit: Callable[[types_pb2.RegionMap], object]) -> InvalidArgument:
    msg = _model_proto()
    edit(msg)
    return _invalid(lambda: convert.region_map_from_proto(msg))


def _rename_into_region_0(m: types_pb2.RegionMap) -> None:
    name = m.regions[0].layer_names[2]
    m.regions[1].layers[1].layer_name = m.regions[1].layer_names[1] = name


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda m: m.ClearField("worker"), "worker.engine_id"),
        (lambda m: m.ClearField("planner"), "planner.name"),
        (lambda m: setattr(m.regions[1], "id", 5), "regions[1].id"),
        (lambda m: setattr(m.regions[0], "allocation_id", "x"), "regions[0].allocation_id"),
        (lambda m: setattr(m.regions[0], "num_blocks", 65), "regions[0]"),
        (lambda m: setattr(m.regions[0], "num_blocks", 0), "regions[0].num_blocks"),
        (lambda m: setattr(m.regions[0], "offset_bytes", -1), "regions[0].offset_bytes"),
        (lambda m: setattr(m.regions[0], "block_stride_bytes", 1), "regions[0].block_stride_bytes"),
        (lambda m: setattr(m.regions[0], "full_row", False), "regions[0].full_row"),
        (lambda m: m.regions[0].ClearField("layers"), "regions[0].layers"),
        (lambda m: m.regions[0].layer_names.append("x"), "regions[0].layer_names"),
        (lambda m: setattr(m.regions[0].layers[3], "len_bytes", 10_497), "regions[0].layers[3]"),
        (
            lambda m: setattr(m.regions[0].layers[0], "cache_kind", 0),
            "regions[0].layers[0].cache_kind",
        ),
        (lambda m: setattr(m, "descriptor_count", 1), "descriptor_count"),
        (_rename_into_region_0, "regions[1].layers[1].layer_name"),
        (lambda m: setattr(m.allocations[1], "id", "kv-mla"), "allocations[1].id"),
        (lambda m: setattr(m.allocations[0], "size_bytes", 0), "allocations[0].size_bytes"),
        (lambda m: setattr(m.allocations[0].device, "type", 0), "allocations[0].device.type"),
        (
            lambda m: setattr(m.allocations[0], "base_address", 2**64 - 1),
            "allocations[0].base_address",
        ),
    ],
)
def test_a_tampered_region_map_is_rejected(
    edit: Callable[[types_pb2.RegionMap], object], field: str
) -> None:
    """A peer's region map with any one inconsistency (missing ids, bad counts, overruns, duplicate
    names or ids, wrong descriptor count, bad device or address) is INVALID_ARGUMENT naming the
    offending field."""
    assert _tampered(edit).field == field


_INT_FIELDS = [
    ("regions", "offset_bytes"),
    ("regions", "block_len_bytes"),
    ("regions", "block_stride_bytes"),
    ("regions", "num_blocks"),
    ("layers", "offset_in_region_bytes"),
    ("layers", "len_bytes"),
    ("allocations", "size_bytes"),
]


@settings(max_examples=examples(200), deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(_INT_FIELDS),
            st.integers(0, 5),
            st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(-3, 1 << 20)),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_a_corrupted_region_map_never_crashes(
    edits: list[tuple[tuple[str, str], int, int]],
) -> None:
    """Random integer corruptions of a region map either raise INVALID_ARGUMENT or yield a map whose
    regions and layers fit their allocations and blocks; nothing else escapes."""
    msg = _model_proto()
    for (container, name), index, value in edits:
        items = msg.regions[0].layers if container == "layers" else getattr(msg, container)
        setattr(items[index % len(items)], name, value)
    try:
        model = convert.region_map_from_proto(msg)
    except InvalidArgument:
        return
    for r in model.regions:  # whatever got through is internally consistent
        size = model.allocation(r.allocation_id).size_bytes
        assert (
            r.offset_bytes + (r.num_blocks - 1) * r.block_stride_bytes + r.block_len_bytes <= size
        )
        assert all(p.offset_in_region + p.len_bytes <= r.block_len_bytes for p in r.layers)
