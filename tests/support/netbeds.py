"""A test bed (kvmap.tools.netbed) for a test: where none can be made the
test skips and says why, except in CI (``KVMAP_REQUIRE_NETBED=1``, set by
``.ci/check``), where it fails: CI runs as root and must run these tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from kvmap.tools.netbed import NetBed, unavailable_reason

REQUIRE_ENV = "KVMAP_REQUIRE_NETBED"


@contextmanager
def open_bed(tag: str) -> Iterator[NetBed]:
    """A bed of its own namespaces, removed on the way out."""
    reason = unavailable_reason()
    if reason:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"no network namespaces here, and CI needs them: {reason}")
        pytest.skip(f"no network namespaces here: {reason}")
    with NetBed(tag) as bed:
        yield bed
