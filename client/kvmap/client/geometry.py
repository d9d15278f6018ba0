"""What a worker tells its daemon about its KV cache: one ``View`` per layer
(or per K/V half of a layer whose halves are apart), computed from each
layer tensor's shape and strides, for block-outermost and layer-outermost
layouts alike.

``block_views`` is pure (shapes and strides in, byte geometry out): the
block dimension is the first dimension of ``num_blocks`` entries; the
dimensions inside it must make each block one contiguous page (in any
physical order); each index of the dimensions outside it (e.g. the K/V
dimension of ``[2, num_blocks, ...]`` caches) becomes its own view.
``build_registration`` exports the tensors' backing storages (shared memory
on CPU, CUDA IPC on GPUs) and assembles the ``RegisterWorkerRequest``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvmap.client import cuda_export, shm_export
from kvmap.v1 import registry_pb2, types_pb2


@dataclass(frozen=True)
class LayerSpec:
    """What the connector knows of one layer from vLLM's KV cache config."""

    transfer_group: int
    cache_kind: int  # types_pb2.CacheKind
    num_blocks: int
    # Bytes of one block of this layer; needed only for flat (1-D) byte views.
    page_size_bytes: int = 0


@dataclass(frozen=True)
class BlockView:
    """One run of ``num_blocks`` equal pages: block ``b`` starts at
    ``offset_bytes + b * block_stride_bytes`` (from the storage's start)."""

    suffix: str
    offset_bytes: int
    block_len_bytes: int
    block_stride_bytes: int
    num_blocks: int


class GeometryError(ValueError):
    pass


def block_views(
    shape: Sequence[int],
    strides: Sequence[int],
    *,
    element_size: int,
    storage_offset: int,
    num_blocks: int,
    page_size_bytes: int = 0,
) -> list[BlockView]:
    """The block geometry of one layer tensor (see the module docstring)."""
    _check_layout(shape, strides, num_blocks)
    base = storage_offset * element_size
    if len(shape) == 1:
        return [_flat_view(shape[0] * element_size, strides[0], base, num_blocks, page_size_bytes)]
    dim = _block_dim(shape, num_blocks)
    block_len = _page_elements(shape, strides, dim) * element_size
    block_stride = strides[dim] * element_size if num_blocks > 1 else block_len
    if block_stride < block_len:
        raise GeometryError(
            f"blocks of {block_len} bytes overlap at a stride of {block_stride} bytes"
        )
    outer = [d for d in range(dim) if shape[d] != 1]
    views = []
    for index in itertools.product(*(range(shape[d]) for d in outer)):
        offset = base + sum(i * strides[d] for i, d in zip(index, outer, strict=True)) * (
            element_size
        )
        suffix = f"[{','.join(map(str, index))}]" if index else ""
        views.append(BlockView(suffix, offset, block_len, block_stride, num_blocks))
    return views


def _check_layout(shape: Sequence[int], strides: Sequence[int], num_blocks: int) -> None:
    """Refuse what no block geometry can be read from."""
    if len(shape) != len(strides) or not shape:
        raise GeometryError(f"shape {tuple(shape)} and strides {tuple(strides)} do not match")
    if num_blocks <= 0:
        raise GeometryError(f"num_blocks must be positive, got {num_blocks}")
    if any(s < 0 for s in strides):
        raise GeometryError(f"negative strides {tuple(strides)} are not supported")


def _flat_view(
    size_bytes: int, stride: int, base: int, num_blocks: int, page_size_bytes: int
) -> BlockView:
    """A flat byte view (shared between layer types): it has no block
    dimension, so pages of the spec's size abut from its start."""
    if page_size_bytes <= 0:
        raise GeometryError("a 1-D KV cache view needs the layer's page size")
    if stride != 1 or size_bytes < num_blocks * page_size_bytes:
        raise GeometryError(
            f"1-D view of {size_bytes} bytes cannot hold {num_blocks} pages "
            f"of {page_size_bytes} bytes"
        )
    return BlockView("", base, page_size_bytes, page_size_bytes, num_blocks)


def _block_dim(shape: Sequence[int], num_blocks: int) -> int:
    """The block dimension: the first one of ``num_blocks`` entries."""
    try:
        return list(shape).index(num_blocks)
    except ValueError:
        raise GeometryError(
            f"no dimension of shape {tuple(shape)} has the {num_blocks} blocks of the cache"
        ) from None


