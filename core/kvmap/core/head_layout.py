"""The wire ``HeadLayout`` <-> ``geometry.HeadLayout``, validated.

A head layout arrives in a worker's registration and in a peer's region map;
both are input, so every field is checked and a bad one is
``INVALID_ARGUMENT`` naming it. An absent layout is ``None``: the worker did
not say, and transfers with it need equal TP sizes and block sizes.
"""

from __future__ import annotations

from kvmap.core.errors import InvalidArgument
from kvmap.core.geometry import CacheKind, HeadLayout, TokenLayout
from kvmap.v1 import types_pb2

# Far above any model (DeepSeek: 128 heads, Llama 405B: 8 KV heads); bounds
# what a peer's map can make the planner loop over.
MAX_KV_HEADS = 1 << 12
MAX_HEAD_SIZE = 1 << 16
MAX_HEAD_BYTES = 1 << 20


def heads_per_rank(total_kv_heads: int, tp_size: int) -> int:
    return max(total_kv_heads // tp_size, 1)


def head_layout_from_proto(
    field: str, msg: types_pb2.HeadLayout, present: bool, tp_size: int
) -> HeadLayout | None:
    """The layout, or None when ``present`` is false (the field is unset)."""
    if not present:
        return None
    total = msg.total_kv_heads
    if not 1 <= total <= MAX_KV_HEADS:
        raise InvalidArgument(f"{field}.total_kv_heads", f"{total} is not in [1, {MAX_KV_HEADS}]")
    if total % tp_size and tp_size % total:
        raise InvalidArgument(
            f"{field}.total_kv_heads", f"{total} KV heads do not split over tp_size {tp_size}"
        )
    per_rank = heads_per_rank(total, tp_size)
    if msg.kv_heads_per_rank and msg.kv_heads_per_rank != per_rank:
        raise InvalidArgument(
            f"{field}.kv_heads_per_rank",
            f"{msg.kv_heads_per_rank}, but {total} KV heads over tp_size {tp_size} "
            f"are {per_rank} per rank",
        )
    if not 1 <= msg.head_size <= MAX_HEAD_SIZE:
        raise InvalidArgument(
            f"{field}.head_size", f"{msg.head_size} is not in [1, {MAX_HEAD_SIZE}]"
        )
    if not 1 <= msg.head_bytes <= MAX_HEAD_BYTES or msg.head_bytes % msg.head_size:
        raise InvalidArgument(
            f"{field}.head_bytes",
            f"{msg.head_bytes} is not a multiple of head_size {msg.head_size} in "
            f"[1, {MAX_HEAD_BYTES}]",
        )
    try:
        layout = TokenLayout(msg.token_layout)
    except ValueError:
        raise InvalidArgument(
            f"{field}.token_layout", f"unknown token layout {msg.token_layout}"
        ) from None
    return HeadLayout(total, msg.head_size, msg.head_bytes, layout)


def head_layout_to_proto(heads: HeadLayout, tp_size: int) -> types_pb2.HeadLayout:
    return types_pb2.HeadLayout(
        total_kv_heads=heads.total_kv_heads,
        kv_heads_per_rank=heads_per_rank(heads.total_kv_heads, tp_size),
        head_size=heads.head_size,
        head_bytes=heads.head_bytes,
        token_layout=types_pb2.TokenLayout.ValueType(heads.token_layout),
        replicated_kinds=[types_pb2.CacheKind.ValueType(k) for k in CacheKind if k.replicated],
    )
