"""Tensor-parallel mapping: which decode ranks read which prefill ranks when
the two engines' TP sizes differ. One rule (``TpSplit``) serves every side
that needs it: the prefill scheduler's grants (how many decode ranks read
each rank: ``tp_readers``, and which ranks may go unread), the decode
worker's pulls and releases (``pulls.PullSpecs``: the prefill ranks it
reads) and push mode's writes (``pushes``: the decode ranks a prefill rank
writes, and how many prefill ranks write one decode rank). The head
arithmetic itself is the core's (``kvmap.core.reshard``), shared with
kvmapd."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvmap.core.errors import KvmapError
from kvmap.core.geometry import CacheKind
from kvmap.core.grants import ReaderLayout
from kvmap.core.reshard import rank_heads, source_ranks, source_readers


@dataclass(frozen=True)
class TpSplit:
    """How a model's KV cache lies over an engine's tensor-parallel ranks:
    split by its ``kv_heads`` KV heads, or ``replicated`` (whole on every
    rank: MLA and indexer caches, read from one prefill rank whatever the
    TP sizes). A model mixing replicated layers with head-split ones has
    neither (no head count is passed for it): it moves only between engines
    of equal TP sizes, where rank r reads rank r."""

    kv_heads: int = 0
    replicated: bool = False

    @classmethod
    def of_model(cls, *, use_mla: bool, total_kv_heads: int, cache_kinds: Iterable[int]) -> TpSplit:
        """The split of a model as its engine reports it: its KV heads
        (none for MLA, whose workers publish no head layout) and whether
        every transferable layer's cache kind is a replicated one."""
        kinds = set(cache_kinds)
        return cls(
            kv_heads=0 if use_mla else total_kv_heads,
            replicated=bool(kinds) and all(CacheKind(k).replicated for k in kinds),
        )

    @property
    def resizable(self) -> bool:
        """Whether engines of different TP sizes can exchange this cache."""
        return self.replicated or self.kv_heads > 0

    def check_sizes(self, src_tp: int, dst_tp: int) -> None:
        """Refuse (``ValueError``) TP sizes this cache cannot move between:
        different ones for a model mixing MLA with head-split layers, and,
        for a head-split cache, sizes its heads do not split over."""
        if src_tp == dst_tp:
            return
        if not self.resizable:
            raise ValueError(
                f"tensor-parallel sizes {src_tp} -> {dst_tp}: no KV head count for a model "
                "mixing MLA with head-split attention layers, which needs engines of equal "
                "TP sizes"
            )
        if not self.replicated:
            try:
                for tp in (src_tp, dst_tp):
                    rank_heads(self.kv_heads, tp, 0)
            except KvmapError as err:
                raise ValueError(str(err)) from None

    def sources(self, src_tp: int, dst_tp: int, dst_rank: int) -> list[int]:
        """The prefill (source) ranks decode rank ``dst_rank`` reads
        (``reshard.source_ranks``), ascending: rank r reads rank r between
        equal sizes; a replicated cache is read whole from one rank; a
        head-split one from each rank holding some of ``dst_rank``'s heads.
        Raises ``ValueError`` for sizes it cannot move between."""
        if src_tp == dst_tp:
            return [dst_rank]
        self.check_sizes(src_tp, dst_tp)
        try:
            pulls = source_ranks(
                self.kv_heads, src_tp, dst_tp, dst_rank, replicated=self.replicated
            )
        except KvmapError as err:
            raise ValueError(str(err)) from None
        return [rank for rank, _ in pulls]

    def destinations(self, src_tp: int, dst_tp: int, src_rank: int) -> set[int]:
        """The decode ranks that read prefill rank ``src_rank`` (``sources``
        seen from the prefill side): the ones it writes in a push."""
        return {d for d in range(dst_tp) if src_rank in self.sources(src_tp, dst_tp, d)}

    def readers(self, src_tp: int, dst_tp: int) -> tuple[int, ...]:
        """Per prefill rank, how many decode ranks read it
        (``reshard.source_readers``): 0 for a rank no one reads (a
        replicated cache, or replicated heads, read from fewer ranks than
        hold it). Raises ``ValueError`` for sizes it cannot move between."""
        self.check_sizes(src_tp, dst_tp)
        try:
            return source_readers(self.kv_heads, src_tp, dst_tp, replicated=self.replicated)
        except KvmapError as err:
            raise ValueError(str(err)) from None

    def unread_allowed(self, tp_size: int) -> tuple[bool, ...]:
        """Per prefill rank, whether some decode engine may read it not at
        all: the worker's word on an open grant (``UNREAD_RELEASE_ALLOWED``,
        or REFUSED), by the daemon's own rule (``ReaderLayout.may_go_unread``)
        over what the worker registers: no head count for a replicated
        cache, the model's KV heads for a head-split one. A model mixing both
        needs decode engines of its own TP size, which read every rank."""
        if not self.resizable:
            return (False,) * tp_size
        heads = 0 if self.replicated else self.kv_heads
        return tuple(ReaderLayout(tp_size, r, heads).may_go_unread for r in range(tp_size))


def tp_readers(
    kv_heads: int, src_tp: int, dst_tp: int, *, replicated: bool = False
) -> tuple[int, ...]:
    """Per source (prefill) rank, how many destination (decode) ranks read
    from it (``TpSplit.readers``): what its grant admits and how many
    finished pulls free its blocks. Equal sizes need no head count: rank r
    reads rank r; nor a replicated (MLA, indexer) cache, where a rank may
    count 0 (it is granted nothing and frees its blocks at once). Raises
    ``ValueError`` for sizes the heads do not split over, and where a
    head-split source rank would be read by no one (its blocks would wait
    for the lease)."""
    counts = TpSplit(kv_heads, replicated).readers(src_tp, dst_tp)
    if not replicated and 0 in counts:
        raise ValueError(
            f"with {kv_heads} KV heads, prefill rank {counts.index(0)} of tensor-parallel size "
            f"{src_tp} holds no heads a decode rank of size {dst_tp} reads"
        )
    return counts
