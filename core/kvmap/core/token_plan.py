"""Token-mode transfers (wire ``GroupBlocks.num_tokens > 0``): between two
workers whose block sizes or tensor-parallel sizes differ.

A token-mode group names the request's blocks in token order on each side
(their counts may differ), a token count and where the remote side's
tokens start (``remote_first_token``: local token ``i`` is remote token
``remote_first_token + i``, which need not start a remote block); the plan
moves, for each selected layer, those tokens of the KV heads the local worker
holds that the remote worker holds too (``core.reshard``): every head a
replicated cache (MLA, indexer) has, or the intersection of the two ranks'
heads of a head-split (MHA) one, which needs both maps' ``HeadLayout``.
Which remote rank(s) to pull from is the caller's choice
(``reshard.source_ranks``); a pull from a rank that holds none of the local
rank's heads is refused rather than moving nothing.

The plan is a ``TransferPlan`` of explicit descriptors only (``runs``): the
prepared per-block lists of the equal-shape path index whole blocks, which
token mode cuts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from kvmap.core.errors import FailedPrecondition, InvalidArgument
from kvmap.core.geometry import CacheKind, HeadLayout, RegionMapModel, TokenLayout
from kvmap.core.reshard import DST, LEN, SRC, BlockGrid, expand_rows, plan_rows, rank_heads
from kvmap.core.transfer_pieces import (
    Int64Array,
    LayerSelection,
    Side,
    _MapIndex,
    _Placed,
    _selected_names,
)
from kvmap.core.transfer_plan import (
    MAX_BLOCKS_PER_TRANSFER,
    TransferPlan,
    block_ids,
    check_group_count,
)
from kvmap.v1 import transfers_pb2

# Descriptors one token-mode request may expand to: a 128K-token request of
# 64 layer views in whole blocks of 16 tokens is 0.5M; per-token rows of a
# mixed-layout pair are refused beyond this instead of exhausting memory.
MAX_TOKEN_DESCRIPTORS = 1 << 23
MAX_TOKENS = MAX_BLOCKS_PER_TRANSFER * 1024


@dataclass(frozen=True, eq=False)
class TokenGroup:
    """One wire ``GroupBlocks`` in token mode."""

    transfer_group: int
    layer_names: tuple[str, ...]
    local_block_ids: Sequence[int] | Int64Array
    remote_block_ids: Sequence[int] | Int64Array
    num_tokens: int
    # Local token i is remote token remote_first_token + i (wire field).
    remote_first_token: int = 0


def check_token_sizes(groups: Sequence[TokenGroup]) -> None:
    """The limits that need no region map."""
    check_group_count(len(groups))
    total = sum(len(g.local_block_ids) + len(g.remote_block_ids) for g in groups)
    if total > 2 * MAX_BLOCKS_PER_TRANSFER:
        raise InvalidArgument(
            "groups", f"{total} block ids exceed the limit of {2 * MAX_BLOCKS_PER_TRANSFER}"
        )
    for i, g in enumerate(groups):
        if not 0 < g.num_tokens <= MAX_TOKENS:
            raise InvalidArgument(
                f"groups[{i}].num_tokens", f"{g.num_tokens} is not in [1, {MAX_TOKENS}]"
            )
        if not 0 <= g.remote_first_token <= MAX_TOKENS:
            # The remote blocks listed bound it further (``plan_rows``).
            raise InvalidArgument(
                f"groups[{i}].remote_first_token",
                f"{g.remote_first_token} is not in [0, {MAX_TOKENS}]",
            )


def token_groups(spec: transfers_pb2.TransferSpec) -> tuple[TokenGroup, ...]:
    """The token-mode groups of a wire spec: all of its groups, or none
    (then the spec is in block-pair mode)."""
    modes = {g.num_tokens != 0 for g in spec.groups}
    if modes != {True}:
        if len(modes) > 1:
            i = next(i for i, g in enumerate(spec.groups) if g.num_tokens == 0)
            raise InvalidArgument(
                f"spec.groups[{i}].num_tokens",
                "0 in a transfer whose other groups are in token mode; all or none must be",
            )
        for i, g in enumerate(spec.groups):
            if g.remote_first_token:
                # Refused, not ignored: block pairs have no token offset.
                raise InvalidArgument(
                    f"spec.groups[{i}].remote_first_token",
                    f"{g.remote_first_token} without num_tokens; an offset needs token mode",
                )
        return ()
    groups = tuple(
        TokenGroup(
            g.transfer_group,
            tuple(g.layer_names),
            block_ids(g.local_block_ids),
            block_ids(g.remote_block_ids),
            g.num_tokens,
            g.remote_first_token,
        )
        for g in spec.groups
    )
    check_token_sizes(groups)
    return groups


def _grid(p: _Placed, idx: _MapIndex, heads: range, head_bytes: int, kind: str) -> BlockGrid:
    model = idx.model
    tokens = model.block_size_tokens
    if tokens <= 0:
        raise FailedPrecondition(f"{idx.who} published no block size; token mode needs one")
    layout = model.heads.token_layout if model.heads else TokenLayout.TOKENS_OUTER
    if kind == "replicated":
        layout, head_bytes = TokenLayout.TOKENS_OUTER, p.layer.len_bytes // tokens
    plane = tokens * len(heads) * head_bytes
    if not plane or p.layer.len_bytes % plane:
        raise FailedPrecondition(
            f"{idx.who}: layer {p.layer.layer_name!r} has {p.layer.len_bytes}-byte blocks, "
            f"not a multiple of {tokens} tokens x {len(heads)} heads x {head_bytes} bytes"
        )
    return BlockGrid(
        base=idx.base(p) + p.layer.offset_in_region,
        stride=p.region.block_stride_bytes,
        num_blocks=p.region.num_blocks,
        block_tokens=tokens,
        heads=heads,
        head_bytes=head_bytes,
        layout=layout,
        planes=p.layer.len_bytes // plane,
    )


def _grids(
    lp: _Placed, rp: _Placed, li: _MapIndex, ri: _MapIndex
) -> list[tuple[BlockGrid, BlockGrid, range]]:
    """Both sides' grids of one layer and the heads to move in each pair."""
    name, kind = lp.layer.layer_name, lp.layer.cache_kind
    if rp.layer.cache_kind != kind:
        raise FailedPrecondition(
            f"layer {name!r}: cache kind {kind.name} in {li.who} vs "
            f"{rp.layer.cache_kind.name} in {ri.who}"
        )
    if kind.replicated:
        one = range(0, 1)
        return [(_grid(lp, li, one, 0, "replicated"), _grid(rp, ri, one, 0, "replicated"), one)]
    if kind is not CacheKind.MHA:
        raise FailedPrecondition(
            f"layer {name!r}: {kind.name} caches are not per token; token mode cannot move them"
        )
    lh, rh = li.model.heads, ri.model.heads
    if lh is None or rh is None:
        who = li.who if lh is None else ri.who
        raise FailedPrecondition(
            f"{who} published no head layout; layer {name!r} cannot be moved between "
            "different TP or block sizes"
        )
    if (lh.total_kv_heads, lh.head_bytes) != (rh.total_kv_heads, rh.head_bytes):
        raise FailedPrecondition(
            f"{lh.total_kv_heads} KV heads of {lh.head_bytes} bytes in {li.who} vs "
            f"{rh.total_kv_heads} of {rh.head_bytes} in {ri.who}"
        )
    heads = [
        rank_heads(h.total_kv_heads, idx.model.tp_size, idx.model.worker.tp_rank)
        for h, idx in ((lh, li), (rh, ri))
    ]
    kt = (lh.token_layout is TokenLayout.HEADS_KT_V, rh.token_layout is TokenLayout.HEADS_KT_V)
    if any(kt):
        if not all(kt):
            raise FailedPrecondition(
                f"layer {name!r}: a transposed-K (CPU) cache pairs only with another: "
                f"{lh.token_layout.name} in {li.who}, {rh.token_layout.name} in {ri.who}"
            )
        common = _common(heads[0], heads[1], li, ri)
        return _kt_v_grids((lp, li, heads[0]), (rp, ri, heads[1]), common=common, layout=lh)
    lgrid = _grid(lp, li, heads[0], lh.head_bytes, "split")
    rgrid = _grid(rp, ri, heads[1], rh.head_bytes, "split")
    return [(lgrid, rgrid, _common(lgrid.heads, rgrid.heads, li, ri))]


