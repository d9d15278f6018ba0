"""Transfers between differently cut KV caches (``core.reshard``): other TP
sizes, other block sizes, other head/token layouts.

The property test builds, for random (total KV heads, prefill TP, decode TP,
layouts, head size, block sizes, token count, block lists), every prefill
rank's and one decode rank's memory, fills the prefill blocks with random
bytes, executes the pulls ``source_ranks`` chooses with the rows
``plan_rows`` gives, and checks every destination byte: the bytes of the
decode rank's heads for the request's tokens are written exactly once, from
the byte an independent per-(head, token) copy names; nothing else is written.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from kvmap.core.errors import FailedPrecondition, InvalidArgument
from kvmap.core.reshard import (
    BlockGrid,
    TokenLayout,
    expand_rows,
    plan_rows,
    rank_heads,
    source_ranks,
)

HND, NHD = TokenLayout.HEADS_OUTER, TokenLayout.TOKENS_OUTER
KV_INNER = TokenLayout.HEADS_KV_TOKENS


@dataclass(frozen=True)
class Rank:
    """One rank's view in its own buffer (base address ``base``)."""

    grid: BlockGrid
    blocks: list[int]  # the request's blocks, in token order
    mem: np.ndarray


def offset(grid: BlockGrid, block: int, head: int, token: int, plane: int) -> int:
    """Byte offset (from the grid's base) of (head, token) of ``plane`` in ``block``."""
    h, hb, n, b = head - grid.heads.start, grid.head_bytes, len(grid.heads), grid.block_tokens
    if grid.layout is HND:
        inner = plane * grid.plane_bytes + (h * b + token) * hb
    elif grid.layout is KV_INNER:
        inner = ((h * grid.planes + plane) * b + token) * hb
    else:
        inner = plane * grid.plane_bytes + (token * n + h) * hb
    return block * grid.stride + inner


def simulate(rows: np.ndarray, dst: Rank, src: Rank, writes: np.ndarray) -> None:
    for d, s, n in expand_rows(rows).tolist():
        do, so = d - dst.grid.base, s - src.grid.base
        assert do >= 0 and do + n <= len(dst.mem)
        assert so >= 0 and so + n <= len(src.mem)
        dst.mem[do : do + n] = src.mem[so : so + n]
        writes[do : do + n] += 1


def reads_listed_blocks(rows: np.ndarray, src: Rank) -> bool:
    """Every source byte the rows read lies in one block the source list names."""
    g = src.grid
    for _, s, n in expand_rows(rows).tolist():
        block, inner = divmod(s - g.base, g.stride)
        if block not in src.blocks or inner + n > g.block_len:
            return False
    return True


@st.composite
def tp_shapes(draw: st.DrawFn) -> tuple[int, int, int]:
    """(total KV heads, prefill TP, decode TP): sizes vLLM can run."""
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    sizes = [t for t in (1, 2, 4, 8) if heads % t == 0 or t % heads == 0]
    return heads, draw(st.sampled_from(sizes)), draw(st.sampled_from(sizes))


@st.composite
def block_sizes(draw: st.DrawFn) -> tuple[int, int]:
    """(prefill block tokens, decode block tokens): equal, k x or 1/k x."""
    unit, k = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    return draw(st.sampled_from([(unit, unit * k), (unit * k, unit)]))


