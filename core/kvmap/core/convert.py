"""The only place that converts between the wire messages and the core model.

Decisions a caller should know:

- ``DEVICE_TYPE_UNSPECIFIED`` is taken from the allocation's handle: a
  ``cuda_ipc`` handle means CUDA, anything else (shared memory, ``none``, no
  handle) means CPU. An explicit type that contradicts the handle (CPU with
  ``cuda_ipc``, CUDA with shared memory) is rejected.
- ``CACHE_KIND_UNSPECIFIED`` and enum numbers this version does not know are
  rejected: guessing a cache kind would decide whether layers get coalesced.
- ``tp_size`` 0 means 1, as the proto says.
- ``geometry_from_proto`` converts only; ``parse_and_validate`` also applies
  ``validation.validate_geometry``.
- ``region_map_from_proto`` reads a map a peer sent, so it checks everything a
  consumer indexes or adds up: region ids are their positions (0..n-1),
  regions lie inside known allocations, layers inside their region's block,
  and the derived fields (``full_row``, ``layer_names``, ``descriptor_count``)
  agree with the rest.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvmap.core.errors import InvalidArgument
from kvmap.core.geometry import (
    AllocationHandle,
    AllocationSpec,
    CacheKind,
    CudaIpcHandle,
    DeviceKind,
    DeviceRef,
    LayerPlacement,
    ModelIdentity,
    NoHandle,
    PlacedAllocation,
    Plan,
    PlannerInfo,
    Region,
    RegionMapModel,
    ShmFdHandle,
    ShmPathHandle,
    ViewSpec,
    WorkerGeometry,
    WorkerKey,
)
from kvmap.core.head_layout import head_layout_from_proto, head_layout_to_proto
from kvmap.core.validation import (
    MAX_ALLOCATIONS,
    MAX_BLOCKS,
    MAX_DESCRIPTORS,
    MAX_VALUE,
    MAX_VIEWS,
    validate_geometry,
)
from kvmap.v1 import registry_pb2, types_pb2

# Worker geometry (registration) ------------------------------------------------


def geometry_from_proto(req: registry_pb2.RegisterWorkerRequest) -> WorkerGeometry:
    """Convert a registration; does not validate it (see ``parse_and_validate``)."""
    if not req.HasField("worker"):
        raise InvalidArgument("worker", "must be set")
    return WorkerGeometry(
        worker=worker_key_from_proto(req.worker),
        kv_cache_layout=req.kv_cache_layout,
        block_size_tokens=req.block_size_tokens,
        allocations=tuple(
            _allocation_from_proto(f"allocations[{i}]", a) for i, a in enumerate(req.allocations)
        ),
        views=tuple(_view_from_proto(f"views[{i}]", v) for i, v in enumerate(req.views)),
        tp_size=req.tp_size or 1,
        model=model_identity_from_proto(req.model),
        heads=head_layout_from_proto(
            "head_layout", req.head_layout, req.HasField("head_layout"), req.tp_size or 1
        ),
    )


def model_identity_from_proto(msg: types_pb2.ModelIdentity) -> ModelIdentity:
    return ModelIdentity(
        name=msg.name,
        revision=msg.revision,
        dtype=msg.dtype,
        kv_cache_dtype=msg.kv_cache_dtype,
        config_digest=msg.config_digest,
    )


def model_identity_to_proto(model: ModelIdentity) -> types_pb2.ModelIdentity:
    return types_pb2.ModelIdentity(
        name=model.name,
        revision=model.revision,
        dtype=model.dtype,
        kv_cache_dtype=model.kv_cache_dtype,
        config_digest=model.config_digest,
    )


def parse_and_validate(
    req: registry_pb2.RegisterWorkerRequest, field_prefix: str = ""
) -> WorkerGeometry:
    """Convert and validate a registration. ``field_prefix`` (e.g. ``"spec."``)
    is put in front of the field path of any error, for requests that embed one."""
    try:
        geometry = geometry_from_proto(req)
        validate_geometry(geometry)
    except InvalidArgument as err:
        if not field_prefix:
            raise
        field = field_prefix + err.field if err.field else field_prefix.rstrip(".")
        raise InvalidArgument(field, err.problem) from None
    return geometry


def geometry_from_json(text: str) -> WorkerGeometry:
    """Convert the proto3 JSON of a ``RegisterWorkerRequest``; does not validate."""
    # Imported here: ~17 ms that every daemon's start would pay for a
    # function only the CLI and the tools call.
    from google.protobuf import json_format  # noqa: PLC0415 - see above

    req = registry_pb2.RegisterWorkerRequest()
    try:
        json_format.Parse(text, req)
    except json_format.ParseError as err:
        raise InvalidArgument("", f"invalid RegisterWorkerRequest JSON: {err}") from None
    return geometry_from_proto(req)


def worker_key_from_proto(msg: types_pb2.WorkerId) -> WorkerKey:
    return WorkerKey(msg.engine_id, msg.dp_rank, msg.tp_rank, msg.pp_rank)


def requested_worker(msg: types_pb2.WorkerId, field: str) -> WorkerKey:
    """The worker a request names; ``field`` is its path for the error."""
    if not msg.engine_id:
        raise InvalidArgument(f"{field}.engine_id", "must not be empty")
    return worker_key_from_proto(msg)


def check_requested(key: WorkerKey, field: str) -> WorkerKey:
    """``requested_worker`` for a key already read off the wire."""
    if not key.engine_id:
        raise InvalidArgument(f"{field}.engine_id", "must not be empty")
    return key


def worker_id_to_proto(key: WorkerKey) -> types_pb2.WorkerId:
    return types_pb2.WorkerId(
        engine_id=key.engine_id, dp_rank=key.dp_rank, tp_rank=key.tp_rank, pp_rank=key.pp_rank
    )


def planner_info_to_proto(info: PlannerInfo) -> types_pb2.PlannerInfo:
    return types_pb2.PlannerInfo(name=info.name, version=info.version)


def _allocation_from_proto(at: str, a: types_pb2.Allocation) -> AllocationSpec:
    handle = a.WhichOneof("handle")
    kind_number = int(a.device.type)
    if kind_number == types_pb2.DEVICE_TYPE_UNSPECIFIED:
        kind = DeviceKind.CUDA if handle == "cuda_ipc" else DeviceKind.CPU
    else:
        kind = _device_kind(f"{at}.device.type", kind_number)
    if (kind is DeviceKind.CPU and handle == "cuda_ipc") or (
        kind is DeviceKind.CUDA and handle in ("shm_fd", "shm_path")
    ):
        raise InvalidArgument(
            f"{at}.device.type", f"device type {kind.name} contradicts the {handle} handle"
        )
    device = DeviceRef(kind=kind, index=a.device.index, uuid=a.device.uuid)
    return AllocationSpec(
        id=a.id, size_bytes=a.size_bytes, device=device, handle=_handle_from_proto(a)
    )


def _handle_from_proto(a: types_pb2.Allocation) -> AllocationHandle | None:
    which = a.WhichOneof("handle")
    if which == "shm_fd":
        return ShmFdHandle(a.shm_fd.token, a.shm_fd.index, a.shm_fd.offset_bytes)
    if which == "shm_path":
        return ShmPathHandle(a.shm_path.path, a.shm_path.offset_bytes)
    if which == "cuda_ipc":
        ipc = a.cuda_ipc
        return CudaIpcHandle(ipc.handle, ipc.offset_bytes, ipc.block_size_bytes)
    if which == "none":
        return NoHandle()
    return None


def geometry_to_proto(geometry: WorkerGeometry) -> registry_pb2.RegisterWorkerRequest:
    """The registration that ``geometry_from_proto`` reads back as
    ``geometry`` (its handles included): how the state store keeps a
    worker. Device types and ``tp_size`` are written out, never left for
    the reader to infer."""
    return registry_pb2.RegisterWorkerRequest(
        worker=worker_id_to_proto(geometry.worker),
        kv_cache_layout=geometry.kv_cache_layout,
        block_size_tokens=geometry.block_size_tokens,
        allocations=[_allocation_to_proto(a) for a in geometry.allocations],
        views=[_view_to_proto(v) for v in geometry.views],
        tp_size=geometry.tp_size,
        model=model_identity_to_proto(geometry.model),
        head_layout=(
            head_layout_to_proto(geometry.heads, geometry.tp_size) if geometry.heads else None
        ),
    )


def _allocation_to_proto(a: AllocationSpec) -> types_pb2.Allocation:
    msg = types_pb2.Allocation(
        id=a.id,
        size_bytes=a.size_bytes,
        device=types_pb2.Device(
            type=types_pb2.DeviceType.ValueType(a.device.kind),
            index=a.device.index,
            uuid=a.device.uuid,
        ),
    )
    h = a.handle
    # Present even when every field is zero: the oneof says which handle.
    if isinstance(h, ShmFdHandle):
        msg.shm_fd.SetInParent()
        msg.shm_fd.MergeFrom(
            types_pb2.ShmFdHandle(token=h.token, index=h.index, offset_bytes=h.offset_bytes)
        )
    elif isinstance(h, ShmPathHandle):
        msg.shm_path.SetInParent()
        msg.shm_path.MergeFrom(types_pb2.ShmPathHandle(path=h.path, offset_bytes=h.offset_bytes))
    elif isinstance(h, CudaIpcHandle):
        msg.cuda_ipc.SetInParent()
        msg.cuda_ipc.MergeFrom(
            types_pb2.CudaIpcHandle(
                handle=h.handle, offset_bytes=h.offset_bytes, block_size_bytes=h.block_size_bytes
            )
        )
    elif isinstance(h, NoHandle):
        msg.none.SetInParent()
    return msg


def _view_to_proto(v: ViewSpec) -> types_pb2.View:
    return types_pb2.View(
        layer_name=v.layer_name,
        allocation_id=v.allocation_id,
        transfer_group=v.transfer_group,
        cache_kind=types_pb2.CacheKind.ValueType(v.cache_kind),
        dtype=v.dtype,
        offset_bytes=v.offset_bytes,
        block_len_bytes=v.block_len_bytes,
        block_stride_bytes=v.block_stride_bytes,
        num_blocks=v.num_blocks,
    )


def _device_kind(field: str, number: int) -> DeviceKind:
    try:
        return DeviceKind(number)
    except ValueError:
        raise InvalidArgument(field, f"unknown device type {number}") from None


def _cache_kind(field: str, number: int) -> CacheKind:
    if number == types_pb2.CACHE_KIND_UNSPECIFIED:
        known = ", ".join(f"CACHE_KIND_{k.name}" for k in CacheKind)
        raise InvalidArgument(field, f"must be set (one of {known})")
    try:
        return CacheKind(number)
    except ValueError:
        raise InvalidArgument(field, f"unknown cache kind {number}") from None


def _view_from_proto(at: str, v: types_pb2.View) -> ViewSpec:
    return ViewSpec(
        layer_name=v.layer_name,
        allocation_id=v.allocation_id,
        transfer_group=v.transfer_group,
        cache_kind=_cache_kind(f"{at}.cache_kind", int(v.cache_kind)),
        dtype=v.dtype,
        offset_bytes=v.offset_bytes,
        block_len_bytes=v.block_len_bytes,
        block_stride_bytes=v.block_stride_bytes,
        num_blocks=v.num_blocks,
    )


# Region maps ---------------------------------------------------------------


def model_from_plan(
    geometry: WorkerGeometry, plan: Plan, generation: int, base_addresses: Mapping[str, int]
) -> RegionMapModel:
    """The region map of a planned worker. Allocations missing from
    ``base_addresses`` get address 0 (plan previews pass ``{}``)."""
    return RegionMapModel(
        worker=geometry.worker,
        generation=generation,
        planner=plan.planner,
        regions=plan.regions,
        allocations=tuple(
            PlacedAllocation(a.id, a.size_bytes, a.device, base_addresses.get(a.id, 0))
            for a in geometry.allocations
        ),
        kv_cache_layout=geometry.kv_cache_layout,
        block_size_tokens=geometry.block_size_tokens,
        tp_size=geometry.tp_size,
        baseline_descriptor_count=plan.baseline_descriptor_count,
        view_count=len(geometry.views),
        model=geometry.model,
        heads=geometry.heads,
    )


def region_map_to_proto(model: RegionMapModel) -> types_pb2.RegionMap:
    return types_pb2.RegionMap(
        worker=worker_id_to_proto(model.worker),
        generation=model.generation,
        planner=planner_info_to_proto(model.planner),
        regions=[_region_to_proto(r) for r in model.regions],
        descriptor_count=model.descriptor_count,
        baseline_descriptor_count=model.baseline_descriptor_count,
        allocations=[
            types_pb2.AllocationInfo(
                id=a.id,
                size_bytes=a.size_bytes,
                device=types_pb2.Device(
                    type=types_pb2.DeviceType.ValueType(a.device.kind),
                    index=a.device.index,
                    uuid=a.device.uuid,
                ),
                base_address=a.base_address,
            )
            for a in model.allocations
        ],
        kv_cache_layout=model.kv_cache_layout,
        block_size_tokens=model.block_size_tokens,
        tp_size=model.tp_size,
        view_count=model.view_count,
        model=model_identity_to_proto(model.model),
        head_layout=head_layout_to_proto(model.heads, model.tp_size) if model.heads else None,
    )


def region_map_bytes(model: RegionMapModel) -> int:
    """The size of ``model``'s wire form (``MAX_REGION_MAP_BYTES`` bounds it)."""
    return region_map_to_proto(model).ByteSize()


