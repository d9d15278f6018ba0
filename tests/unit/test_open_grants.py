"""Open grants, the pure part (``core.grants``): how a declared reader count
fixes an open grant's uses, how a fixed one refuses another count, and what
a released use spends; every input in range and out of it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmap.core import grants as core
from kvmap.core.errors import FailedPrecondition, InvalidArgument
from kvmap.core.geometry import WorkerKey


def grant(max_uses: int, uses: int = 0) -> core.Grant:
    return core.Grant(
        digest=b"d" * 32,
        worker=WorkerKey("prefill", 0, 0, 0),
        generation=1,
        request_id="r",
        blocks={0: np.array([1, 2], dtype=np.int64)},
        expires_unix_ms=10,
        max_uses=max_uses,
        uses=uses,
    )


READERS = st.integers(min_value=-(2**33), max_value=2**33)
IN_RANGE = st.integers(min_value=0, max_value=core.MAX_USES)


@given(readers=READERS)
def test_an_open_grant_takes_the_declared_count(readers: int) -> None:
    """An open grant: a declared count in [1, 64] becomes its use count, none (0) makes it 1,
    anything else is INVALID_ARGUMENT; no use is spent by declaring."""
    g = grant(core.OPEN_USES)
    assert g.open and not g.exhausted
    if not 0 <= readers <= core.MAX_USES:
        with pytest.raises(InvalidArgument, match="readers"):
            core.declare_readers(g, readers)
        return
    fixed = core.declare_readers(g, readers)
    assert (fixed.max_uses, fixed.uses, fixed.open) == (readers or 1, 0, False)


@given(max_uses=st.integers(min_value=1, max_value=core.MAX_USES), readers=IN_RANGE)
def test_a_fixed_grant_refuses_another_count(max_uses: int, readers: int) -> None:
    """A fixed grant admits a claim declaring nothing or its own count, unchanged; another
    count is FAILED_PRECONDITION naming both."""
    g = grant(max_uses)
    if readers in (0, max_uses):
        assert core.declare_readers(g, readers) == g
    else:
        with pytest.raises(FailedPrecondition, match=f"admits {max_uses} readers"):
            core.declare_readers(g, readers)


@given(max_uses=st.integers(min_value=0, max_value=core.MAX_USES), readers=IN_RANGE)
def test_a_release_spends_one_use(max_uses: int, readers: int) -> None:
    """A release spends one use of the count it declares; declaring no reader uses up an
    open grant at once and is refused by a fixed one."""
    g = grant(max_uses)
    if readers == 0 and not g.open:
        with pytest.raises(FailedPrecondition, match="declared none"):
            core.release_use(g, readers)
        return
    if readers and not g.open and readers != max_uses:
        with pytest.raises(FailedPrecondition):
            core.release_use(g, readers)
        return
    after = core.release_use(g, readers)
    assert after.uses == 1
    assert after.max_uses == (readers or 1 if g.open else max_uses)
    assert after.exhausted == (after.max_uses == 1)


def test_grant_uses_of_an_open_grant() -> None:
    """open_uses needs max_uses 0 (stored as OPEN_USES); without it max_uses is as before."""
    assert core.check_grant_uses(0, True) == core.OPEN_USES
    assert core.check_grant_uses(0, False) == 1
    assert core.check_grant_uses(5, False) == 5
    with pytest.raises(InvalidArgument, match="must be 0 for an open grant"):
        core.check_grant_uses(2, True)
    assert grant(2, 2).exhausted and not grant(2, 1).exhausted
