"""The daemon freezes its start-up heap: objects alive at that point leave
the collector's generations, so a full collection under load walks only
what came later."""

from __future__ import annotations

import gc

from kvmap.daemon.api.server import freeze_startup_heap


def test_objects_alive_at_start_are_frozen_and_later_ones_are_not() -> None:
    """An object made before the call is frozen (no generation holds it);
    one made after it is tracked in generation 0 as usual."""
    before = [object() for _ in range(3)]
    try:
        frozen = freeze_startup_heap()
        # Only fewer after the call: another thread of this test process (a
        # span exporter, a gRPC poller) may free frozen objects meanwhile.
        assert 1 <= gc.get_freeze_count() <= frozen
        tracked = {id(o) for gen in range(3) for o in gc.get_objects(generation=gen)}
        assert id(before) not in tracked
        after: list[object] = []
        assert id(after) in {id(o) for o in gc.get_objects(generation=0)}
    finally:
        gc.unfreeze()