def _region_to_proto(r: Region) -> types_pb2.Region:
    return types_pb2.Region(
        id=r.id,
        allocation_id=r.allocation_id,
        transfer_group=r.transfer_group,
        offset_bytes=r.offset_bytes,
        block_len_bytes=r.block_len_bytes,
        block_stride_bytes=r.block_stride_bytes,
        num_blocks=r.num_blocks,
        layer_names=list(r.layer_names),
        full_row=r.full_row,
        fallback_reason=r.fallback_reason,
        layers=[
            types_pb2.LayerSpan(
                layer_name=p.layer_name,
                offset_in_region_bytes=p.offset_in_region,
                len_bytes=p.len_bytes,
                cache_kind=types_pb2.CacheKind.ValueType(p.cache_kind),
                dtype=p.dtype,
            )
            for p in r.layers
        ],
    )


def region_map_from_proto(msg: types_pb2.RegionMap) -> RegionMapModel:
    """Read a region map, typically a peer's; rejects anything inconsistent."""
    if not msg.HasField("worker") or not msg.worker.engine_id:
        raise InvalidArgument("worker.engine_id", "must not be empty")
    if not msg.HasField("planner") or not msg.planner.name:
        raise InvalidArgument("planner.name", "must not be empty")
    _check_at_most("allocations", len(msg.allocations), MAX_ALLOCATIONS, "MAX_ALLOCATIONS")
    _check_at_most("regions", len(msg.regions), MAX_VIEWS, "MAX_VIEWS")
    allocations: dict[str, PlacedAllocation] = {}
    for i, a in enumerate(msg.allocations):
        placed = _placed_allocation_from_proto(f"allocations[{i}]", a)
        if placed.id in allocations:
            raise InvalidArgument(f"allocations[{i}].id", f"duplicate allocation id {a.id!r}")
        allocations[placed.id] = placed
    regions = tuple(
        _region_from_proto(f"regions[{i}]", i, r, allocations) for i, r in enumerate(msg.regions)
    )
    descriptors = sum(r.descriptor_count for r in regions)
    _check_at_most("descriptor_count", descriptors, MAX_DESCRIPTORS, "MAX_DESCRIPTORS")
    if msg.descriptor_count != descriptors:
        raise InvalidArgument(
            "descriptor_count",
            f"must equal the sum of the regions' num_blocks ({msg.descriptor_count} != "
            f"{descriptors})",
        )
    _check_at_most("regions", sum(len(r.layers) for r in regions), MAX_VIEWS, "MAX_VIEWS layers")
    _check_unique_layer_names(regions)
    return RegionMapModel(
        worker=worker_key_from_proto(msg.worker),
        generation=msg.generation,
        planner=PlannerInfo(name=msg.planner.name, version=msg.planner.version),
        regions=regions,
        allocations=tuple(allocations.values()),
        kv_cache_layout=msg.kv_cache_layout,
        block_size_tokens=_in_range("block_size_tokens", msg.block_size_tokens, 0),
        tp_size=msg.tp_size or 1,
        baseline_descriptor_count=_in_range(
            "baseline_descriptor_count", msg.baseline_descriptor_count, 0
        ),
        view_count=msg.view_count,
        model=model_identity_from_proto(msg.model),
        heads=head_layout_from_proto(
            "head_layout", msg.head_layout, msg.HasField("head_layout"), msg.tp_size or 1
        ),
    )


