"""What a running daemon holds, read from outside it: its RSS and open file
descriptors from /proc, its leases and remote NIXL agents from
``Admin.GetStatus`` on its Unix socket (which crosses network namespaces:
a daemon on a test bed's node is still reachable this way)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import grpc

from kvmap.tools.launch import DaemonProc
from kvmap.v1 import admin_pb2, admin_pb2_grpc


def rss_kib(pid: int) -> int:
    """The process's resident set (VmRSS), in KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise ProcessLookupError(f"no VmRSS for pid {pid}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@dataclass(frozen=True)
class OwnerSample:
    rss_kib: int
    fds: int
    leases: int
    remote_agents: int
    transfers_failed: int
    lease_list: tuple[admin_pb2.LeaseStatus, ...] = field(default=(), repr=False)

    def figures(self) -> dict[str, int]:
        return {
            "rss_kib": self.rss_kib,
            "fds": self.fds,
            "leases": self.leases,
            "remote_agents": self.remote_agents,
        }


class OwnerProbe:
    """Samples one daemon (its own channel, reused)."""

    def __init__(self, daemon: DaemonProc, timeout_s: float = 10.0) -> None:
        self._daemon = daemon
        self._timeout_s = timeout_s
        self._channel = grpc.insecure_channel(daemon.unix_target)
        self._admin = admin_pb2_grpc.AdminStub(self._channel)

    def sample(self, with_leases: bool = False) -> OwnerSample:
        pid = self._daemon.proc.pid
        status = self._admin.GetStatus(admin_pb2.GetStatusRequest(), timeout=self._timeout_s)
        return OwnerSample(
            rss_kib=rss_kib(pid),
            fds=open_fds(pid),
            leases=status.leases_total,
            remote_agents=status.stats.remote_agents,
            transfers_failed=status.stats.transfers.failed,
            lease_list=tuple(status.leases) if with_leases else (),
        )

    def close(self) -> None:
        self._channel.close()
