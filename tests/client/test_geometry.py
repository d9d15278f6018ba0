"""Geometry extraction: layer tensors -> views, for the layouts vLLM uses."""

from __future__ import annotations

import mmap

import pytest
import torch
from inproc_daemon import InprocNetwork

from kvmap.client.geometry import (
    BlockView,
    GeometryError,
    LayerSpec,
    block_views,
    build_registration,
    export_registration,
)
from kvmap.client.memory_export import ExportedMemory
from kvmap.v1 import types_pb2

MHA = types_pb2.CACHE_KIND_MHA
MLA = types_pb2.CACHE_KIND_MLA


def views_of(t: torch.Tensor, num_blocks: int, page: int = 0) -> list[BlockView]:
    return block_views(
        t.shape,
        t.stride(),
        element_size=t.element_size(),
        storage_offset=t.storage_offset(),
        num_blocks=num_blocks,
        page_size_bytes=page,
    )


def test_layer_outermost_cpu_layout_one_view_per_layer() -> None:
    """A layer-outermost (LBHNC) layer tensor becomes one view whose block length and stride are one
    page, at that layer's byte offset in the shared storage."""
    # vLLM CPU attention, LBHNC: each layer a contiguous [blocks, heads, bs, 2*hd] run.
    nb, heads, bs, hd2 = 16, 2, 32, 128
    storage = torch.zeros(2 * nb * heads * bs * hd2, dtype=torch.float32)
    layers = [
        storage[i * nb * heads * bs * hd2 :].view(-1)[: nb * heads * bs * hd2] for i in (0, 1)
    ]
    page = heads * bs * hd2 * 4
    for i, flat in enumerate(layers):
        t = flat.view(nb, heads, bs, hd2)
        assert views_of(t, nb) == [BlockView("", i * nb * page, page, page, nb)]


def test_block_outermost_cross_layer_views_share_rows() -> None:
    """In a block-outermost (BLHNC) storage each layer's slice becomes one view at the layer's
    offset in the row, with the whole row as its block stride."""
    # BLHNC: one [blocks, layers, page] storage; layer l is rows[:, l].
    nb, layers, page_elems = 10, 3, 656
    rows = torch.zeros(nb, layers, page_elems, dtype=torch.uint8)
    for layer in range(layers):
        (v,) = views_of(rows[:, layer], nb)
        assert v == BlockView("", layer * page_elems, page_elems, layers * page_elems, nb)


def test_kv_split_leading_dim_gives_one_view_per_half() -> None:
    """A tensor with a leading K/V dimension of 2 yields two views, suffixed [0] and [1], the second
    starting after all blocks of the first."""
    # FlashAttention-style [2, blocks, bs, heads, hd]: K and V are apart.
    nb, bs, heads, hd = 8, 16, 2, 4
    t = torch.zeros(2, nb, bs, heads, hd, dtype=torch.float16)
    page = bs * heads * hd * 2
    assert views_of(t, nb) == [
        BlockView("[0]", 0, page, page, nb),
        BlockView("[1]", nb * page, page, page, nb),
    ]


def test_physically_permuted_block_is_still_one_page() -> None:
    """A logical view over a physically permuted block (HND stored, NHD viewed) is still one view
    with one page per block."""
    # Logical [blocks, bs, heads, hd] over a physical [blocks, heads, bs, hd] (HND).
    nb, bs, heads, hd = 6, 16, 4, 8
    phys = torch.zeros(nb, heads, bs, hd)
    t = phys.permute(0, 2, 1, 3)
    (v,) = views_of(t, nb)
    assert (v.block_len_bytes, v.block_stride_bytes) == (bs * heads * hd * 4, bs * heads * hd * 4)


def test_block_that_is_not_one_page_is_refused() -> None:
    """A tensor whose block does not cover one contiguous span of bytes is refused with
    GeometryError."""
    nb = 4
    t = torch.zeros(nb, 8, 8)[:, :, :4]  # every row of a block skips 4 elements
    with pytest.raises(GeometryError, match="not one contiguous page"):
        views_of(t, nb)


def test_no_block_dimension_is_refused() -> None:
    """A tensor with no dimension of size num_blocks is refused with GeometryError."""
    with pytest.raises(GeometryError, match="no dimension"):
        views_of(torch.zeros(3, 5), 7)


def test_flat_byte_view_needs_and_uses_the_page_size() -> None:
    """A flat byte tensor is refused without a page size and, given one, becomes one view of
    num_blocks pages."""
    t = torch.zeros(4 * 100, dtype=torch.uint8)
    with pytest.raises(GeometryError, match="page size"):
        views_of(t, 4)
    assert views_of(t, 4, page=100) == [BlockView("", 0, 100, 100, 4)]