def _check_unique_layer_names(regions: tuple[Region, ...]) -> None:
    # A layer in two regions would make "where is layer X" ambiguous for the
    # transfer planner; aliases are distinct names at the same offset.
    seen: set[str] = set()
    for i, r in enumerate(regions):
        for j, p in enumerate(r.layers):
            if p.layer_name in seen:
                raise InvalidArgument(
                    f"regions[{i}].layers[{j}].layer_name",
                    f"duplicate layer name {p.layer_name!r}",
                )
            seen.add(p.layer_name)


def _in_range(field: str, value: int, minimum: int) -> int:
    if not minimum <= value <= MAX_VALUE:
        raise InvalidArgument(field, f"must be in [{minimum}, 2**62] (got {value})")
    return value


def _check_at_most(field: str, count: int, limit: int, limit_name: str) -> None:
    if count > limit:
        raise InvalidArgument(field, f"too many ({count} > {limit_name} = {limit})")


def _placed_allocation_from_proto(at: str, a: types_pb2.AllocationInfo) -> PlacedAllocation:
    if not a.id:
        raise InvalidArgument(f"{at}.id", "must not be empty")
    size = _in_range(f"{at}.size_bytes", a.size_bytes, 1)
    kind = _device_kind(f"{at}.device.type", int(a.device.type))
    if a.base_address + size > 1 << 64:
        raise InvalidArgument(f"{at}.base_address", "allocation would end past 2**64")
    device = DeviceRef(kind, a.device.index, a.device.uuid)
    return PlacedAllocation(a.id, size, device, a.base_address)


