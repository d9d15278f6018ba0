"""adapters.metrics: per-peer series stay bounded, and transfers are
counted by peer and status."""

from __future__ import annotations

from kvmap.daemon.adapters.metrics import MAX_PEER_LABELS, OTHER_PEERS, Metrics


def test_peer_labels_are_bounded() -> None:
    """The first MAX_PEER_LABELS peers get their own label, for good; any
    later one is 'other', so the number of series is bounded."""
    m = Metrics()
    peers = [f"10.0.{i // 256}.{i % 256}:50051" for i in range(MAX_PEER_LABELS + 10)]
    labels = [m.peer_label(p) for p in peers]
    assert labels[:MAX_PEER_LABELS] == peers[:MAX_PEER_LABELS]
    assert set(labels[MAX_PEER_LABELS:]) == {OTHER_PEERS}
    assert m.peer_label(peers[0]) == peers[0]
    for p in peers:
        m.transfer_ended("pull", p, "OK", 0.01)
    series = {
        s.labels["peer"]
        for family in m.registry.collect()
        if family.name == "kvmap_peer_transfers"
        for s in family.samples
        if s.name.endswith("_total")
    }
    assert len(series) == MAX_PEER_LABELS + 1


def test_outcomes_bytes_and_descriptors_by_peer() -> None:
    """A failure is counted under its code without a latency; a success
    with one; bytes go to the peer, descriptors to the per-transfer histogram."""
    m = Metrics()
    m.transfer_ended("pull", "p:1", "FAILED_PRECONDITION")
    m.transfer_ended("pull", "p:1", "OK", 0.5)
    m.transfer_moved("pull", "p:1", 4096, 12)
    get = m.registry.get_sample_value
    assert (
        get("kvmap_peer_transfers_total", {"direction": "pull", "peer": "p:1", "code": "OK"}) == 1
    )
    assert (
        get(
            "kvmap_peer_transfers_total",
            {"direction": "pull", "peer": "p:1", "code": "FAILED_PRECONDITION"},
        )
        == 1
    )
    assert get("kvmap_peer_transfer_seconds_count", {"direction": "pull", "peer": "p:1"}) == 1
    assert get("kvmap_peer_transfer_bytes_total", {"direction": "pull", "peer": "p:1"}) == 4096
    assert get("kvmap_transfer_descriptors_per_transfer_sum", {"direction": "pull"}) == 12


def test_served_transfers_by_peer_are_bounded_and_coded() -> None:
    """The owner's served series count each peer's transfers by code and
    its completed bytes; past MAX_PEER_LABELS peers they share 'other'."""
    m = Metrics()
    m.served("10.0.0.1", "OK", 4096)
    m.served("10.0.0.1", "PERMISSION_DENIED")
    get = m.registry.get_sample_value
    peer = {"peer": "10.0.0.1"}
    assert get("kvmap_served_transfers_total", {**peer, "code": "OK"}) == 1
    assert get("kvmap_served_transfers_total", {**peer, "code": "PERMISSION_DENIED"}) == 1
    assert get("kvmap_served_bytes_total", peer) == 4096
    for i in range(MAX_PEER_LABELS + 5):
        m.served(f"10.1.0.{i}", "OK", 1)
    peers = {
        s.labels["peer"]
        for family in m.registry.collect()
        if family.name == "kvmap_served_transfers"
        for s in family.samples
    }
    assert len(peers) == MAX_PEER_LABELS + 1 and OTHER_PEERS in peers


def test_build_info_and_no_created_series() -> None:
    """kvmap_build_info is 1 with the version as a label, and no counter or
    histogram exports a _created series (prometheus_client's default)."""
    m = Metrics()
    m.transfer_ended("pull", "p:1", "OK", 0.5)
    m.rpcs.labels("kvmap.v1.Peer", "BeginTransfer", "OK").inc()
    samples = [s for family in m.registry.collect() for s in family.samples]
    (build,) = [s for s in samples if s.name == "kvmap_build_info"]
    assert build.value == 1 and build.labels["version"]
    assert [s.name for s in samples if s.name.endswith("_created")] == []
