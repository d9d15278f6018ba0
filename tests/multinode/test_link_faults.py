"""A link that fails under a pull, across a real network link between two
nodes of a test bed (UCX over TCP, gRPC on the nodes' addresses): the pull
ends within its deadline with UNAVAILABLE or DEADLINE_EXCEEDED naming the
peer and the phase, the owner frees its lease, and once the link is back
the next pull succeeds within 5 s with neither daemon restarted."""

from __future__ import annotations

from pathlib import Path

import pytest
from pairs import (
    SLACK_S,
    SLOW_KBIT,
    TIMEOUT_S,
    InFlight,
    Pulls,
    failed_naming,
    loaded,
    start_decode,
    start_owner,
    wait_no_lease,
    wait_reading,
)

from kvmap.tools.netbed import NetBed

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


@pytest.mark.parametrize("fault", ["link_down", "blackhole"])
def test_a_pull_cut_by_its_link_fails_in_time_and_the_link_back_serves_the_next(
    bed: NetBed, tmp_path: Path, fault: str
) -> None:
    """The decode's link slowed so that its read is in flight, then cut (its port down, or
    its packets dropped with the link up): the pull fails within the decode daemon's
    transfer_timeout_s (+ slack) with a network status naming the owner's address and the
    phase; the owner's lease is gone within the lease's own deadline; with the link back,
    a pull with a 5 s deadline loads verified bytes; no daemon restarted."""
    owner = start_owner(bed, tmp_path)
    decode = start_decode(bed, tmp_path, "dec")
    pulls = Pulls(owner)
    try:
        first, _ = pulls.pull(decode)
        assert loaded(first), first  # the handshake is cached from here on
        bed.throttle("dec", SLOW_KBIT)
        cut = InFlight(decode, pulls.command())
        wait_reading(owner)
        if fault == "link_down":
            bed.link_down("dec")
        else:
            bed.blackhole("dec")
        answer, seconds = cut.result()
        print(f"\n{fault}: {answer['code']} after {seconds:.2f}s: {answer['message']}")
        failed_naming(answer, owner)
        assert seconds <= TIMEOUT_S + SLACK_S, (seconds, answer)
        assert wait_no_lease(owner.daemon, TIMEOUT_S + SLACK_S), "the owner kept the lease"
        if fault == "link_down":
            bed.link_up("dec")
        else:
            bed.blackhole("dec", on=False)
        bed.clear("dec")
        again, seconds = pulls.pull(decode, timeout_s=5.0)
        print(f"the next pull: {again.get('ok')} after {seconds:.2f}s")
        assert loaded(again), again
        assert owner.daemon.proc.poll() is None and decode.daemon.proc.poll() is None
    finally:
        decode.stop()
        owner.stop()
