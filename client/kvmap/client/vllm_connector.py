"""The module path vLLM loads the connector from (``kv_connector_module_path
="kvmap.client.vllm_connector"``, ``kv_connector="KVMapConnector"``): the
connector lives in ``kvmap.client.connector.vllm``, re-exported here so the
documented path keeps working."""

from kvmap.client.connector.vllm import (
    KVMapConnector,
    KVMapConnectorMetadata,
    cache_kind_of,
    check_hybrid_supported,
    check_kv_cache_supported,
    group_windows,
    layer_specs,
    model_identity_of,
    tp_split_of,
)

__all__ = [
    "KVMapConnector",
    "KVMapConnectorMetadata",
    "cache_kind_of",
    "check_hybrid_supported",
    "check_kv_cache_supported",
    "group_windows",
    "layer_specs",
    "model_identity_of",
    "tp_split_of",
]