def _kt_v_grids(
    local: tuple[_Placed, _MapIndex, range],
    remote: tuple[_Placed, _MapIndex, range],
    *,
    common: range,
    layout: HeadLayout,
) -> list[tuple[BlockGrid, BlockGrid, range]]:
    """vLLM's CPU cache, per common head: its K plane as ``head_size``
    one-element "heads" of ``tokens`` (K is [head_size, tokens]), its V plane
    as one [tokens, head_size] head."""
    element = layout.head_bytes // layout.head_size
    out: list[tuple[BlockGrid, BlockGrid, range]] = []
    for head in common:
        k, v = [], []
        for p, idx, have in (local, remote):
            whole = _grid(p, idx, have, layout.head_bytes, "split")
            if whole.planes != 2:
                raise FailedPrecondition(
                    f"{idx.who}: layer {p.layer.layer_name!r} is not one K and one V per head"
                )
            base = whole.base + (head - have.start) * 2 * whole.plane_bytes // len(have)
            tokens = whole.block_tokens
            k.append(
                replace(
                    whole,
                    base=base,
                    heads=range(layout.head_size),
                    head_bytes=element,
                    layout=TokenLayout.HEADS_OUTER,
                    planes=1,
                )
            )
            v.append(
                replace(
                    whole,
                    base=base + tokens * layout.head_bytes,
                    heads=range(1),
                    head_bytes=layout.head_bytes,
                    layout=TokenLayout.TOKENS_OUTER,
                    planes=1,
                )
            )
        out += [(k[0], k[1], range(layout.head_size)), (v[0], v[1], range(1))]
    return out


