"""Which vLLM KV cache configs are read whole from one prefill rank when TP
sizes differ (``replicated_of``; needs the vllm package)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.vllm
vllm_iface = pytest.importorskip("vllm.v1.kv_cache_interface", reason="vllm is not installed")


def _config(*groups: tuple[list[str], object]) -> object:
    v = vllm_iface
    return v.KVCacheConfig(
        num_blocks=10,
        kv_cache_tensors=[],
        kv_cache_groups=[v.KVCacheGroupSpec(names, spec) for names, spec in groups],
    )


def test_only_mla_and_indexer_caches_are_replicated() -> None:
    """MLA with its indexer (DeepSeek-V3.2) and MLA alone are replicated; a full-attention
    model and a model mixing MLA with full attention are not (the mix needs equal TP sizes)."""
    from kvmap.client.vllm_connector import replicated_of

    v = vllm_iface
    full = v.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    mla = v.MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    indexer = v.MLAAttentionSpec(
        block_size=16,
        num_kv_heads=1,
        head_size=132,
        dtype=torch.uint8,
        cache_role=v.SparseCacheRole.INDEXER,
    )
    assert replicated_of(_config((["m.0", "m.1"], mla), (["i.0", "i.1"], indexer)))
    assert replicated_of(_config((["m.0"], mla)))
    assert not replicated_of(_config((["a.0"], full)))
    assert not replicated_of(_config((["m.0"], mla), (["a.0"], full)))


def test_a_mixed_model_needs_equal_tp_sizes() -> None:
    """A model with no head count that is not all replicated (MLA mixed with head-split layers)
    is refused at start-up when told of decode engines of another TP size; its own size, no
    size, a head-split model and an all-MLA model are accepted."""
    from kvmap.client.connector import ConnectorOptions
    from kvmap.client.vllm_connector import check_mixed_tp

    with pytest.raises(ValueError, match="mixing MLA with head-split attention layers"):
        check_mixed_tp(ConnectorOptions(decode_tp_size=2), 1, 0, False)
    check_mixed_tp(ConnectorOptions(decode_tp_size=2), 2, 0, False)
    check_mixed_tp(ConnectorOptions(), 1, 0, False)
    check_mixed_tp(ConnectorOptions(decode_tp_size=2), 1, 8, False)
    check_mixed_tp(ConnectorOptions(decode_tp_size=2), 1, 0, True)
