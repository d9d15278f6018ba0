"""The test bed of these tests: network namespaces on a bridge
(kvmap.tools.netbed; tests/support/netbeds.py says when they skip)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from netbeds import open_bed

from kvmap.tools.netbed import NetBed


@pytest.fixture
def bed() -> Iterator[NetBed]:
    with open_bed("t") as b:
        yield b
