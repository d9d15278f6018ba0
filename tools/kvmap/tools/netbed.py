"""A multi-node test bed on one machine: network namespaces joined by veth
pairs on a bridge, one "node" per namespace, for the tests and soak scripts
that must cross a real network link instead of loopback.

Each bed has a switch namespace holding a bridge; a node is a namespace with
one interface (``eth0``) whose other end is a port of that bridge, and an
address in 198.18.0.0/15 (the benchmarking range: nothing outside the bed
answers it). Nothing here touches the host's own namespace: its interfaces,
routes and addresses stay as they are. A node's link goes down and up by its
bridge port (``link_down``/``link_up``: the node's packets then go nowhere,
as when a cable or a switch port fails), or loses every packet
(``blackhole``: the link stays up, as for a frozen route), or slows to a
trickle (``throttle``).

Namespaces are named ``kvnb<PID>-<name>``: a bed left behind by a killed
process is removed by the next bed made on the machine (``sweep_stale``),
and ``close`` removes the bed's own. Every command run here is bounded in
time. Creating namespaces needs CAP_SYS_ADMIN and CAP_NET_ADMIN (root, as in
CI): ``unavailable_reason`` says why a bed cannot be made.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

# Every address of a bed lies in this network (RFC 2544's benchmarking range).
BED_NETWORK = ipaddress.ip_network("198.18.0.0/15")
NODE_IFACE = "eth0"
_BRIDGE = "kvbr0"
_PREFIX = "kvnb"
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,15}$")
_COMMAND_TIMEOUT_S = 20.0


class BedError(RuntimeError):
    """A namespace command failed; the message has its argv and stderr."""


def unavailable_reason() -> str:
    """Why a bed cannot be made here ("" when it can)."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_SYS_ADMIN, CAP_NET_ADMIN)"
    probe = f"{_PREFIX}{os.getpid()}-probe"
    made = subprocess.run(
        ["ip", "netns", "add", probe],
        check=False,
        capture_output=True,
        text=True,
        timeout=_COMMAND_TIMEOUT_S,
    )
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(
        ["ip", "netns", "del", probe], check=False, capture_output=True, timeout=_COMMAND_TIMEOUT_S
    )
    return ""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    argv = ["ip", *args]
    done = subprocess.run(
        argv, check=False, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S
    )
    if check and done.returncode != 0:
        raise BedError(f"{' '.join(argv)}: {done.stderr.strip()}")
    return done


def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Remove the namespaces of beds whose process is gone; their names."""
    removed = []
    for ns in _namespaces():
        m = re.match(rf"^{_PREFIX}(\d+)-", ns)
        if m and not _pid_alive(int(m.group(1))):
            _ip("netns", "del", ns, check=False)
            removed.append(ns)
    return removed


@dataclass(frozen=True)
class Node:
    """One namespace of a bed: ``address`` on its ``eth0``, whose other end
    is ``port`` on the bed's bridge."""

    name: str
    netns: str
    address: str
    port: str

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this node's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def hostport(self, port: int) -> str:
        return f"{self.address}:{port}"


