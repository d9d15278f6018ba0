"""``core.grants.check_replaced_agents``: the agents a BeginTransfer names
as replaced are hostile input, accepted exactly when bounded in count and
length, non-empty and other than the caller."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmap.core.errors import InvalidArgument
from kvmap.core.grants import MAX_AGENT_NAME, MAX_REPLACED_AGENTS, check_replaced_agents

CALLER = "kvmapd-new"
names = st.text(max_size=MAX_AGENT_NAME + 2) | st.just(CALLER) | st.just("")


@given(st.lists(names, max_size=MAX_REPLACED_AGENTS + 2))
def test_accepted_exactly_when_bounded_nonempty_and_not_the_caller(given_names: list[str]) -> None:
    """Accepted (as the set of names) iff at most MAX_REPLACED_AGENTS names,
    each 1..MAX_AGENT_NAME characters and not the caller; else INVALID_ARGUMENT."""
    valid = len(given_names) <= MAX_REPLACED_AGENTS and all(
        0 < len(n) <= MAX_AGENT_NAME and n != CALLER for n in given_names
    )
    if valid:
        assert check_replaced_agents(given_names, CALLER) == frozenset(given_names)
    else:
        with pytest.raises(InvalidArgument) as err:
            check_replaced_agents(given_names, CALLER)
        assert err.value.field.startswith("replaces_agents")