def grid(
    draw: st.DrawFn,
    base: int,
    tokens: int,
    heads: range,
    *,
    hb: int,
    num_blocks: int,
    planes: int,
) -> BlockGrid:
    pad = draw(st.sampled_from([0, 0, 5]))  # other layers' bytes between blocks
    length = tokens * len(heads) * hb * planes
    layout = draw(st.sampled_from([HND, NHD, KV_INNER]))
    return BlockGrid(base, length + pad, num_blocks, tokens, heads, hb, layout, planes)


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, object]:
    total, src_tp, dst_tp = draw(tp_shapes())
    replicated = draw(st.booleans()) if total == 1 else False
    bs, bd = draw(block_sizes())
    hb = draw(st.integers(1, 4))
    planes = draw(st.sampled_from([1, 1, 2]))  # 2: K and V in one view
    num_tokens = draw(st.integers(0, 20))
    # Where the transfer starts on each side (wire remote_first_token): often
    # 0, else any token, inside a block or past whole leading blocks.
    src_first = draw(st.sampled_from([0, 0]) | st.integers(0, 2 * bs))
    dst_first = draw(st.sampled_from([0, 0, 0]) | st.integers(0, 2 * bd))
    n_src, n_dst = -(-(src_first + num_tokens) // bs), -(-(dst_first + num_tokens) // bd)
    nb_src, nb_dst = n_src + draw(st.integers(1, 3)), n_dst + draw(st.integers(1, 3))
    src_ids = draw(st.lists(st.integers(0, nb_src - 1), min_size=n_src, max_size=n_src))
    dst_ids = draw(st.permutations(range(nb_dst)))[:n_dst]
    dst_rank = draw(st.integers(0, dst_tp - 1))
    srcs = []
    for r in range(src_tp):
        heads = range(0, 1) if replicated else rank_heads(total, src_tp, r)
        srcs.append(grid(draw, (r + 1) << 20, bs, heads, hb=hb, num_blocks=nb_src, planes=planes))
    dheads = range(0, 1) if replicated else rank_heads(total, dst_tp, dst_rank)
    dst = grid(draw, 1 << 30, bd, dheads, hb=hb, num_blocks=nb_dst, planes=planes)
    return {
        "total": total, "src_tp": src_tp, "dst_tp": dst_tp, "dst_rank": dst_rank,
        "replicated": replicated, "tokens": num_tokens, "srcs": srcs, "dst": dst,
        "src_ids": src_ids, "dst_ids": dst_ids, "src_first": src_first, "dst_first": dst_first,
    }  # fmt: skip


def size(g: BlockGrid) -> int:
    return (g.num_blocks - 1) * g.stride + g.block_len


@settings(max_examples=examples(600), deadline=None)
@given(scenarios(), st.integers(0, 2**32 - 1))
def test_every_destination_byte_is_written_once_from_the_right_source_byte(
    sc: dict,
    seed: int,  # type: ignore[type-arg]
) -> None:
    """For random TP pairs (decode > prefill and <, replicated heads, replicated caches), layouts
    on each side, block sizes k x / 1/k x apart with a partial last block, block lists, and
    first tokens on either side (inside a block or past leading blocks), the
    pulls source_ranks picks and the rows plan_rows gives write each destination byte of the
    decode rank's heads for the request's tokens exactly once, with the prefill's value; nothing
    else is written, and each pull reads only its source rank."""
    rng = np.random.default_rng(seed)
    srcs = [
        Rank(g, sc["src_ids"], rng.integers(0, 256, size(g), dtype=np.uint8)) for g in sc["srcs"]
    ]
    dg: BlockGrid = sc["dst"]
    dst = Rank(dg, sc["dst_ids"], rng.integers(0, 256, size(dg), dtype=np.uint8))
    want = dst.mem.copy()
    writes = np.zeros(len(dst.mem), dtype=np.int32)
    pulls = source_ranks(
        sc["total"], sc["src_tp"], sc["dst_tp"], sc["dst_rank"], replicated=sc["replicated"]
    )
    covered = [h for _, heads in pulls for h in heads]
    assert covered == list(dg.heads)  # every head once, in order
    tokens: int = sc["tokens"]
    sf, df = sc["src_first"], sc["dst_first"]
    for rank, heads in pulls:
        src = srcs[rank]
        rows = plan_rows(
            dg, dst.blocks, src.grid, src.blocks, heads=heads, num_tokens=tokens,
            dst_first=df, src_first=sf,
        )  # fmt: skip
        simulate(rows, dst, src, writes)
        assert reads_listed_blocks(rows, src)
        for h, t, p in itertools.product(heads, range(tokens), range(dg.planes)):
            dt, st_ = t + df, t + sf
            d = offset(dg, dst.blocks[dt // dg.block_tokens], h, dt % dg.block_tokens, p)
            sb = src.blocks[st_ // src.grid.block_tokens]
            s = offset(src.grid, sb, h, st_ % src.grid.block_tokens, p)
            want[d : d + dg.head_bytes] = src.mem[s : s + dg.head_bytes]
        if len(rows):
            event(f"max descriptors per row: {int(rows[:, 5].max()) > 1}")
    assert np.array_equal(dst.mem, want)
    assert writes.max(initial=0) <= 1, "a destination byte was written twice"
    assert int(writes.sum()) == tokens * len(dg.heads) * dg.head_bytes * dg.planes
    event(f"pulls: {len(pulls)}; layouts {dg.layout.name}/{srcs[0].grid.layout.name}")
    event(f"block sizes {'equal' if dg.block_tokens == srcs[0].grid.block_tokens else 'differ'}")
    event(f"source start inside a block: {sf % srcs[0].grid.block_tokens != 0}")
    event(f"destination start inside a block: {df % dg.block_tokens != 0}")


def test_source_ranks_split_and_gather_heads() -> None:
    """Decode TP 2 of 4 heads reads half of prefill TP 1's heads; decode TP 1 gathers from both
    prefill TP 2 ranks; replicated heads (TP 8, 2 heads) are read once, spread over replicas;
    replicated caches spread decode ranks over prefill ranks."""
    assert source_ranks(4, 1, 2, 1, replicated=False) == [(0, range(2, 4))]
    assert source_ranks(4, 2, 1, 0, replicated=False) == [(0, range(0, 2)), (1, range(2, 4))]
    assert source_ranks(2, 8, 1, 0, replicated=False) == [(0, range(0, 1)), (4, range(1, 2))]
    assert source_ranks(2, 8, 4, 3, replicated=False) == [(7, range(1, 2))]
    assert [source_ranks(1, 2, 4, r, replicated=True)[0][0] for r in range(4)] == [0, 1, 0, 1]
    assert rank_heads(2, 4, 3) == range(1, 2)


def test_uneven_head_split_and_bad_blocks_are_refused() -> None:
    """Head counts that do not split over a TP size are FAILED_PRECONDITION; block lists too short
    for the tokens (from a first token, or a negative one), out of range or repeated on the
    destination are INVALID_ARGUMENT."""
    with pytest.raises(FailedPrecondition, match="3 KV heads do not split evenly over tp_size 2"):
        rank_heads(3, 2, 0)
    g = BlockGrid(0, 8, 4, 4, range(0, 1), 2, NHD)
    with pytest.raises(InvalidArgument, match="2 blocks of 4 tokens cannot hold 9 tokens"):
        plan_rows(g, [0, 1], g, [0, 1, 2], heads=range(0, 1), num_tokens=9)
    with pytest.raises(InvalidArgument, match=r"src_blocks\[1\]: block 4 out of range"):
        plan_rows(g, [0, 1], g, [0, 4], heads=range(0, 1), num_tokens=8)
    with pytest.raises(InvalidArgument, match="a destination block is listed twice"):
        plan_rows(g, [1, 1], g, [0, 1], heads=range(0, 1), num_tokens=8)
    with pytest.raises(InvalidArgument, match=r"src_blocks\.first: -1 is negative"):
        plan_rows(g, [0], g, [0], heads=range(0, 1), num_tokens=1, src_first=-1)
    with pytest.raises(
        InvalidArgument, match=r"dst_blocks\.first: 2 blocks of 4 tokens cannot hold 6 tokens from"
    ):
        plan_rows(g, [0, 1], g, [0, 1], heads=range(0, 1), num_tokens=6, dst_first=3)
    with pytest.raises(FailedPrecondition, match=r"heads \[0, 2\) are not all held"):
        plan_rows(g, [0], g, [0], heads=range(0, 2), num_tokens=1)


def test_descriptor_counts_of_common_shapes() -> None:
    """Same layout, block size and heads: one descriptor per block. HND half of the heads: one
    descriptor per block (the heads abut). NHD half of the heads: one strided row per block of
    block_tokens descriptors. Prefill blocks of 2 tokens into decode blocks of 4: one per prefill
    block (per source tile)."""
    hnd4 = BlockGrid(0, 64, 8, 4, range(0, 4), 4, HND)
    hnd2 = BlockGrid(1 << 20, 32, 8, 4, range(2, 4), 4, HND)
    nhd4 = BlockGrid(0, 64, 8, 4, range(0, 4), 4, NHD)
    nhd2 = BlockGrid(1 << 20, 32, 8, 4, range(2, 4), 4, NHD)
    rows = plan_rows(hnd4, [0, 1, 2], hnd4, [3, 4, 5], heads=range(0, 4), num_tokens=12)
    assert (len(rows), int(rows[:, 5].sum())) == (3, 3)
    rows = plan_rows(hnd2, [0, 1, 2], hnd4, [3, 4, 5], heads=range(2, 4), num_tokens=12)
    assert (len(rows), int(rows[:, 5].sum())) == (3, 3)
    rows = plan_rows(nhd2, [0, 1, 2], nhd4, [3, 4, 5], heads=range(2, 4), num_tokens=12)
    assert (len(rows), int(rows[:, 5].sum())) == (3, 12)
    small = BlockGrid(0, 32, 8, 2, range(0, 4), 4, HND)
    rows = plan_rows(hnd4, [0, 1], small, [0, 1, 2, 3], heads=range(0, 4), num_tokens=7)
    assert len(rows) == 4 and int(rows[:, 5].sum()) == 4 * 4  # per head: other block pitch
