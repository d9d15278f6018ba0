"""A worker's KV caches registered with its kvmapd, without vLLM: vLLM's
per-layer caches (a Mamba layer's: its list of state tensors) become page
tensors (``geometry.with_state_pages``), their memory is exported
(``memory_export``: CPU storages move into shared memory here) and the
registration is described over it (``geometry``), with the head layout that
peers of another TP or block size need; ``WorkerCore.register`` then keeps
the worker registered."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvmap.client.connector.worker import WorkerCore
from kvmap.client.geometry import (
    GeometryError,
    LayerSpec,
    export_registration,
    head_layout,
    with_state_pages,
)
from kvmap.v1 import types_pb2

log = logging.getLogger("kvmap.client.connector")


@dataclass(frozen=True)
class CacheDescription:
    """What a worker's registration says of its KV cache beyond the
    tensors: the engine's block size (tokens) and TP size, the model's
    identity, its KV heads and head size (for the head layout), and the
    engine's resolved layout name (informational, e.g. LBHNC)."""

    block_size: int
    tp_size: int
    model: types_pb2.ModelIdentity
    total_kv_heads: int
    head_size: int
    kv_cache_layout: str = ""


def published_head_layout(
    tensors: Mapping[str, torch.Tensor], specs: Mapping[str, LayerSpec], cache: CacheDescription
) -> types_pb2.HeadLayout | None:
    """What peers of another TP or block size need (``geometry.head_layout``);
    None, logged, when it cannot be read off the tensors: such peers are
    then refused, and only equal shapes transfer."""
    try:
        return head_layout(
            tensors,
            specs,
            total_kv_heads=cache.total_kv_heads,
            head_size=cache.head_size,
            tp_size=cache.tp_size,
            block_tokens=cache.block_size,
        )
    except GeometryError as err:
        log.warning("kvmap: no head layout published (%s): equal shapes only", err)
        return None


def register_caches(
    worker: WorkerCore,
    kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]],
    specs: Mapping[str, LayerSpec],
    cache: CacheDescription,
) -> types_pb2.RegionMap:
    """Register ``kv_caches`` (the layers with a spec) as ``worker``'s KV
    cache with its kvmapd: its region map."""
    tensors = with_state_pages(kv_caches, specs)
    req, fds = export_registration(
        worker.worker,
        tensors,
        specs,
        block_size_tokens=cache.block_size,
        kv_cache_layout=cache.kv_cache_layout,
        tp_size=cache.tp_size,
        model=cache.model,
        head_layout=published_head_layout(tensors, specs, cache),
    )
    region_map = worker.register(req, fds)
    log.info(
        "kvmap: registered %d layer views in %d allocation(s) with kvmapd at %s: "
        "generation %d, %d regions, %d descriptors",
        len(req.views),
        len(req.allocations),
        worker.options.socket,
        region_map.generation,
        len(region_map.regions),
        region_map.descriptor_count,
    )
    return region_map
