"""``connector.registration``: the head layout a worker publishes with its
registration, or none (logged) where its tensors do not show one."""

from __future__ import annotations

import logging

import pytest
import torch

from kvmap.client.connector.registration import CacheDescription, published_head_layout
from kvmap.client.geometry import LayerSpec
from kvmap.v1 import types_pb2

MHA = types_pb2.CACHE_KIND_MHA


def _cache(heads: int = 4, tp: int = 2) -> CacheDescription:
    return CacheDescription(
        block_size=16, tp_size=tp, model=types_pb2.ModelIdentity(), total_kv_heads=heads,
        head_size=8,
    )  # fmt: skip


def test_a_head_split_cache_publishes_its_layout() -> None:
    """[blocks, tokens, heads, head_size] with 2 heads per rank: tokens outer, 2 heads per
    rank, head bytes of one head of one token, MLA and indexer listed as replicated."""
    tensors = {"l": torch.zeros(6, 16, 2, 8, dtype=torch.float16)}
    layout = published_head_layout(tensors, {"l": LayerSpec(0, MHA, 6)}, _cache())
    assert layout is not None
    assert (layout.total_kv_heads, layout.kv_heads_per_rank, layout.head_bytes) == (4, 2, 16)
    assert layout.token_layout == types_pb2.TOKEN_LAYOUT_TOKENS_OUTER
    assert set(layout.replicated_kinds) == {types_pb2.CACHE_KIND_MLA, types_pb2.CACHE_KIND_INDEXER}


def test_a_cache_that_shows_no_head_layout_publishes_none(caplog: pytest.LogCaptureFixture) -> None:
    """Blocks that do not hold 16 tokens x 2 heads: no layout, a warning, and the worker
    still registers (peers of other shapes are then refused)."""
    tensors = {"l": torch.zeros(6, 10, 3, 8, dtype=torch.float16)}
    with caplog.at_level(logging.WARNING, logger="kvmap.client.connector"):
        assert published_head_layout(tensors, {"l": LayerSpec(0, MHA, 6)}, _cache()) is None
    assert "no head layout published" in caplog.text