def _region_from_proto(
    at: str, index: int, r: types_pb2.Region, allocations: Mapping[str, PlacedAllocation]
) -> Region:
    if r.id != index:
        raise InvalidArgument(f"{at}.id", f"must equal the region's position ({r.id} != {index})")
    allocation = allocations.get(r.allocation_id)
    if allocation is None:
        raise InvalidArgument(f"{at}.allocation_id", f"unknown allocation {r.allocation_id!r}")
    offset = _in_range(f"{at}.offset_bytes", r.offset_bytes, 0)
    length = _in_range(f"{at}.block_len_bytes", r.block_len_bytes, 1)
    stride = _in_range(f"{at}.block_stride_bytes", r.block_stride_bytes, length)
    blocks = _in_range(f"{at}.num_blocks", r.num_blocks, 1)
    if blocks > MAX_BLOCKS:
        raise InvalidArgument(f"{at}.num_blocks", f"too many ({blocks} > MAX_BLOCKS)")
    end = offset + (blocks - 1) * stride + length
    if end > allocation.size_bytes:
        raise InvalidArgument(
            at, f"ends at byte {end}, past allocation {r.allocation_id!r} ({allocation.size_bytes})"
        )
    if r.full_row != (length == stride):
        raise InvalidArgument(f"{at}.full_row", "must be true exactly when len equals stride")
    if not r.layers:
        raise InvalidArgument(f"{at}.layers", "must not be empty")
    layers = tuple(
        _layer_from_proto(f"{at}.layers[{j}]", p, length) for j, p in enumerate(r.layers)
    )
    if list(r.layer_names) != [p.layer_name for p in layers]:
        raise InvalidArgument(f"{at}.layer_names", "must list the names of layers, in order")
    return Region(
        id=index,
        allocation_id=r.allocation_id,
        transfer_group=r.transfer_group,
        offset_bytes=offset,
        block_len_bytes=length,
        block_stride_bytes=stride,
        num_blocks=blocks,
        layers=layers,
        fallback_reason=r.fallback_reason,
    )


def _layer_from_proto(at: str, p: types_pb2.LayerSpan, region_len: int) -> LayerPlacement:
    if not p.layer_name:
        raise InvalidArgument(f"{at}.layer_name", "must not be empty")
    offset = _in_range(f"{at}.offset_in_region_bytes", p.offset_in_region_bytes, 0)
    length = _in_range(f"{at}.len_bytes", p.len_bytes, 1)
    if offset + length > region_len:
        raise InvalidArgument(
            at, f"ends at byte {offset + length} of a {region_len}-byte region block"
        )
    return LayerPlacement(
        layer_name=p.layer_name,
        offset_in_region=offset,
        len_bytes=length,
        cache_kind=_cache_kind(f"{at}.cache_kind", int(p.cache_kind)),
        dtype=p.dtype,
    )
