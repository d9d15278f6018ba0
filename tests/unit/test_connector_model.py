"""``connector.model``: the rules the vLLM facade applies to the model an
engine serves, on plain values (the facade's reading of vLLM's configs is
tested with vLLM in tests/client/test_hybrid_groups.py and
test_pd_compat_stats.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvmap.client.connector.model import (
    ARCHITECTURE_FIELDS,
    architecture_of,
    check_cache_supported,
)


def test_the_architecture_is_the_listed_fields_a_config_has() -> None:
    """Only the listed fields count, absent ones are skipped, and other fields (a vocabulary
    size, a name) never do."""
    config = SimpleNamespace(hidden_size=64, num_key_value_heads=2, vocab_size=5, name="m")
    assert architecture_of(config) == {"hidden_size": 64, "num_key_value_heads": 2}
    assert architecture_of(object()) == {}
    assert "vocab_size" not in ARCHITECTURE_FIELDS


def test_caches_the_connector_cannot_hand_over_are_refused_at_start_up() -> None:
    """Recurrent state needs the hybrid manager and prefix caching off; with the hybrid
    manager a group that replays its window after a load is refused; anything else passes."""
    check_cache_supported(has_state=False, hybrid=False, replaying_groups=[1])
    check_cache_supported(has_state=False, hybrid=True, mamba_cache_mode="align")
    check_cache_supported(has_state=True, hybrid=True, mamba_cache_mode="none")
    with pytest.raises(NotImplementedError, match="disable_hybrid_kv_cache_manager"):
        check_cache_supported(has_state=True, hybrid=False)
    with pytest.raises(NotImplementedError, match="mamba_cache_mode 'none', not 'all'"):
        check_cache_supported(has_state=True, hybrid=True, mamba_cache_mode="all")
    with pytest.raises(NotImplementedError, match="group 2 replays its sliding window"):
        check_cache_supported(has_state=False, hybrid=True, replaying_groups=[2])
