"""Token-mode transfers between whole region maps (``core.token_plan``):
prefill and decode engines of other TP sizes, block sizes and layouts, with
head-split (K and V, apart or in one view), replicated (MLA) and aliased
layers.

The property test keeps a *logical* KV cache (bytes per layer, K/V plane,
head and token), writes each prefill rank's share of it into that rank's
blocks, runs the pulls the decode connector would issue
(``reshard.source_ranks``, one per source rank) through
``plan_token_transfer`` and checks the decode rank's memory against the
logical cache: its heads of the request's tokens, each byte written once,
nothing else touched.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from kvmap.core.errors import FailedPrecondition, InvalidArgument
from kvmap.core.geometry import (
    CacheKind,
    DeviceRef,
    HeadLayout,
    LayerPlacement,
    PlacedAllocation,
    PlannerInfo,
    Region,
    RegionMapModel,
    TokenLayout,
    WorkerKey,
)
from kvmap.core.reshard import rank_heads, source_ranks
from kvmap.core.token_plan import TokenGroup, plan_token_transfer
from kvmap.core.transfer_pieces import Side

HND, NHD = TokenLayout.HEADS_OUTER, TokenLayout.TOKENS_OUTER
KV_INNER = TokenLayout.HEADS_KV_TOKENS
KT_V = TokenLayout.HEADS_KT_V  # vLLM's CPU cache


@dataclass(frozen=True)
class LayerShape:
    name: str
    kind: CacheKind
    planes: int  # 2: K and V in one view
    alias: str = ""


@dataclass(frozen=True)
class Engine:
    tp: int
    block_tokens: int
    layout: TokenLayout
    pad: int


@dataclass
class RankMemory:
    model: RegionMapModel
    mem: np.ndarray
    # layer -> (offset of block 0, stride, heads, planes)
    where: dict[str, tuple[int, int, range, int]]


BASE = 1 << 24


def rank_map(
    engine: Engine, rank: int, layers: list[LayerShape], *, total: int, hb: int, num_blocks: int
) -> RankMemory:
    """One rank's map: one region per layer view, layer-outermost, aliases
    in their target's region; one allocation at a per-rank base."""
    regions, where, pos = [], {}, 0
    for ly in layers:
        if ly.alias:
            continue
        split = ly.kind is CacheKind.MHA
        heads = rank_heads(total, engine.tp, rank) if split else range(0, 1)
        unit = hb if split else 3 * hb  # an MLA latent per token
        length = ly.planes * engine.block_tokens * len(heads) * unit
        stride = length + engine.pad
        names = [ly.name] + [a.name for a in layers if a.alias == ly.name]
        regions.append(
            Region(
                len(regions), "kv", 0, pos, length, stride, num_blocks,
                tuple(LayerPlacement(n, 0, length, ly.kind) for n in names),
            )
        )  # fmt: skip
        for n in names:
            where[n] = (pos, stride, heads, ly.planes)
        pos += stride * num_blocks
    model = RegionMapModel(
        worker=WorkerKey(f"tp{engine.tp}", tp_rank=rank),
        generation=1,
        planner=PlannerInfo("baseline", 1),
        regions=tuple(regions),
        allocations=(PlacedAllocation("kv", pos, DeviceRef(), BASE * (rank + 1)),),
        block_size_tokens=engine.block_tokens,
        tp_size=engine.tp,
        heads=HeadLayout(total, hb, hb, engine.layout),
    )
    return RankMemory(model, np.zeros(pos, dtype=np.uint8), where)