def test_export_registration_one_allocation_per_storage_and_daemon_accepts_it() -> None:
    """Layers on one storage become one shm_fd allocation with a view per layer that has a spec
    (others skipped), the storage is shared in place (writes through the layer tensors, before and
    after registering, show in a mapping of the fd), and an in-memory daemon accepts the request
    once the fds are sent."""
    nb, page = 12, 256
    storage = torch.zeros(2 * nb * page, dtype=torch.uint8)
    kv = {
        "model.layers.0.attn": storage[: nb * page].view(nb, page),
        "model.layers.1.attn": storage[nb * page :].view(nb, page),
        "model.layers.1.shared": storage[: nb * page].view(nb, page),  # no spec: skipped
    }
    specs = {n: LayerSpec(0, MHA, nb) for n in ("model.layers.0.attn", "model.layers.1.attn")}
    worker = types_pb2.WorkerId(engine_id="e", tp_rank=0)
    req, fds = export_registration(worker, kv, specs, block_size_tokens=16, tp_size=1)
    assert len(req.allocations) == 1 and len(fds) == 1
    assert req.allocations[0].size_bytes == 2 * nb * page
    assert req.allocations[0].WhichOneof("handle") == "shm_fd"
    assert [(v.layer_name, v.offset_bytes, v.block_stride_bytes) for v in req.views] == [
        ("model.layers.0.attn", 0, page),
        ("model.layers.1.attn", nb * page, page),
    ]
    assert all(v.dtype == "uint8" and v.cache_kind == MHA for v in req.views)
    # The storage moved into shared memory in place: writes through the layer
    # tensors, before and after registering, show in the fd's mapping.
    kv["model.layers.1.attn"][3].fill_(7)
    shared = mmap.mmap(fds[0], 2 * nb * page, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    try:
        expected = bytearray(2 * nb * page)
        expected[(nb + 3) * page : (nb + 4) * page] = b"\x07" * page
        assert shared[:] == expected
        with InprocNetwork() as net:
            region_map = net.daemon().client().register(req, fds)
            assert region_map.generation == 1 and len(region_map.regions) == 2
            kv["model.layers.0.attn"][11].fill_(9)
            expected[11 * page : 12 * page] = b"\x09" * page
            assert shared[:] == expected
    finally:
        shared.close()  # the fd itself belongs to the storage, which closes it


def test_export_registration_refuses_mixed_devices_and_empty() -> None:
    """export_registration refuses, with GeometryError, layers on more than one device type, a set
    with no specified KV cache layer, and a layer tensor without a block dimension."""
    worker = types_pb2.WorkerId(engine_id="e")
    specs = {n: LayerSpec(0, MHA, 4) for n in ("a", "b")}
    mixed = {"a": torch.zeros(4, 8), "b": torch.zeros(4, 8, device="meta")}
    with pytest.raises(GeometryError, match=r"mixed devices \['cpu', 'meta'\]"):
        export_registration(worker, mixed, specs, block_size_tokens=16)
    with pytest.raises(GeometryError, match="no KV cache layer"):
        export_registration(worker, {"a": torch.zeros(2, 2)}, {}, block_size_tokens=16)
    with pytest.raises(GeometryError, match="layer a: no dimension"):
        export_registration(
            worker, {"a": torch.zeros(3, 5)}, {"a": LayerSpec(0, MLA, 7)}, block_size_tokens=16
        )


def test_build_registration_describes_an_export_and_moves_nothing() -> None:
    """build_registration only reads: given an export of the layers, the layer tensors' storage
    stays where it was (not moved into shared memory), and the views name the export's
    allocations; an export of another number of tensors than layers is refused."""
    nb, page = 4, 64
    storage = torch.zeros(2 * nb * page, dtype=torch.uint8)
    kv = {"a": storage[: nb * page].view(nb, page), "b": storage[nb * page :].view(nb, page)}
    specs = {n: LayerSpec(0, MHA, nb) for n in kv}
    where = storage.untyped_storage().data_ptr()
    alloc = types_pb2.Allocation(
        id="kv0",
        size_bytes=2 * nb * page,
        device=types_pb2.Device(type=types_pb2.DEVICE_TYPE_CPU),
        shm_fd=types_pb2.ShmFdHandle(index=0),
    )
    worker = types_pb2.WorkerId(engine_id="e")
    req = build_registration(
        worker, kv, specs, ExportedMemory([alloc], [], [0, 0]), block_size_tokens=16
    )
    assert storage.untyped_storage().data_ptr() == where and not storage.is_shared()
    assert list(req.allocations) == [alloc]
    assert [(v.layer_name, v.allocation_id, v.offset_bytes) for v in req.views] == [
        ("a", "kv0", 0),
        ("b", "kv0", nb * page),
    ]
    with pytest.raises(GeometryError, match="an export of 1 tensors for 2 KV cache layers"):
        build_registration(
            worker, kv, specs, ExportedMemory([alloc], [], [0]), block_size_tokens=16
        )
