"""Transfers between engines that cut the KV cache differently: other
tensor-parallel sizes (a rank holds other heads) or other block sizes (a
token lies in another block, at another slot).

Pure and numpy-vectorised. The unit is one layer view on each side (a
``BlockGrid``): ``num_blocks`` blocks at ``base + b * stride``, each holding
``block_tokens`` tokens of the heads ``heads`` of this rank, ``head_bytes``
per head per token, either heads outermost (``HEADS_OUTER``, vLLM's HND:
``[heads, tokens, head]``) or tokens outermost (``TOKENS_OUTER``, NHD:
``[tokens, heads, head]``), or heads outermost with each head's K rows then
its V rows (``HEADS_KV_TOKENS``, vLLM's CPU cache). Replicated caches (MLA
latents, indexer keys) are one "head" holding the whole per-token vector,
tokens outermost.

``source_ranks`` says which source rank(s) a destination rank reads which of
its heads from: every head it holds exactly once, from the one rank holding
it or, where heads are replicated (TP > number of KV heads), from one replica
chosen so that destination ranks spread over the replicas; replicated caches
come whole from one rank, destination ranks spread round-robin.

``plan_rows`` gives, for one (destination view, source view, heads, block
lists, token count, first token on each side), the *strided rows* that move
exactly those heads of those tokens; a first token need not start a block
(a decode prefix hit ending inside a larger prefill block). A row
``(dst_addr, src_addr, len, dst_stride, src_stride, count)`` stands for
``count`` descriptor pairs ``(dst_addr + i * dst_stride, src_addr + i *
src_stride, len)``. NIXL descriptors are ``(addr, len, dev)``
rows; kvmap's prepared lists already take strided rows (``addr, len, dev,
stride, count``) and expand them, so a strided row costs one row to plan and
to ship, and ``count`` descriptors only inside NIXL. Where a rank's heads are
not contiguous in a block (NHD, a subset of the heads), a row walks the
tokens with the block's token pitch: one row per block-tile rather than one
descriptor per token. Where both sides hold the selected heads contiguously
over a whole block tile (same layout and block size, all heads), a row is
one contiguous descriptor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvmap.core.errors import FailedPrecondition, InvalidArgument
from kvmap.core.geometry import TokenLayout
from kvmap.core.grants import MAX_USES

__all__ = ["BlockGrid", "TokenLayout", "expand_rows", "plan_rows", "rank_heads", "source_ranks"]

Int64Array = npt.NDArray[np.int64]

# Columns of a strided row.
DST, SRC, LEN, DST_STRIDE, SRC_STRIDE, COUNT = range(6)


@dataclass(frozen=True)
class BlockGrid:
    """One side of one layer view (see the module docstring)."""

    base: int
    stride: int
    num_blocks: int
    block_tokens: int
    heads: range  # global KV head indices this rank's block holds, in order
    head_bytes: int
    layout: TokenLayout
    # Planes (K, V) in a view's block: 2 for a view holding a layer's K and
    # V, each plane [heads x tokens] as ``layout`` says, the planes outside
    # the heads, or inside each head for ``HEADS_KV_TOKENS``.
    planes: int = 1

    @property
    def plane_bytes(self) -> int:
        return self.block_tokens * len(self.heads) * self.head_bytes

    @property
    def block_len(self) -> int:
        return self.planes * self.plane_bytes

    def pitches(self) -> tuple[int, int, int]:
        """Bytes from one head to the next, from one token to the next, and
        from one plane (K, V) to the next."""
        hb, tokens = self.head_bytes, self.block_tokens
        if self.layout is TokenLayout.HEADS_OUTER:
            return tokens * hb, hb, self.plane_bytes
        if self.layout is TokenLayout.HEADS_KV_TOKENS:
            return self.planes * tokens * hb, hb, tokens * hb
        return hb, len(self.heads) * hb, self.plane_bytes


def rank_heads(total_heads: int, tp_size: int, tp_rank: int) -> range:
    """The KV heads rank ``tp_rank`` of ``tp_size`` holds, as vLLM splits them:
    ``total_heads / tp_size`` consecutive heads each, or, when ranks outnumber
    heads, head ``tp_rank // (tp_size / total_heads)`` (replicated)."""
    if total_heads <= 0 or tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise FailedPrecondition(
            f"rank {tp_rank} of tp_size {tp_size} with {total_heads} KV heads is not a rank"
        )
    if total_heads % tp_size and tp_size % total_heads:
        raise FailedPrecondition(
            f"{total_heads} KV heads do not split evenly over tp_size {tp_size}"
        )
    if tp_size >= total_heads:
        head = tp_rank // (tp_size // total_heads)
        return range(head, head + 1)
    per = total_heads // tp_size
    return range(tp_rank * per, (tp_rank + 1) * per)


