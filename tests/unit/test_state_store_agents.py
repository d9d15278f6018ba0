"""The daemon's record of its own NIXL agents across restarts: each start
stores its agent and learns the ones before it, newest first, at most
``keep``; a damaged record reads as none rather than failing the start."""

from __future__ import annotations

from pathlib import Path

from kvmap.daemon.adapters.state_store import StateStore


def test_each_start_learns_the_agents_before_it(tmp_path: Path) -> None:
    """Five starts on one state dir: each hears the earlier agents, newest
    first, at most two; the same agent again is not its own predecessor."""
    seen = []
    for n in range(5):
        store = StateStore(str(tmp_path))
        seen.append(store.record_agent(f"kvmapd-{n}", keep=2))
        store.close()
    assert seen == [[], ["kvmapd-0"], ["kvmapd-1", "kvmapd-0"], ["kvmapd-2", "kvmapd-1"],
                    ["kvmapd-3", "kvmapd-2"]]  # fmt: skip
    store = StateStore(str(tmp_path))
    assert store.record_agent("kvmapd-4", keep=2) == ["kvmapd-3", "kvmapd-2"]


def test_a_damaged_record_reads_as_no_previous_agent(tmp_path: Path) -> None:
    """A record that is not a JSON list of names yields none and is replaced."""
    for bad in ("{not json", '{"a": 1}', '[1, "", "kvmapd-ok"]'):
        store = StateStore(str(tmp_path))
        store._db.execute("INSERT OR REPLACE INTO meta VALUES ('agents', ?)", (bad,))
        expected = ["kvmapd-ok"] if "ok" in bad else []
        assert store.record_agent("kvmapd-new", keep=4) == expected
        assert store.record_agent("kvmapd-newer", keep=4) == ["kvmapd-new", *expected]
        store.close()
