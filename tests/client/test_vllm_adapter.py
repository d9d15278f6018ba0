"""The vLLM side of the adapter: vLLM's KV cache specs -> cache kinds and
layer specs (needs the vllm package; the state machines are tested without
it in test_pd_connector.py)."""

from __future__ import annotations

import pytest
import torch

from kvmap.v1 import types_pb2

pytestmark = pytest.mark.vllm
vllm_iface = pytest.importorskip("vllm.v1.kv_cache_interface", reason="vllm is not installed")


def test_cache_kind_of_each_spec() -> None:
    """vLLM full-attention and sliding-window specs map to MHA, an MLA spec to MLA, and an MLA spec
    with the indexer cache role to INDEXER."""
    from kvmap.client.vllm_connector import cache_kind_of

    v = vllm_iface
    full = v.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    mla = v.MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    indexer = v.MLAAttentionSpec(
        block_size=64,
        num_kv_heads=1,
        head_size=132,
        dtype=torch.uint8,
        cache_role=v.SparseCacheRole.INDEXER,
    )
    swa = v.SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16, sliding_window=128
    )
    assert cache_kind_of(full) == types_pb2.CACHE_KIND_MHA
    assert cache_kind_of(swa) == types_pb2.CACHE_KIND_MHA
    assert cache_kind_of(mla) == types_pb2.CACHE_KIND_MLA
    assert cache_kind_of(indexer) == types_pb2.CACHE_KIND_INDEXER


def test_layer_specs_from_a_kv_cache_config() -> None:
    """layer_specs gives every layer of a KVCacheConfig its group index as transfer group, its cache
    kind, the config's block count and the spec's page size."""
    from kvmap.client.vllm_connector import layer_specs

    v = vllm_iface
    full = v.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    mla = v.MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    config = v.KVCacheConfig(
        num_blocks=100,
        kv_cache_tensors=[],
        kv_cache_groups=[
            v.KVCacheGroupSpec(["a.0", "a.1"], full),
            v.KVCacheGroupSpec(["m.0"], mla),
        ],
    )
    specs = layer_specs(config)
    assert {n: (s.transfer_group, s.cache_kind, s.num_blocks) for n, s in specs.items()} == {
        "a.0": (0, types_pb2.CACHE_KIND_MHA, 100),
        "a.1": (0, types_pb2.CACHE_KIND_MHA, 100),
        "m.0": (1, types_pb2.CACHE_KIND_MLA, 100),
    }
    assert specs["a.0"].page_size_bytes == full.page_size_bytes
