"""Daemons that die or freeze across a network link: the owner killed with
SIGKILL mid-read and mid-handshake (the decode's pull ends within its
deadline with a network status; once the owner is back, on the same
address with a new agent, the next pull redoes the handshake and loads),
and a peer stopped with SIGSTOP (the other daemon's loop and threads go
on: its health answers at once, it serves other peers, its calls to the
frozen one time out)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from pairs import (
    SLACK_S,
    SLOW_KBIT,
    TIMEOUT_S,
    InFlight,
    Peer,
    Pulls,
    failed_naming,
    health,
    leases,
    loaded,
    start_decode,
    start_owner,
    wait_reading,
)

from kvmap.tools.netbed import NetBed

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def _restarted_owner(bed: NetBed, tmp: Path, old: Peer) -> Peer:
    """A new owner on the old one's node and port (a new agent, new region
    maps): what a sidecar restarted by its pod is."""
    old.stop()
    return start_owner(bed, tmp / "again")


@pytest.mark.parametrize("when", ["mid_read", "mid_handshake"])
def test_an_owner_killed_under_a_pull_fails_it_in_time_and_its_restart_serves_the_next(
    bed: NetBed, tmp_path: Path, when: str
) -> None:
    """Mid-read: the decode's link slowed, the owner killed once it began the transfer.
    Mid-handshake: a decode that never met the owner pulls while the owner is stopped (its
    kernel takes the TCP connection, nothing answers), then the owner is killed. Either way
    the pull ends within the decode's transfer_timeout_s (+ slack) with UNAVAILABLE or
    DEADLINE_EXCEEDED naming the owner and the phase; then a new owner on the same address
    serves the next pull with verified bytes (the decode dropped the old handshake)."""
    # Small send buffers on the owner's node: a killed sender's kernel still
    # sends what its sockets hold, and the whole pull would fit in them.
    bed.add_node("owner")
    bed.sysctl("owner", "net.ipv4.tcp_wmem", "4096 16384 65536")
    owner = start_owner(bed, tmp_path)
    decode = start_decode(bed, tmp_path, "dec")
    pulls = Pulls(owner)
    try:
        if when == "mid_read":
            first, _ = pulls.pull(decode)
            assert loaded(first), first
            bed.throttle("dec", SLOW_KBIT)
            cut = InFlight(decode, pulls.command())
            wait_reading(owner)
        else:
            cmd = pulls.command()
            owner.daemon.proc.send_signal(signal.SIGSTOP)
            cut = InFlight(decode, cmd)
            time.sleep(1.0)  # the pull is waiting on the handshake's answer
        owner.daemon.proc.kill()
        answer, seconds = cut.result()
        print(f"\n{when}: {answer} after {seconds:.2f}s")
        failed_naming(answer, owner)
        if when == "mid_handshake":
            assert "handshake" in answer["message"], answer
        assert seconds <= TIMEOUT_S + SLACK_S, (seconds, answer)
        bed.clear("dec")
        owner = _restarted_owner(bed, tmp_path, owner)
        pulls.owner = owner
        again, seconds = pulls.pull(decode, timeout_s=10.0)
        print(f"after the restart: {again.get('ok')} in {seconds:.2f}s")
        assert loaded(again), again
        assert decode.daemon.proc.poll() is None
    finally:
        decode.stop()
        owner.stop()


def test_a_frozen_decode_peer_stalls_nothing_of_the_owner(bed: NetBed, tmp_path: Path) -> None:
    """A decode daemon stopped (SIGSTOP) with its read in flight: the owner's health answers
    SERVING within 2 s, again and again, and the owner serves another decode's pulls with
    verified bytes meanwhile; the owner's lease of the frozen pull runs out on its own."""
    owner = start_owner(bed, tmp_path)
    frozen = start_decode(bed, tmp_path, "frozen")
    other = start_decode(bed, tmp_path, "other")
    pulls = Pulls(owner)
    try:
        assert loaded(pulls.pull(frozen)[0])
        bed.throttle("frozen", SLOW_KBIT)
        InFlight(frozen, pulls.command())
        wait_reading(owner)
        frozen.daemon.proc.send_signal(signal.SIGSTOP)
        for _ in range(3):
            assert health(owner.daemon, timeout_s=2.0) == "SERVING"
            answer, _ = pulls.pull(other)
            assert loaded(answer), answer
        deadline = time.monotonic() + TIMEOUT_S + 10
        while leases(owner.daemon) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert leases(owner.daemon) == 0
    finally:
        os.kill(frozen.daemon.proc.pid, signal.SIGCONT)
        for p in (frozen, other, owner):
            p.stop()


def test_a_frozen_owner_stalls_nothing_of_the_decode(bed: NetBed, tmp_path: Path) -> None:
    """The owner stopped (SIGSTOP) after one pull: the decode's next pull ends within its
    deadline with a network status naming the owner, and while it waits the decode's health
    answers SERVING within 2 s; the owner resumed (SIGCONT), the next pull loads."""
    owner = start_owner(bed, tmp_path)
    decode = start_decode(bed, tmp_path, "dec")
    pulls = Pulls(owner)
    try:
        assert loaded(pulls.pull(decode)[0])
        cmd = pulls.command()
        owner.daemon.proc.send_signal(signal.SIGSTOP)
        waiting = InFlight(decode, cmd)
        time.sleep(0.5)
        assert health(decode.daemon, timeout_s=2.0) == "SERVING"
        answer, seconds = waiting.result()
        print(f"\nfrozen owner: {answer['code']} after {seconds:.2f}s: {answer['message']}")
        failed_naming(answer, owner)
        assert seconds <= TIMEOUT_S + SLACK_S
        owner.daemon.proc.send_signal(signal.SIGCONT)
        again, _ = pulls.pull(decode, timeout_s=10.0)
        assert loaded(again), again
    finally:
        os.kill(owner.daemon.proc.pid, signal.SIGCONT) if owner.daemon.proc.poll() is None else None
        decode.stop()
        owner.stop()