def _page_elements(shape: Sequence[int], strides: Sequence[int], dim: int) -> int:
    """Elements in one block, checking that the dimensions inside the block
    dimension tile it without gaps (in any physical order), so a block is one
    contiguous page the daemon can move as a single run of bytes."""
    inner = [(shape[d], strides[d]) for d in range(dim + 1, len(shape)) if shape[d] != 1]
    expected = 1
    for size, stride in sorted(inner, key=lambda x: x[1]):
        if stride != expected:
            raise GeometryError(
                f"a block of shape {tuple(shape)} with strides {tuple(strides)} is not one "
                "contiguous page"
            )
        expected *= size
    return expected


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def build_registration(
    worker: types_pb2.WorkerId,
    tensors: Mapping[str, torch.Tensor],
    specs: Mapping[str, LayerSpec],
    *,
    block_size_tokens: int,
    kv_cache_layout: str = "",
    tp_size: int = 1,
) -> tuple[registry_pb2.RegisterWorkerRequest, list[int]]:
    """The registration of a worker's KV cache and the fds it needs sent.

    Layers without a spec are skipped (vLLM hands a connector layers that
    share another layer's cache). CPU storages are moved into shared memory
    in place and travel as fds; CUDA storages travel as IPC handles. Each
    distinct storage is one allocation, whatever number of layers it backs.
    """
    names, chosen, device = _chosen_layers(tensors, specs)
    req = registry_pb2.RegisterWorkerRequest(
        worker=worker,
        kv_cache_layout=kv_cache_layout,
        block_size_tokens=block_size_tokens,
        tp_size=tp_size,
    )
    if device == "cpu":
        fds, storage_sizes, placed = _add_shm_allocations(req, chosen)
    else:
        fds, storage_sizes, placed = _add_cuda_allocations(req, chosen)
    for name, tensor, where in zip(names, chosen, placed, strict=True):
        index = where.storage_index
        _add_layer_views(
            req, name, tensor, specs[name], storage_index=index, size=storage_sizes[index]
        )
    return req, fds


def _chosen_layers(
    tensors: Mapping[str, torch.Tensor], specs: Mapping[str, LayerSpec]
) -> tuple[list[str], list[torch.Tensor], str]:
    """The layers to register (those with a spec), their tensors and the one
    device type they share: one registration is either shm or CUDA IPC."""
    names = [n for n in tensors if n in specs]
    if not names:
        raise GeometryError("no KV cache layer to register")
    chosen = [tensors[n] for n in names]
    devices = {t.device.type for t in chosen}
    if len(devices) != 1:
        raise GeometryError(f"KV cache layers on mixed devices {sorted(devices)}")
    return names, chosen, devices.pop()


def _add_shm_allocations(
    req: registry_pb2.RegisterWorkerRequest, chosen: Sequence[torch.Tensor]
) -> tuple[list[int], list[int], list[shm_export.SharedView]]:
    """Move CPU storages into shared memory and add one allocation each; an
    allocation names its fd by index into the fds sent with the request."""
    storages, placed = shm_export.export_tensors(chosen)
    fds: list[int] = []
    storage_sizes: list[int] = []
    for i, s in enumerate(storages):
        fds.append(s.fd)
        storage_sizes.append(s.size_bytes)
        req.allocations.add(
            id=f"kv{i}",
            size_bytes=s.size_bytes,
            device=types_pb2.Device(type=types_pb2.DEVICE_TYPE_CPU),
            shm_fd=types_pb2.ShmFdHandle(index=i),
        )
    return fds, storage_sizes, placed


def _add_cuda_allocations(
    req: registry_pb2.RegisterWorkerRequest, chosen: Sequence[torch.Tensor]
) -> tuple[list[int], list[int], list[shm_export.SharedView]]:
    """Export CUDA storages as IPC handles and add one allocation each; no
    fds travel with them."""
    cuda_storages, placed = cuda_export.export_cuda_tensors(chosen)
    storage_sizes: list[int] = []
    for i, c in enumerate(cuda_storages):
        storage_sizes.append(c.storage_size_bytes)
        req.allocations.append(c.allocation(f"kv{i}"))
    return [], storage_sizes, placed


def _add_layer_views(
    req: registry_pb2.RegisterWorkerRequest,
    name: str,
    tensor: torch.Tensor,
    spec: LayerSpec,
    *,
    storage_index: int,
    size: int,
) -> None:
    """Add the views of one layer, each checked to end inside its
    ``size``-byte storage so the daemon never maps past it."""
    try:
        views = block_views(
            tensor.shape,
            tensor.stride(),
            element_size=tensor.element_size(),
            storage_offset=int(tensor.storage_offset()),
            num_blocks=spec.num_blocks,
            page_size_bytes=spec.page_size_bytes,
        )
    except GeometryError as err:
        raise GeometryError(f"layer {name}: {err}") from None
    for v in views:
        end = v.offset_bytes + (v.num_blocks - 1) * v.block_stride_bytes + v.block_len_bytes
        if end > size:
            raise GeometryError(
                f"layer {name}{v.suffix}: ends at byte {end} of a {size}-byte storage"
            )
        req.views.add(
            layer_name=name + v.suffix,
            allocation_id=f"kv{storage_index}",
            transfer_group=spec.transfer_group,
            cache_kind=spec.cache_kind,  # type: ignore[arg-type,unused-ignore]
            dtype=dtype_name(tensor.dtype),
            offset_bytes=v.offset_bytes,
            block_len_bytes=v.block_len_bytes,
            block_stride_bytes=v.block_stride_bytes,
            num_blocks=v.num_blocks,
        )