@dataclass
class NetBed:
    """A bridge and the nodes on it (``add_node``); ``close`` removes them all."""

    tag: str = ""
    nodes: dict[str, Node] = field(default_factory=dict)
    _switch: str = ""
    _ports: int = 0
    _hosts: int = 0

    def __post_init__(self) -> None:
        sweep_stale()
        base = f"{_PREFIX}{os.getpid()}-{self.tag}" if self.tag else f"{_PREFIX}{os.getpid()}"
        self._base = base
        self._switch = f"{base}-sw"
        _ip("netns", "add", self._switch)
        try:
            _ip("-n", self._switch, "link", "add", _BRIDGE, "type", "bridge")
            _ip("-n", self._switch, "link", "set", _BRIDGE, "up")
        except BaseException:
            _ip("netns", "del", self._switch, check=False)
            raise

    def next_address(self) -> str:
        """A fresh address of the bed's network (never handed out twice by
        this bed: a peer that comes back after a departure gets a new one,
        as a rescheduled pod does)."""
        self._hosts += 1
        # .0.1 upwards; the network's own and broadcast addresses excluded.
        if self._hosts >= BED_NETWORK.num_addresses - 1:
            raise BedError("the bed's network is out of addresses")
        return str(BED_NETWORK.network_address + self._hosts)

    def add_node(self, name: str, address: str = "") -> Node:
        """A namespace with ``eth0`` at ``address`` (a fresh one by default)
        on the bridge, loopback and link up."""
        if not _NAME.match(name) or name in self.nodes:
            raise BedError(f"bad or repeated node name {name!r}")
        address = address or self.next_address()
        if ipaddress.ip_address(address) not in BED_NETWORK:
            raise BedError(f"{address} is outside {BED_NETWORK}")
        netns = f"{self._base}-{name}"
        self._ports += 1
        port = f"p{self._ports}"
        _ip("netns", "add", netns)
        node = Node(name, netns, address, port)
        self.nodes[name] = node
        try:
            _ip(
                "-n",
                self._switch,
                "link",
                "add",
                port,
                "type",
                "veth",
                "peer",
                "name",
                NODE_IFACE,
                "netns",
                netns,
            )
            _ip("-n", self._switch, "link", "set", port, "master", _BRIDGE, "up")
            _ip("-n", netns, "link", "set", "lo", "up")
            _ip("-n", netns, "addr", "add", f"{address}/{BED_NETWORK.prefixlen}", "dev", NODE_IFACE)
            _ip("-n", netns, "link", "set", NODE_IFACE, "up")
        except BaseException:
            self.remove_node(name)
            raise
        return node

    def remove_node(self, name: str) -> None:
        """Delete a node's namespace (its veth pair goes with it)."""
        node = self.nodes.pop(name, None)
        if node is not None:
            _ip("netns", "del", node.netns, check=False)

    def link_down(self, name: str) -> None:
        """The node's bridge port goes down: its packets reach no one."""
        _ip("-n", self._switch, "link", "set", self.nodes[name].port, "down")

    def link_up(self, name: str) -> None:
        _ip("-n", self._switch, "link", "set", self.nodes[name].port, "up")

    def blackhole(self, name: str, on: bool = True) -> None:
        """The node's port leaves the bridge (on) or joins it again: its link
        stays up on both ends and its packets go nowhere, as behind a route
        that went dead (``link_down`` is a cable pulled: the port is down)."""
        port = self.nodes[name].port
        if on:
            _ip("-n", self._switch, "link", "set", port, "nomaster")
        else:
            _ip("-n", self._switch, "link", "set", port, "master", _BRIDGE)

    def throttle(self, name: str, kbit: int) -> None:
        """What the bridge sends the node passes at ``kbit`` kbit/s (a token
        bucket: the kernels here have no netem): a transfer to the node
        takes long enough to act on while it is in flight. The bucket's
        queue holds 100 ms of it: the rest waits in the sender, so a sender
        killed mid-transfer takes its unsent bytes with it."""
        self._tc(name, "replace", "tbf", "rate", f"{int(kbit)}kbit", "burst", "16kb",
                 "latency", "100ms")  # fmt: skip

    def sysctl(self, name: str, key: str, value: str) -> None:
        """Set a namespaced sysctl (``net.ipv4.tcp_wmem``, say) on a node."""
        _ip("netns", "exec", self.nodes[name].netns, "sysctl", "-q", "-w", f"{key}={value}")

    def clear(self, name: str) -> None:
        """No throttle on the node's port."""
        self._tc(name, "del", check=False)

    def _tc(self, name: str, verb: str, *qdisc: str, check: bool = True) -> None:
        """``tc qdisc VERB`` of the node's bridge port's root queue."""
        if shutil.which("tc") is None:
            raise BedError("the tc command (iproute2) is not installed")
        port = self.nodes[name].port
        _ip("netns", "exec", self._switch, "tc", "qdisc", verb, "dev", port, "root", *qdisc,
            check=check)  # fmt: skip

    def close(self) -> None:
        """Remove every namespace of the bed. Idempotent."""
        for name in list(self.nodes):
            self.remove_node(name)
        if self._switch:
            _ip("netns", "del", self._switch, check=False)
            self._switch = ""

    def __enter__(self) -> NetBed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def bed(tag: str = "") -> Iterator[NetBed]:
    """A bed for the ``with`` block, removed afterwards."""
    b = NetBed(tag)
    try:
        yield b
    finally:
        b.close()


def node_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a daemon on a node: UCX over TCP on the node's link only
    (no shared memory or CMA between "nodes" that share a kernel)."""
    out = dict(env)
    out["UCX_NET_DEVICES"] = NODE_IFACE
    out["UCX_TLS"] = "tcp"
    return out
