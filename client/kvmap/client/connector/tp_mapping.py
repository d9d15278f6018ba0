"""Tensor-parallel mapping on the prefill side: how many decode ranks read
each prefill rank, which is what each rank's grant admits and how many
finished pulls free its blocks. The head arithmetic itself is the core's
(``kvmap.core.reshard``), shared with kvmapd."""

from __future__ import annotations

from kvmap.core.errors import KvmapError
from kvmap.core.grants import ReaderLayout
from kvmap.core.reshard import source_ranks


def tp_readers(
    kv_heads: int, src_tp: int, dst_tp: int, *, replicated: bool = False
) -> tuple[int, ...]:
    """Per source (prefill) rank, how many destination (decode) ranks read
    from it (``reshard.source_ranks``): what its grant admits and how many
    finished pulls free its blocks. Equal sizes need no head count: rank r
    reads rank r; nor a replicated (MLA, indexer) cache, where a rank may
    count 0. Raises ``ValueError`` for sizes the heads do not split over, and
    where a head-split source rank would be read by no one (its blocks would
    wait for the lease)."""
    if src_tp == dst_tp:
        return (1,) * src_tp
    if replicated:
        # MLA and indexer caches are whole on every rank: decode rank d reads
        # all of it from one prefill rank; a rank no one reads counts 0 (it
        # is granted nothing and frees its blocks at once).
        return _replicated_readers(src_tp, dst_tp)
    if kv_heads <= 0:
        raise ValueError(
            f"tensor-parallel sizes {src_tp} -> {dst_tp} need the model's KV head count"
        )
    counts = [0] * src_tp
    try:
        for r in range(dst_tp):
            for p, _ in source_ranks(kv_heads, src_tp, dst_tp, r, replicated=replicated):
                counts[p] += 1
    except KvmapError as err:
        raise ValueError(str(err)) from None
    if 0 in counts:
        raise ValueError(
            f"with {kv_heads} KV heads, prefill rank {counts.index(0)} of tensor-parallel size "
            f"{src_tp} holds no heads a decode rank of size {dst_tp} reads"
        )
    return tuple(counts)


def unread_allowed(kv_heads: int, tp_size: int, *, replicated: bool = False) -> tuple[bool, ...]:
    """Per prefill rank, whether some decode engine may read it not at all:
    the worker's word on an open grant (``UNREAD_RELEASE_ALLOWED``, or
    REFUSED), by the daemon's own rule (``ReaderLayout.may_go_unread``) over
    what the worker registers: no head count for a replicated (MLA, indexer)
    cache, the model's KV heads for a head-split one. A model mixing both
    needs decode engines of its own TP size, which read every rank."""
    if not (replicated or kv_heads):
        return (False,) * tp_size
    heads = 0 if replicated else kv_heads
    return tuple(ReaderLayout(tp_size, r, heads).may_go_unread for r in range(tp_size))


def _replicated_readers(src_tp: int, dst_tp: int) -> tuple[int, ...]:
    counts = [0] * src_tp
    try:
        for r in range(dst_tp):
            for p, _ in source_ranks(0, src_tp, dst_tp, r, replicated=True):
                counts[p] += 1
    except KvmapError as err:
        raise ValueError(str(err)) from None
    return tuple(counts)