def token_offset(
    rm: RankMemory,
    name: str,
    engine: Engine,
    *,
    block: int,
    plane: int,
    head: int,
    tok: int,
    unit: int,
    mla: bool,
) -> list[int]:
    """Offsets of the ``unit`` bytes of (plane, head, token) in the rank's memory."""
    start, stride, heads, planes = rm.where[name]
    h, n = head - heads.start, len(heads)
    b = engine.block_tokens
    at = start + block * stride
    if mla:
        inner = tok * unit  # [tokens, latent]
    elif engine.layout is HND:
        inner = plane * b * n * unit + (h * b + tok) * unit
    elif engine.layout is KV_INNER:
        inner = ((h * planes + plane) * b + tok) * unit
    elif engine.layout is KT_V:
        head_at = at + h * 2 * b * unit
        if plane == 0:  # K transposed: [unit one-byte elements, tokens]
            return [head_at + d * b + tok for d in range(unit)]
        return list(range(head_at + b * unit + tok * unit, head_at + b * unit + (tok + 1) * unit))
    else:
        inner = plane * b * n * unit + (tok * n + h) * unit
    return list(range(at + inner, at + inner + unit))


@st.composite
def engines(draw: st.DrawFn, total: int) -> Engine:
    tp = draw(st.sampled_from([t for t in (1, 2, 4) if total % t == 0 or t % total == 0]))
    return Engine(
        tp, draw(st.sampled_from([2, 4, 8])), draw(st.sampled_from([HND, NHD, KV_INNER])),
        draw(st.sampled_from([0, 0, 4])),
    )  # fmt: skip


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, object]:
    total = draw(st.sampled_from([1, 2, 4]))
    # vLLM's CPU cache (transposed K, then V, per head) on both engines, or
    # other layouts on each.
    cpu = draw(st.sampled_from([False, False, True]))
    layers = []
    for i in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from([CacheKind.MHA, CacheKind.MLA]))
        # An MLA block is [tokens, latent]; MHA views hold K or V, or both.
        planes = 1 if kind is CacheKind.MLA else 2 if cpu else draw(st.sampled_from([1, 2]))
        layers.append(LayerShape(f"l{i}", kind, planes))
    if draw(st.booleans()):
        layers.append(LayerShape(f"{layers[0].name}b", layers[0].kind, layers[0].planes, "l0"))
    prefill, decode = draw(engines(total)), draw(engines(total))
    if cpu:
        prefill, decode = replace(prefill, layout=KT_V), replace(decode, layout=KT_V)
    tokens = draw(st.integers(1, 20))
    # The prefill side's first token (wire remote_first_token): a decode
    # prefix hit that ends inside a prefill block, or past whole ones.
    first = draw(st.sampled_from([0, 0]) | st.integers(0, 2 * prefill.block_tokens))
    n_src = -(-(first + tokens) // prefill.block_tokens)
    n_dst = -(-tokens // decode.block_tokens)
    nb = max(n_src, n_dst) + 2
    return {
        "total": total, "layers": layers, "prefill": prefill, "decode": decode,
        "tokens": tokens, "first": first, "nb": nb, "rank": draw(st.integers(0, decode.tp - 1)),
        "src_ids": draw(st.permutations(range(nb)))[:n_src],
        "dst_ids": draw(st.permutations(range(nb)))[:n_dst],
    }  # fmt: skip


@settings(max_examples=examples(300), deadline=None)
@given(scenarios(), st.integers(0, 2**32 - 1))
def test_decode_rank_gets_its_heads_of_every_token_once(sc: dict, seed: int) -> None:  # type: ignore[type-arg]
    """For random TP pairs, block sizes, layouts (HND/NHD per engine, or the CPU's transposed K on
    both), K/V planes apart or together, MLA and MHA layers and aliases, and a prefill-side first
    token (inside a prefill block or not), the pulls of one decode rank write its heads of the
    request's tokens exactly once with the prefill's values (replicated MLA from one rank) and
    touch no other byte."""
    rng = np.random.default_rng(seed)
    hb, total, tokens, first = 2, sc["total"], sc["tokens"], sc["first"]
    layers: list[LayerShape] = sc["layers"]
    pe, de = sc["prefill"], sc["decode"]
    logical = {}
    for ly in (ly for ly in layers if not ly.alias):
        unit = hb if ly.kind is CacheKind.MHA else 3 * hb
        logical[ly.name] = rng.integers(0, 256, (ly.planes, total, tokens, unit), dtype=np.uint8)
    srcs = [rank_map(pe, r, layers, total=total, hb=hb, num_blocks=sc["nb"]) for r in range(pe.tp)]
    for r, rm in enumerate(srcs):
        rm.mem[:] = rng.integers(0, 256, len(rm.mem), dtype=np.uint8)
        for ly in (ly for ly in layers if not ly.alias):
            data = logical[ly.name]
            heads = rm.where[ly.name][2]
            for p, h, t in itertools.product(range(ly.planes), heads, range(tokens)):
                blk = sc["src_ids"][(first + t) // pe.block_tokens]
                o = token_offset(
                    rm,
                    ly.name,
                    pe,
                    block=blk,
                    plane=p,
                    head=h,
                    tok=(first + t) % pe.block_tokens,
                    unit=data.shape[3],
                    mla=ly.kind is CacheKind.MLA,
                )
                rm.mem[o] = data[p, h if ly.kind is CacheKind.MHA else 0, t]
        del r
    dst = rank_map(de, sc["rank"], layers, total=total, hb=hb, num_blocks=sc["nb"])
    dst.mem[:] = rng.integers(0, 256, len(dst.mem), dtype=np.uint8)
    want = dst.mem.copy()
    writes = np.zeros(len(dst.mem), dtype=np.int32)
    kinds = {ly.kind for ly in layers}
    for replicated in sorted({k.replicated for k in kinds}):
        names = tuple(ly.name for ly in layers if ly.kind.replicated == replicated)
        pulls = source_ranks(total, pe.tp, de.tp, sc["rank"], replicated=replicated)
        event(f"pulls: {len(pulls)} ({'MLA' if replicated else 'MHA'})")
        for rank, _ in pulls:
            group = TokenGroup(0, names, sc["dst_ids"], sc["src_ids"], tokens, first)
            plan = plan_token_transfer(dst.model, srcs[rank].model, [group])
            for la, ra, n in plan.runs.tolist():
                do, so = la - BASE * (sc["rank"] + 1), ra - BASE * (rank + 1)
                dst.mem[do : do + n] = srcs[rank].mem[so : so + n]
                writes[do : do + n] += 1
    for ly in (ly for ly in layers if not ly.alias):
        data = logical[ly.name]
        for p, h, t in itertools.product(range(ly.planes), dst.where[ly.name][2], range(tokens)):
            blk = sc["dst_ids"][t // de.block_tokens]
            o = token_offset(
                dst,
                ly.name,
                de,
                block=blk,
                plane=p,
                head=h,
                tok=t % de.block_tokens,
                unit=data.shape[3],
                mla=ly.kind is CacheKind.MLA,
            )
            want[o] = data[p, h if ly.kind is CacheKind.MHA else 0, t]
    assert writes.max(initial=0) <= 1, "a destination byte was written twice"
    assert np.array_equal(dst.mem, want)
    event(f"TP {pe.tp}->{de.tp}, blocks {pe.block_tokens}->{de.block_tokens}")
    event(f"layouts {pe.layout.name} -> {de.layout.name}")
    event(f"prefill start inside a block: {first % pe.block_tokens != 0}")


def _pair(
    decode_tp: int = 2, rank: int = 0, heads: bool = True
) -> tuple[RegionMapModel, RegionMapModel]:
    layers = [LayerShape("l0", CacheKind.MHA, 2)]
    pe, de = Engine(1, 4, HND, 0), Engine(decode_tp, 8, NHD, 0)
    src = rank_map(pe, 0, layers, total=2, hb=2, num_blocks=8).model
    dst = rank_map(de, rank, layers, total=2, hb=2, num_blocks=8).model
    if not heads:
        src = RegionMapModel(**{**src.__dict__, "heads": None})
    return dst, src


def test_token_mode_refuses_what_it_cannot_plan() -> None:
    """Missing head layout, too few blocks for the tokens, out-of-range ids and a token count of 0
    are refused before anything is posted, naming the wire field."""
    dst, src = _pair()
    with pytest.raises(FailedPrecondition, match="published no head layout"):
        plan_token_transfer(dst, _pair(heads=False)[1], [TokenGroup(0, (), [0], [0, 1], 8)])
    with pytest.raises(
        InvalidArgument,
        match=r"groups\[0\]\.remote_block_ids: 1 blocks of 4 tokens cannot hold 8 tokens",
    ):
        plan_token_transfer(dst, src, [TokenGroup(0, (), [0], [0], 8)])
    with pytest.raises(
        InvalidArgument, match=r"groups\[0\]\.local_block_ids\[0\]: block 9 out of range"
    ):
        plan_token_transfer(dst, src, [TokenGroup(0, (), [9], [0, 1], 8)])
    with pytest.raises(InvalidArgument, match=r"groups\[0\]\.num_tokens: 0 is not in"):
        plan_token_transfer(dst, src, [TokenGroup(0, (), [0], [0, 1], 0)])
    with pytest.raises(InvalidArgument, match="two groups write the same local bytes"):
        plan_token_transfer(
            dst, src, [TokenGroup(0, (), [0], [0, 1], 8), TokenGroup(0, (), [0], [2, 3], 8)]
        )


def test_remote_first_token_is_bounded_by_the_remote_blocks_listed() -> None:
    """A remote first token that is negative or past what the remote blocks listed hold is
    INVALID_ARGUMENT naming remote_first_token, in a pull (remote source) and a push (remote
    destination); one inside the listed blocks reads (or writes) only the remote blocks needed."""
    dst, src = _pair()  # remote (prefill) blocks of 4 tokens, local of 8
    with pytest.raises(InvalidArgument, match=r"groups\[0\]\.remote_first_token: -1 is not in"):
        plan_token_transfer(dst, src, [TokenGroup(0, (), [0], [0, 1], 4, -1)])
    for side in (Side.LOCAL, Side.REMOTE):
        with pytest.raises(
            InvalidArgument,
            match=r"groups\[0\]\.remote_first_token: 2 blocks of 4 tokens cannot hold "
            r"8 tokens from token 2",
        ):
            plan_token_transfer(dst, src, [TokenGroup(0, (), [0], [0, 1], 8, 2)], destination=side)
    plan = plan_token_transfer(dst, src, [TokenGroup(0, (), [0], [5, 3, 6], 5, 6)])
    stride = src.regions[0].block_stride_bytes
    touched = set(((plan.runs[:, 1] - BASE) // stride).tolist())
    assert touched == {3, 6}  # tokens 6..10: slots 2-3 of block 3, 0-2 of block 6
    assert plan.bytes == 5 * 2 * 1 * 2  # tokens x planes x the rank's one head x head bytes


def test_pull_from_a_rank_without_the_heads_is_refused() -> None:
    """A decode rank of TP 2 that pulls from a prefill TP 2 rank holding the other head is
    FAILED_PRECONDITION naming both head ranges, in either direction."""
    layers = [LayerShape("l0", CacheKind.MHA, 1)]
    src = rank_map(Engine(2, 4, HND, 0), 1, layers, total=2, hb=2, num_blocks=8).model
    dst = rank_map(Engine(2, 8, HND, 0), 0, layers, total=2, hb=2, num_blocks=8).model
    with pytest.raises(FailedPrecondition, match=r"holds KV heads \[1, 2\), none of the heads"):
        plan_token_transfer(dst, src, [TokenGroup(0, (), [0], [0, 1], 8)])
    # Pushing the destination's head 0 into that rank is refused the same way.
    with pytest.raises(FailedPrecondition, match="none of the heads"):
        plan_token_transfer(dst, src, [TokenGroup(0, (), [0], [0, 1], 8)], destination=Side.REMOTE)
