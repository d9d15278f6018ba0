"""The wire HeadLayout (registration and region map): what a worker publishes
for peers of another TP or block size, converted both ways and validated as
hostile input."""

from __future__ import annotations

import pytest

from kvmap.core.errors import InvalidArgument
from kvmap.core.geometry import HeadLayout, TokenLayout
from kvmap.core.head_layout import head_layout_from_proto, head_layout_to_proto
from kvmap.v1 import types_pb2


def test_round_trip_and_absent() -> None:
    """A layout survives to_proto/from_proto with the per-rank count and the replicated kinds
    filled in; an unset field is None (the worker did not say)."""
    layout = HeadLayout(8, 128, 256, TokenLayout.HEADS_KV_TOKENS)
    msg = head_layout_to_proto(layout, tp_size=4)
    assert msg.kv_heads_per_rank == 2
    assert list(msg.replicated_kinds) == [types_pb2.CACHE_KIND_MLA, types_pb2.CACHE_KIND_INDEXER]
    assert head_layout_from_proto("head_layout", msg, True, 4) == layout
    assert (
        head_layout_to_proto(HeadLayout(2, 64, 128, TokenLayout.TOKENS_OUTER), 8).kv_heads_per_rank
        == 1
    )
    assert head_layout_from_proto("head_layout", types_pb2.HeadLayout(), False, 1) is None


@pytest.mark.parametrize(
    ("fields", "tp", "message"),
    [
        ({"total_kv_heads": 0}, 1, "head_layout.total_kv_heads: 0 is not in [1, 4096]"),
        ({"total_kv_heads": 6}, 4,
         "head_layout.total_kv_heads: 6 KV heads do not split over tp_size 4"),
        ({"kv_heads_per_rank": 3}, 2,
         "head_layout.kv_heads_per_rank: 3, but 8 KV heads over tp_size 2 are 4 per rank"),
        ({"head_size": 0}, 1, "head_layout.head_size: 0 is not in [1, 65536]"),
        ({"head_bytes": 100}, 1,
         "head_layout.head_bytes: 100 is not a multiple of head_size 64 in [1, 1048576]"),
        ({"head_bytes": -128}, 1,
         "head_layout.head_bytes: -128 is not a multiple of head_size 64 in [1, 1048576]"),
        ({"token_layout": 0}, 1, "head_layout.token_layout: unknown token layout 0"),
        ({"token_layout": 9}, 1, "head_layout.token_layout: unknown token layout 9"),
    ],
)  # fmt: skip
def test_bad_fields_are_invalid_argument_naming_the_field(
    fields: dict[str, int], tp: int, message: str
) -> None:
    """Every field out of range is INVALID_ARGUMENT naming it."""
    good = {"total_kv_heads": 8, "head_size": 64, "head_bytes": 128, "token_layout": 1}
    msg = types_pb2.HeadLayout(**{**good, **fields})  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument) as info:
        head_layout_from_proto("head_layout", msg, True, tp)
    assert str(info.value) == message
