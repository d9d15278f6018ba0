"""What the engine needs from a NIXL agent, without importing NIXL.

``NixlPort`` is the seam between the engine and ``nixl_agent.NixlAgent``
(the real agent, over NIXL and UCX); the engine's tests run it over an
in-memory fake (``tests/support/fake_nixl.py``) that keeps the same contract:
errors from ``kvmap.core.errors`` as documented in ``nixl_agent``,
transfers that complete through ``poll``, notifications through
``take_notifs``. The value types that cross the seam live here too.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kvmap.core.errors import TransferError, Unavailable

IndexArray = Sequence[int] | npt.NDArray[np.integer[Any]]


class MemoryType(enum.Enum):
    DRAM = "DRAM"
    VRAM = "VRAM"


class Backend(enum.Enum):
    UCX = "UCX"


class XferOp(enum.Enum):
    READ = "READ"  # remote -> local
    WRITE = "WRITE"  # local -> remote


class XferState(enum.Enum):
    PROC = "PROC"
    DONE = "DONE"
    ERR = "ERR"


@dataclass(eq=False)
class Registration:
    """One registered allocation. Keep it to deregister."""

    address: int
    size: int
    dev_id: int
    mem_type: MemoryType
    _dlist: Any = field(repr=False)
    active: bool = True
    # Registrations of the very same span (a CUDA IPC block a worker
    # registered again maps at the same address) share one NIXL registration.
    refs: int = 1


@dataclass(eq=False)
class DlistHandle:
    """A prepared descriptor list. ``agent`` is ``""`` for a local list."""

    agent: str
    mem_type: MemoryType
    num_descs: int
    _handle: Any = field(repr=False)
    released: bool = False

    @property
    def local(self) -> bool:
        return self.agent == ""


@dataclass(eq=False)
class Xfer:
    """One posted transfer. ``state`` is the last polled state."""

    op: XferOp
    remote_agent: str
    num_descs: int
    posted_at: float
    _handle: Any = field(repr=False)
    state: XferState = XferState.PROC
    error: TransferError | Unavailable | None = None
    released: bool = False
    # Progress passes that polled it (written by the NIXL thread only): a
    # transfer that outlives its deadline says whether it was polled at all.
    polls: int = 0


class NixlPort(Protocol):
    """The calls the engine makes on its agent (``NixlAgent`` documents each).

    Not thread-safe by contract: the engine makes every call on its one NIXL
    thread (``nixl_thread``)."""

    @property
    def registrations(self) -> tuple[Registration, ...]: ...
    @property
    def threads(self) -> int: ...

    def register(
        self, address: int, size: int, dev_id: int = 0, mem_type: MemoryType = MemoryType.DRAM
    ) -> Registration: ...
    def deregister(self, reg: Registration) -> None: ...
    def metadata(self) -> bytes: ...
    def add_remote(self, metadata: bytes) -> str: ...
    def remove_remote(self, name: str) -> None: ...
    def prep_local(
        self, rows: npt.ArrayLike, mem_type: MemoryType = MemoryType.DRAM
    ) -> DlistHandle: ...
    def prep_remote(
        self, agent: str, rows: npt.ArrayLike, mem_type: MemoryType = MemoryType.DRAM
    ) -> DlistHandle: ...
    def release_dlist(self, dlist: DlistHandle) -> None: ...
    def post_prepped(
        self,
        op: XferOp,
        local: DlistHandle,
        local_idx: IndexArray,
        remote: DlistHandle,
        remote_idx: IndexArray,
        *,
        notif: bytes = b"",
    ) -> Xfer: ...
    def post_descs(
        self,
        op: XferOp,
        local_rows: npt.ArrayLike,
        remote_rows: npt.ArrayLike,
        remote_agent: str,
        *,
        notif: bytes = b"",
        mem_type: MemoryType = MemoryType.DRAM,
        remote_mem_type: MemoryType | None = None,
    ) -> Xfer: ...
    def poll(self, xfer: Xfer) -> XferState: ...
    def release(self, xfer: Xfer) -> None: ...
    def send_notif(self, agent: str, msg: bytes) -> None: ...
    def take_notifs(self) -> dict[str, list[bytes]]: ...
    def close(self) -> None: ...


# Creates the daemon's agent under a name (``NixlAgent.create`` in kvmapd).
AgentFactory = Callable[[str], NixlPort]

__all__ = [
    "AgentFactory",
    "Backend",
    "DlistHandle",
    "IndexArray",
    "MemoryType",
    "NixlPort",
    "Registration",
    "Xfer",
    "XferOp",
    "XferState",
]