def _common(a: range, b: range, li: _MapIndex, ri: _MapIndex) -> range:
    both = range(max(a.start, b.start), min(a.stop, b.stop))
    if not both:
        raise FailedPrecondition(
            f"{ri.who} holds KV heads [{b.start}, {b.stop}), none of the heads "
            f"[{a.start}, {a.stop}) of {li.who}"
        )
    return both


def _group_rows(
    i: int, g: TokenGroup, li: _MapIndex, ri: _MapIndex, destination: Side
) -> list[Int64Array]:
    sel = LayerSelection(g.transfer_group, g.layer_names)
    lg, rg = li.group(g.transfer_group), ri.group(g.transfer_group)
    seen: set[tuple[int, int]] = set()
    out: list[Int64Array] = []
    lids = np.asarray(g.local_block_ids, dtype=np.int64).reshape(-1)
    rids = np.asarray(g.remote_block_ids, dtype=np.int64).reshape(-1)
    for name in _selected_names(i, sel, li, ri):
        grids = _grids(lg[name], rg[name], li, ri)
        key = (grids[0][0].base, grids[0][1].base)
        if key in seen:
            continue  # an alias of a layer already moved: its bytes once
        seen.add(key)
        for lgrid, rgrid, heads in grids:
            first = g.remote_first_token
            pairs = ((lgrid, lids, "local", 0), (rgrid, rids, "remote", first))
            (dg, did, dn, df), (sg, sid, sn, sf) = (
                pairs if destination is Side.LOCAL else pairs[::-1]
            )
            try:
                rows = plan_rows(
                    dg, did, sg, sid, heads=heads, num_tokens=g.num_tokens,
                    dst_first=df, src_first=sf,
                )  # fmt: skip
            except InvalidArgument as err:
                raise _wire_error(i, err, dst=dn, src=sn) from None
            out.append(rows)
    return out


def _wire_error(i: int, err: InvalidArgument, *, dst: str, src: str) -> InvalidArgument:
    """``plan_rows``' error naming the wire field: dst/src_blocks are
    local/remote_block_ids, and the remote side's start remote_first_token."""
    field = err.field
    for side, name in (("dst_blocks", dst), ("src_blocks", src)):
        field = field.replace(f"{side}.first", f"groups[{i}].{name}_first_token")
        field = field.replace(side, f"groups[{i}].{name}_block_ids")
    return InvalidArgument(field, err.problem)


def plan_token_transfer(
    local: RegionMapModel,
    remote: RegionMapModel,
    groups: Sequence[TokenGroup],
    *,
    destination: Side = Side.LOCAL,
) -> TransferPlan:
    """Explicit descriptors (``TransferPlan.runs``) moving each token-mode
    group; raises before anything could be posted."""
    check_token_sizes(groups)
    li, ri = _MapIndex(local, Side.LOCAL), _MapIndex(remote, Side.REMOTE)
    rows: list[Int64Array] = []
    for i, g in enumerate(groups):
        rows += _group_rows(i, g, li, ri, destination)
    every = np.concatenate([np.zeros((0, 6), dtype=np.int64), *rows])
    count = int(every[:, 5].sum())
    if count > MAX_TOKEN_DESCRIPTORS:
        raise InvalidArgument(
            "groups", f"{count} descriptors exceed the limit of {MAX_TOKEN_DESCRIPTORS}"
        )
    flat = expand_rows(every)
    dst, src = flat[:, DST], flat[:, SRC]
    la, ra = (dst, src) if destination is Side.LOCAL else (src, dst)
    _check_written_once(dst, flat[:, LEN], destination)
    blocks = sum(
        len(g.local_block_ids if destination is Side.LOCAL else g.remote_block_ids) for g in groups
    )
    return TransferPlan(
        local_indices=np.zeros(0, dtype=np.int32),
        remote_indices=np.zeros(0, dtype=np.int32),
        runs=np.stack([la, ra, flat[:, LEN]], axis=1),
        blocks=blocks,
        bytes=int(flat[:, LEN].sum()),
    )


def _check_written_once(addr: Int64Array, length: Int64Array, destination: Side) -> None:
    """Two groups (or one layer listed in two) may not write the same bytes."""
    order = np.argsort(addr, kind="stable")
    a, n = addr[order], length[order]
    if len(a) > 1 and bool(np.any(a[1:] < (a + n)[:-1])):
        raise InvalidArgument(
            "groups", f"two groups write the same {destination.value} bytes; each would race"
        )