def source_ranks(
    total_heads: int, src_tp: int, dst_tp: int, dst_rank: int, *, replicated: bool
) -> list[tuple[int, range]]:
    """``(source rank, heads)`` pulls that give destination rank ``dst_rank``
    each of its heads exactly once; heads ranges are disjoint and ascending.

    A replicated cache (``replicated``) is read whole from rank
    ``dst_rank % src_tp``, so destination ranks spread over the sources."""
    if replicated:
        if src_tp <= 0 or not 0 <= dst_rank < dst_tp:
            raise FailedPrecondition(f"rank {dst_rank} of tp_size {dst_tp} is not a rank")
        return [(dst_rank % src_tp, range(0, 1))]
    wanted = rank_heads(total_heads, dst_tp, dst_rank)
    replicas = max(src_tp // total_heads, 1)
    pulls: list[tuple[int, range]] = []
    for head in wanted:
        if src_tp >= total_heads:
            # Replicas of a head sit on consecutive ranks; destination ranks
            # sharing a head (or holding neighbouring ones) pick different ones.
            rank = head * replicas + dst_rank % replicas
        else:
            rank = head // (total_heads // src_tp)
        if pulls and pulls[-1][0] == rank:
            pulls[-1] = (rank, range(pulls[-1][1].start, head + 1))
        else:
            pulls.append((rank, range(head, head + 1)))
    return pulls


# The largest tensor-parallel size ``source_readers`` counts for: as many
# readers as one grant admits.
MAX_TP = MAX_USES


def source_readers(
    total_heads: int, src_tp: int, dst_tp: int, *, replicated: bool
) -> tuple[int, ...]:
    """Per source rank, how many destination ranks read from it
    (``source_ranks``): 0 for a rank no one reads (a replicated cache, or
    replicated heads, read from fewer ranks than hold it). Equal sizes need
    no head count: rank r reads rank r. Raises ``FailedPrecondition`` for
    sizes the heads do not split over."""
    if not 1 <= src_tp <= MAX_TP or not 1 <= dst_tp <= MAX_TP:
        raise FailedPrecondition(
            f"tensor-parallel sizes {src_tp} -> {dst_tp}: not in [1, {MAX_TP}]"
        )
    if src_tp == dst_tp:
        return (1,) * src_tp
    counts = [0] * src_tp
    for rank in range(dst_tp):
        for src, _ in source_ranks(total_heads, src_tp, dst_tp, rank, replicated=replicated):
            counts[src] += 1
    return tuple(counts)


def _tiles(
    num_tokens: int, src: tuple[int, int], dst: tuple[int, int]
) -> tuple[Int64Array, Int64Array]:
    """Runs ``[start, start + n)`` of the transfer's tokens inside one block on
    each side; a side is ``(block tokens, first token)``: transfer token ``i``
    is that side's token ``first + i``."""
    (st, sf), (dt, df) = src, dst
    cuts = np.union1d(
        np.arange(-sf % st, num_tokens, st, dtype=np.int64),
        np.arange(-df % dt, num_tokens, dt, dtype=np.int64),
    )
    cuts = np.union1d(np.zeros(1 if num_tokens > 0 else 0, dtype=np.int64), cuts)
    return cuts, np.diff(np.append(cuts, num_tokens))


def check_blocks(
    field: str, ids: Int64Array, grid: BlockGrid, num_tokens: int, first: int = 0
) -> None:
    """The block ids must cover tokens ``[first, first + num_tokens)`` and lie
    in the grid (every id listed up to the last one used)."""
    if first < 0:
        raise InvalidArgument(f"{field}.first", f"{first} is negative")
    need = -(-(first + num_tokens) // grid.block_tokens)
    if len(ids) < need:
        what = f"{num_tokens} tokens" + (f" from token {first}" if first else "")
        raise InvalidArgument(
            f"{field}.first" if first else field,
            f"{len(ids)} blocks of {grid.block_tokens} tokens cannot hold {what}",
        )
    bad = np.flatnonzero((ids[:need] < 0) | (ids[:need] >= grid.num_blocks))
    if bad.size:
        j = int(bad[0])
        raise InvalidArgument(
            f"{field}[{j}]", f"block {ids[j]} out of range [0, {grid.num_blocks})"
        )


def _check_heads(dst: BlockGrid, src: BlockGrid, heads: range) -> None:
    for grid, who in ((dst, "destination"), (src, "source")):
        if (
            not heads
            or heads.step != 1
            or heads.start < grid.heads.start
            or (heads.stop > grid.heads.stop)
        ):
            raise FailedPrecondition(
                f"heads [{heads.start}, {heads.stop}) are not all held by the {who} rank "
                f"(it holds [{grid.heads.start}, {grid.heads.stop}))"
            )
    if dst.planes != src.planes:
        raise FailedPrecondition(
            f"a block holds {dst.planes} planes (K/V) on the destination, "
            f"{src.planes} on the source"
        )
    if dst.head_bytes != src.head_bytes:
        raise FailedPrecondition(
            f"a head is {dst.head_bytes} bytes per token on the destination, "
            f"{src.head_bytes} on the source"
        )


def plan_rows(
    dst: BlockGrid,
    dst_blocks: Sequence[int] | Int64Array,
    src: BlockGrid,
    src_blocks: Sequence[int] | Int64Array,
    *,
    heads: range,
    num_tokens: int,
    dst_first: int = 0,
    src_first: int = 0,
) -> Int64Array:
    """Strided rows (module docstring) moving heads ``heads`` of ``num_tokens``
    tokens of a request whose tokens fill ``src_blocks`` (in order) on the
    source and ``dst_blocks`` on the destination: token ``i`` of the transfer
    is token ``src_first + i`` of the source blocks and ``dst_first + i`` of
    the destination blocks (0: each list's first block starts with the
    transfer's first token; another start need not be a block boundary)."""
    _check_heads(dst, src, heads)
    dids = np.asarray(dst_blocks, dtype=np.int64).reshape(-1)
    sids = np.asarray(src_blocks, dtype=np.int64).reshape(-1)
    check_blocks("dst_blocks", dids, dst, num_tokens, dst_first)
    used = dids[dst_first // dst.block_tokens : -(-(dst_first + num_tokens) // dst.block_tokens)]
    if len(np.unique(used)) != len(used):
        raise InvalidArgument("dst_blocks", "a destination block is listed twice")
    check_blocks("src_blocks", sids, src, num_tokens, src_first)
    if num_tokens <= 0:
        return np.zeros((0, 6), dtype=np.int64)
    start, n = _tiles(num_tokens, (src.block_tokens, src_first), (dst.block_tokens, dst_first))
    hb, nh = dst.head_bytes, len(heads)
    (dhp, dtp, dpp), (shp, stp, spp) = dst.pitches(), src.pitches()
    # Address of (first selected head, first token of the tile) on each side.
    dt, st = start + dst_first, start + src_first
    d0 = (
        dst.base
        + dids[dt // dst.block_tokens] * dst.stride
        + (heads.start - dst.heads.start) * dhp
        + (dt % dst.block_tokens) * dtp
    )
    s0 = (
        src.base
        + sids[st // src.block_tokens] * src.stride
        + (heads.start - src.heads.start) * shp
        + (st % src.block_tokens) * stp
    )
    rows = _tile_rows(d0, s0, n, hb=hb, nh=nh, dst_pitch=(dhp, dtp), src_pitch=(shp, stp))
    plane: Int64Array = np.concatenate(rows).astype(np.int64)
    if dst.planes == 1:
        return plane
    shift = np.zeros((dst.planes, 1, 6), dtype=np.int64)
    shift[:, 0, DST] = np.arange(dst.planes) * dpp
    shift[:, 0, SRC] = np.arange(dst.planes) * spp
    every: Int64Array = (plane[None, :, :] + shift).reshape(-1, 6)
    return every


def _tile_rows(
    d0: Int64Array,
    s0: Int64Array,
    n: Int64Array,
    *,
    hb: int,
    nh: int,
    dst_pitch: tuple[int, int],
    src_pitch: tuple[int, int],
) -> list[Int64Array]:
    """Rows of one plane: tile ``i`` holds ``n[i]`` tokens of ``nh`` heads at
    ``d0[i]`` / ``s0[i]``; pitches are (head, token) on each side."""
    (dhp, dtp), (shp, stp) = dst_pitch, src_pitch
    ones = np.ones_like(n)
    if dtp == hb and stp == hb:
        # Tokens contiguous on both sides (HND): one run of a head's tokens
        # per head, walked head by head; whole when the heads abut too.
        whole = (dhp == n * hb) & (shp == n * hb)
        length = np.where(whole, nh * n * hb, n * hb)
        count = np.where(whole, ones, nh)
        return [np.stack([d0, s0, length, dhp * ones, shp * ones, count], axis=1)]
    if dhp == hb and shp == hb:
        # Heads contiguous on both sides (NHD, MLA): one run of the selected
        # heads per token, walked token by token; whole when tokens abut too.
        whole = (dtp == nh * hb) & (stp == nh * hb)
        length = np.where(whole, n * nh * hb, nh * hb)
        count = np.where(whole, ones, n)
        return [np.stack([d0, s0, length, dtp * ones, stp * ones, count], axis=1)]
    # Different layouts: one head of one token is the contiguous unit; each
    # head's tokens are one row.
    return [
        np.stack([d0 + h * dhp, s0 + h * shp, hb * ones, dtp * ones, stp * ones, n], axis=1)
        for h in range(nh)
    ]


def expand_rows(rows: Int64Array) -> Int64Array:
    """Nx3 ``(dst_addr, src_addr, len)``: every descriptor pair the strided
    rows stand for, row by row."""
    count = rows[:, COUNT]
    which = np.repeat(np.arange(len(rows)), count)
    first = np.zeros(len(rows), dtype=np.int64)
    np.cumsum(count[:-1], out=first[1:])
    i = np.arange(int(count.sum()), dtype=np.int64) - first[which]
    return np.stack(
        [
            rows[which, DST] + i * rows[which, DST_STRIDE],
            rows[which, SRC] + i * rows[which, SRC_STRIDE],
            rows[which, LEN],
        ],
        axis=1,
    )
