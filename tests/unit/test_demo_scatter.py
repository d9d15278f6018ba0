"""The demo's scattered block ids (``kvmap.tools.demo._scattered``)."""

from __future__ import annotations

import random
import threading

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from kvmap.tools.demo import _scattered


@settings(max_examples=examples(300), deadline=None)
@given(seed=st.integers(0, 2**32), n_blocks=st.integers(1, 300), data=st.data())
def test_count_distinct_block_ids_in_range(seed: int, n_blocks: int, data: st.DataObject) -> None:
    """Any count up to the pool's size: that many distinct ids, each in the pool."""
    count = data.draw(st.integers(1, n_blocks))
    ids = _scattered(random.Random(seed), n_blocks, count)
    assert len(ids) == count == len(set(ids))
    assert all(0 <= b < n_blocks for b in ids)


def test_the_demos_default_run_of_500_requests_over_24_blocks_ends() -> None:
    """The demo's own sequence (seed 7, 24 blocks, a pair of draws per request) for 500
    requests: it once looped forever at the 36th, with the demo then deaf to all but SIGKILL."""
    rng = random.Random(7)
    done = threading.Event()

    def requests() -> None:
        for _ in range(500):
            n = rng.randint(1, 8)
            _scattered(rng, 24, n)
            _scattered(rng, 24, n)
        done.set()

    threading.Thread(target=requests, daemon=True).start()
    assert done.wait(30), "the 500 requests' block ids were not drawn within 30 s"
