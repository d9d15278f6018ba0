"""A decode peer whose link goes down before it dies never sends a FIN: the
owner's UCX keeps the connections it accepted from it (UCX arms no
keepalive on those) unless the owner's half-open guard does
(peer_keepalive_s). With it, they are gone within the keepalive's bound;
with it off (0) they are all still there after the same time."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from pairs import Peer, Pulls, loaded, start_decode, start_owner

from kvmap.tools.netbed import NetBed

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

IDLE_S = 4
# Idle, three probes 2 s apart, a sweep's period (1 s) and slack.
BOUND_S = IDLE_S + 6 + 1 + 8


def _connections_from(owner: Peer, address: str) -> int:
    """The owner's TCP connections (any state) whose far end is ``address``."""
    out = subprocess.run(
        owner.node.argv(["ss", "-tan"]), check=False, capture_output=True, text=True, timeout=10
    ).stdout
    return sum(1 for line in out.splitlines()[1:] if f"{address}:" in line.split()[-1])


def _left_after(bed: NetBed, tmp: Path, keepalive_s: int) -> tuple[int, int]:
    """Connections from a vanished peer to the owner: when it vanished, and
    ``BOUND_S`` later."""
    owner = start_owner(
        bed, tmp / str(keepalive_s), "owner", "--peer-keepalive-s", str(keepalive_s)
    )
    peer = start_decode(bed, tmp, f"d{keepalive_s}")
    try:
        for _ in range(2):
            answer, _ = Pulls(owner).pull(peer)
            assert loaded(answer), answer
        bed.link_down(peer.node.name)
        peer.stop()
        bed.remove_node(peer.node.name)
        before = _connections_from(owner, peer.node.address)
        time.sleep(BOUND_S)  # the bound under test: nothing to poll for in the "off" case
        return before, _connections_from(owner, peer.node.address)
    finally:
        owner.stop()
        bed.remove_node("owner")


def test_the_owner_closes_a_vanished_peers_connections_only_with_its_keepalive(
    bed: NetBed, tmp_path: Path
) -> None:
    """With keepalive on, the vanished peer's connections (UCX's and gRPC's, at least one)
    are all closed within idle + 3 probes + a sweep (+ slack); with it off, every one of them
    is still open after the same time."""
    before_on, after_on = _left_after(bed, tmp_path, IDLE_S)
    before_off, after_off = _left_after(bed, tmp_path, 0)
    print(f"\nkeepalive {IDLE_S}s: {before_on} -> {after_on}; off: {before_off} -> {after_off}")
    assert before_on >= 1 and after_on == 0
    assert before_off >= 1 and after_off == before_off
