"""Whether two workers' KV caches mean the same thing, before any byte moves.

A pull between workers that serve different models (or the same model with
another KV dtype, another cache layout, other layers) would copy bytes that
the reader then misreads: wrong tokens, silently. So the daemon that plans a
transfer compares its worker's region map with the peer's once per
(local generation, remote generation) and refuses with
``FAILED_PRECONDITION`` (reason ``INCOMPATIBLE``: never retried, see
``core.retry``) naming the first difference, e.g.
``layer 'model.layers.3.self_attn.attn': dtype bfloat16 here, float16 at the peer``.

What must agree, in the order it is checked:

- the model identity (name, revision, dtype, KV cache dtype, config
  digest), each field when both sides set it (a map from a daemon that
  predates a field leaves it empty);
- the KV cache layout name, when both sides set it;
- the layer names (the same set on both sides), each layer's cache kind and
  dtype (when both set it);
- each layer's page geometry: for attention kinds the bytes of a block per
  token are equal (so block sizes may differ); when tensor-parallel sizes
  differ only replicated kinds (MLA, indexer) are compared here, since a
  head-split layer's bytes per rank depend on how heads are spread, which
  the transfer planner checks. Other kinds (Mamba, other) must have equal
  pages at equal block sizes and TP sizes.

Tensor-parallel size and block size themselves are not compared: different
ones are legal shapes of a P/D pair.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import fields

from kvmap.core.errors import FailedPrecondition
from kvmap.core.geometry import CacheKind, LayerPlacement, RegionMapModel

# The reason (trailing metadata ``kvmap-reason``) of an incompatibility.
INCOMPATIBLE = "INCOMPATIBLE"
# Cache kinds whose block holds the same bytes for each of its tokens.
_PER_TOKEN = (CacheKind.MLA, CacheKind.INDEXER, CacheKind.MHA)


class Incompatible(FailedPrecondition):
    """Two workers' KV caches differ in something a transfer cannot bridge."""

    reason = INCOMPATIBLE


def first_difference(here: RegionMapModel, peer: RegionMapModel) -> str | None:
    """The first thing that must agree and does not, in words; None when the
    two maps may exchange KV. Pure: same maps, same answer."""
    for check in (_model_difference, _layout_difference, _layers_difference):
        found = check(here, peer)
        if found is not None:
            return found
    return None


def check_compatible(here: RegionMapModel, peer: RegionMapModel) -> None:
    """Raise ``Incompatible`` naming the first difference."""
    found = first_difference(here, peer)
    if found is not None:
        raise Incompatible(
            f"worker {here.worker} (here) and peer worker {peer.worker} serve incompatible "
            f"KV caches: {found}"
        )


def _differ(a: object, b: object) -> bool:
    """Both known (non-empty) and unequal."""
    return bool(a) and bool(b) and a != b


def _model_difference(here: RegionMapModel, peer: RegionMapModel) -> str | None:
    for f in fields(here.model):
        mine, theirs = getattr(here.model, f.name), getattr(peer.model, f.name)
        if _differ(mine, theirs):
            return f"model {f.name}: {mine!r} here, {theirs!r} at the peer"
    return None


def _layout_difference(here: RegionMapModel, peer: RegionMapModel) -> str | None:
    if _differ(here.kv_cache_layout, peer.kv_cache_layout):
        return (
            f"KV cache layout {here.kv_cache_layout!r} here, {peer.kv_cache_layout!r} at the peer"
        )
    return None


def _layers(model: RegionMapModel) -> Iterator[LayerPlacement]:
    for region in model.regions:
        yield from region.layers


def _layers_difference(here: RegionMapModel, peer: RegionMapModel) -> str | None:
    mine = {p.layer_name: p for p in _layers(here)}
    theirs = {p.layer_name: p for p in _layers(peer)}
    for name, layer in mine.items():
        other = theirs.get(name)
        if other is None:
            return f"layer {name!r} is here, not at the peer"
        found = _layer_difference(layer, other, here, peer)
        if found is not None:
            return f"layer {name!r}: {found}"
    for name in theirs:
        if name not in mine:
            return f"layer {name!r} is at the peer, not here"
    return None


def _layer_difference(
    mine: LayerPlacement, theirs: LayerPlacement, here: RegionMapModel, peer: RegionMapModel
) -> str | None:
    if mine.cache_kind != theirs.cache_kind:
        return f"cache kind {mine.cache_kind.name} here, {theirs.cache_kind.name} at the peer"
    if _differ(mine.dtype, theirs.dtype):
        return f"dtype {mine.dtype} here, {theirs.dtype} at the peer"
    if not _pages_agree(mine, theirs, here, peer):
        return (
            f"{mine.len_bytes}-byte pages of {here.block_size_tokens} tokens at TP "
            f"{here.tp_size} here, {theirs.len_bytes}-byte pages of "
            f"{peer.block_size_tokens} tokens at TP {peer.tp_size} at the peer"
        )
    return None


def _pages_agree(
    mine: LayerPlacement, theirs: LayerPlacement, here: RegionMapModel, peer: RegionMapModel
) -> bool:
    kind = mine.cache_kind
    if here.tp_size != peer.tp_size and not kind.replicated:
        return True  # heads spread differently: the transfer planner's check
    mine_tokens, their_tokens = here.block_size_tokens, peer.block_size_tokens
    if mine_tokens == their_tokens or not (mine_tokens and their_tokens):
        # Same (or unknown) block size: the same page, byte for byte.
        return mine.len_bytes == theirs.len_bytes
    if kind not in _PER_TOKEN:
        return True  # a state per block is not per token: nothing to scale
    # Bytes per token equal, without fractions.
    return mine.len_bytes * their_tokens == theirs.len_bytes * mine_tokens
