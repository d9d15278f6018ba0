"""Which vLLM KV cache configs are read whole from one prefill rank when TP
sizes differ (``TpSplit.of_model`` over ``layer_specs``; needs the vllm
package)."""

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
    from kvmap.client.connector.tp_mapping import TpSplit
    from kvmap.client.vllm_connector import layer_specs

    def replicated_of(config: object) -> bool:
        kinds = [spec.cache_kind for spec in layer_specs(config).values()]
        return TpSplit.of_model(use_mla=True, total_kv_heads=1, cache_kinds=kinds).replicated

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
