"""The multi-node test bed itself: nodes on a bridge reach one another over
their own addresses (198.18.0.0/15) and nothing else, a link taken down
cuts a node off until it is up again, and a closed bed, or one whose
process was killed, leaves no namespace behind."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
import time

import pytest

from kvmap.tools import netbed
from kvmap.tools.netbed import BED_NETWORK, NetBed

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _tcp_reaches(bed: NetBed, src: str, dst: str, timeout_s: float = 2.0) -> bool:
    """A TCP connection from ``src`` to a listener on ``dst`` (both real
    processes inside their namespaces)."""
    d = bed.nodes[dst]
    server = subprocess.Popen(
        d.argv([sys.executable, "-c", _LISTEN, d.address]), stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        client = bed.nodes[src].argv(
            [sys.executable, "-c", _CONNECT, d.address, str(port), str(timeout_s)]
        )
        return subprocess.run(client, check=False, capture_output=True, timeout=30).returncode == 0
    finally:
        server.kill()
        server.wait(10)


def _reaches_within(bed: NetBed, src: str, dst: str, seconds: float) -> bool:
    """Whether TCP from ``src`` reaches ``dst`` within ``seconds`` (a link just
    up: the neighbours' ARP entries for it come back on their own)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if _tcp_reaches(bed, src, dst, 0.5):
            return True
    return False


_LISTEN = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(); print(s.getsockname()[1], flush=True)
while True: s.accept()[0].close()
"""
_CONNECT = """
import socket, sys
socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
"""


def test_nodes_reach_each_other_on_bed_addresses_and_a_downed_link_cuts_one_off(
    bed: NetBed,
) -> None:
    """Three nodes get distinct addresses inside 198.18.0.0/15, each holding only its eth0
    and loopback; TCP crosses the bridge both ways; taking one node's link down cuts it off
    from the others (and only it) until the link is up again."""
    for name in ("a", "b", "c"):
        bed.add_node(name)
    addresses = {n.address for n in bed.nodes.values()}
    assert len(addresses) == 3
    assert all(ipaddress.ip_address(a) in BED_NETWORK for a in addresses)
    links = subprocess.run(
        bed.nodes["a"].argv(["ip", "-o", "link"]),
        check=False,
        capture_output=True,
        text=True,
        timeout=10,
    ).stdout
    assert sorted(line.split(":")[1].strip().split("@")[0] for line in links.splitlines()) == [
        "eth0",
        "lo",
    ]
    assert _tcp_reaches(bed, "a", "b") and _tcp_reaches(bed, "b", "a")
    bed.link_down("c")
    assert not _tcp_reaches(bed, "a", "c", 1.0)
    assert not _tcp_reaches(bed, "c", "a", timeout_s=1.0)
    assert _tcp_reaches(bed, "a", "b", 1.0)
    bed.link_up("c")
    assert _reaches_within(bed, "a", "c", 5.0)


def test_a_blackholed_link_stays_up_and_passes_nothing_until_it_is_back(bed: NetBed) -> None:
    """``blackhole`` cuts the node off with its link still up; off, it is back; ``throttle``
    slows what the node receives (a 64 KiB reply at 256 kbit/s takes over a second)."""
    bed.add_node("a")
    bed.add_node("b")
    bed.blackhole("b")
    state = subprocess.run(
        bed.nodes["b"].argv(["cat", "/sys/class/net/eth0/operstate"]),
        check=False,
        capture_output=True,
        text=True,
        timeout=10,
    ).stdout
    assert state.strip() == "up"
    assert not _tcp_reaches(bed, "a", "b", 1.0)
    bed.blackhole("b", on=False)
    assert _reaches_within(bed, "a", "b", 5.0)
    bed.throttle("b", 256)
    assert _fetch_seconds(bed, "b", "a", 64 * 1024) > 1.0
    bed.clear("b")
    assert _fetch_seconds(bed, "b", "a", 64 * 1024) < 1.0


def _fetch_seconds(bed: NetBed, src: str, dst: str, size: int) -> float:
    """Seconds ``src`` takes to receive ``size`` bytes from a server on ``dst``."""
    d = bed.nodes[dst]
    server = subprocess.Popen(
        d.argv([sys.executable, "-c", _SERVE, d.address, str(size)]),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        port = server.stdout.readline().strip()
        client = bed.nodes[src].argv([sys.executable, "-c", _FETCH, d.address, port])
        out = subprocess.run(client, check=False, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return float(out.stdout)
    finally:
        server.kill()
        server.wait(10)


_SERVE = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(); print(s.getsockname()[1], flush=True)
c = s.accept()[0]; c.sendall(bytes(int(sys.argv[2]))); c.close()
"""
_FETCH = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
t = time.monotonic()
while c.recv(65536): pass
print(time.monotonic() - t)
"""


def test_a_closed_bed_and_a_killed_ones_leave_no_namespace(tmp_path: object) -> None:
    """``close`` removes the bed's namespaces; a bed whose process was killed before it could
    close is swept by the next bed made on the machine."""
    if netbed.unavailable_reason():
        pytest.skip(netbed.unavailable_reason())
    with NetBed("closing") as b:
        b.add_node("x")
        made = {b.nodes["x"].netns, f"{b.nodes['x'].netns.rsplit('-', 1)[0]}-sw"}
        assert made <= set(netbed._namespaces())
    assert not made & set(netbed._namespaces())
    # A child makes a bed and is killed holding it.
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from kvmap.tools.netbed import NetBed; import time\n"
            "b = NetBed('orphan'); b.add_node('y'); print('made', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "made"
    child.kill()
    child.wait(10)
    orphans = [ns for ns in netbed._namespaces() if ns.startswith(f"kvnb{child.pid}-")]
    assert len(orphans) == 2
    assert sorted(netbed.sweep_stale()) == sorted(orphans) or not set(orphans) & set(
        netbed._namespaces()
    )
    assert not set(orphans) & set(netbed._namespaces())
    assert os.getpid() != child.pid
