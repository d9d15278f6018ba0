"""An in-memory NIXL for the engine's tests: agents of one process on one
``FakeNetwork``, implementing ``nixl_port.NixlPort``.

What it keeps of NIXL's contract (``nixl_agent`` documents the real one):

* memory is registered as (address, size, device, memory type) ranges, and a
  peer sees them only through metadata it loaded (``add_remote``), as of
  when that metadata was taken;
* every descriptor, local or remote, must lie inside one registered range of
  its side, with the list's memory type and device: otherwise NotFound, as
  NIXL answers;
* READ copies remote -> local, WRITE local -> remote, with ``ctypes.memmove``
  between the real addresses, when the initiator polls (a transfer is PROC
  until then); the transfer's notification, and ``send_notif``'s, reach the
  other agent's ``take_notifs``;
* a peer that closed or was ``kill``-ed (its process died) is Unavailable
  from the next post or notification, and a transfer in flight to it fails
  (ERR, ``xfer.error`` Unavailable); memory the peer deregistered since fails
  a transfer the same way NIXL's backend does (TransferError).

``FakeNetwork.hold()`` keeps posted transfers in flight until ``release_held``,
so a test can look at the daemon while one is outstanding.
"""

from __future__ import annotations

import ctypes
import json
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvmap.core.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    TransferError,
    Unavailable,
)
from kvmap.daemon.adapters.nixl_port import (
    DlistHandle,
    IndexArray,
    MemoryType,
    Registration,
    Xfer,
    XferOp,
    XferState,
)

# (address, length, dev_id, memory type) of a registered range or a descriptor.
Span = tuple[int, int, int, str]


@dataclass
class _Posted:
    """A posted transfer: descriptor pairs (local, remote) and its notification."""

    pairs: list[tuple[Span, Span]]
    notif: bytes


@dataclass
class FakeNetwork:
    """Agents by name; ``kill`` makes one vanish as if its process died."""

    agents: dict[str, FakeAgent] = field(default_factory=dict)
    dead: set[str] = field(default_factory=set)
    posts: int = 0
    # Set by every post: a test waits on it for a transfer to be in flight.
    posted: threading.Event = field(default_factory=threading.Event)
    _gate: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._gate.set()

    def agent(self, name: str) -> FakeAgent:
        """An ``AgentFactory``: a new agent on this network."""
        if name in self.agents and name not in self.dead:
            raise AlreadyExists(f"agent {name!r} exists on this network")
        self.dead.discard(name)
        self.agents[name] = FakeAgent(name, self)
        return self.agents[name]

    def kill(self, name: str) -> None:
        self.dead.add(name)

    def hold(self) -> None:
        """Keep every transfer in flight (PROC) until ``release_held``."""
        self._gate.clear()

    def release_held(self) -> None:
        self._gate.set()

    @property
    def holding(self) -> bool:
        return not self._gate.is_set()

    def live(self, name: str) -> FakeAgent:
        peer = self.agents.get(name)
        if peer is None or name in self.dead or peer.closed:
            raise Unavailable(f"NIXL_ERR_REMOTE_DISCONNECT: agent {name!r} is gone")
        return peer


class FakeAgent:
    """One agent. Like ``NixlAgent``, not to be called from two threads at
    once (the daemon calls it from its NIXL thread only)."""

    def __init__(self, name: str, network: FakeNetwork) -> None:
        self.name = name
        self.network = network
        self.closed = False
        self._regs: list[Registration] = []
        self._remotes: dict[str, list[Span]] = {}
        self._dlists: set[DlistHandle] = set()
        self._xfers: set[Xfer] = set()
        self._inbox: dict[str, list[bytes]] = {}
        self._lock = threading.Lock()

    # -- memory ---------------------------------------------------------------

    @property
    def registrations(self) -> tuple[Registration, ...]:
        return tuple(self._regs)

    @property
    def threads(self) -> int:
        return 0  # no UCX here

    @property
    def live_dlists(self) -> tuple[DlistHandle, ...]:
        return tuple(self._dlists)

    @property
    def remotes(self) -> tuple[str, ...]:
        return tuple(self._remotes)

    def register(
        self, address: int, size: int, dev_id: int = 0, mem_type: MemoryType = MemoryType.DRAM
    ) -> Registration:
        self._check_open()
        for other in self._regs:
            if (other.address, other.size, other.dev_id, other.mem_type) == (
                address,
                size,
                dev_id,
                mem_type,
            ):
                other.refs += 1
                return other
            if address < other.address + other.size and other.address < address + size:
                raise AlreadyExists(f"{size} bytes at {address:#x} overlap a registration")
        reg = Registration(address, size, dev_id, mem_type, None)
        self._regs.append(reg)
        return reg

    def deregister(self, reg: Registration) -> None:
        if not reg.active:
            return
        reg.refs -= 1
        if reg.refs == 0:
            reg.active = False
            self._regs.remove(reg)

    def spans(self) -> list[Span]:
        return [(r.address, r.size, r.dev_id, r.mem_type.value) for r in self._regs]

    # -- metadata -------------------------------------------------------------

    def metadata(self) -> bytes:
        self._check_open()
        return json.dumps({"name": self.name, "spans": self.spans()}).encode()

    def add_remote(self, metadata: bytes) -> str:
        self._check_open()
        try:
            md = json.loads(metadata)
            name = str(md["name"])
            spans: list[Span] = [(int(a), int(n), int(d), str(m)) for a, n, d, m in md["spans"]]
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidArgument("metadata", f"NIXL_ERR_INVALID_PARAM: {e}") from e
        self._remotes[name] = spans
        return name

    def remove_remote(self, name: str) -> None:
        self._check_open()
        self._remotes.pop(name, None)

    # -- descriptor lists -----------------------------------------------------

    def prep_local(
        self, rows: npt.ArrayLike, mem_type: MemoryType = MemoryType.DRAM
    ) -> DlistHandle:
        self._check_open()
        descs = _inside(_expand(rows), mem_type, self.spans(), "prep_local")
        return self._keep(DlistHandle("", mem_type, len(descs), descs))

    def prep_remote(
        self, agent: str, rows: npt.ArrayLike, mem_type: MemoryType = MemoryType.DRAM
    ) -> DlistHandle:
        self._check_open()
        spans = self._remotes.get(agent)
        if spans is None:
            raise NotFound(f"prep_remote(agent {agent!r}): NIXL_ERR_NOT_FOUND: no metadata")
        descs = _inside(_expand(rows), mem_type, spans, f"prep_remote(agent {agent!r})")
        return self._keep(DlistHandle(agent, mem_type, len(descs), descs))

    def _keep(self, dlist: DlistHandle) -> DlistHandle:
        self._dlists.add(dlist)
        return dlist

    def release_dlist(self, dlist: DlistHandle) -> None:
        if dlist.released:
            return
        dlist.released = True
        self._dlists.discard(dlist)

    # -- transfers ------------------------------------------------------------

    def post_prepped(
        self,
        op: XferOp,
        local: DlistHandle,
        local_idx: IndexArray,
        remote: DlistHandle,
        remote_idx: IndexArray,
        *,
        notif: bytes = b"",
    ) -> Xfer:
        self._check_open()
        if not local.local or local not in self._dlists:
            raise InvalidArgument("local", "not a live local descriptor list of this agent")
        if remote.local or remote not in self._dlists:
            raise InvalidArgument("remote", "not a live remote descriptor list of this agent")
        li, ri = list(np.asarray(local_idx)), list(np.asarray(remote_idx))
        if len(li) != len(ri) or not li:
            raise InvalidArgument("remote_idx", f"{len(ri)} remote indices for {len(li)} local")
        pairs = [
            (local._handle[int(a)], remote._handle[int(b)]) for a, b in zip(li, ri, strict=True)
        ]
        return self._post(op, remote.agent, pairs, notif)

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
    ) -> Xfer:
        self._check_open()
        spans = self._remotes.get(remote_agent)
        if spans is None:
            raise NotFound(f"{op.value} with agent {remote_agent!r}: NIXL_ERR_NOT_FOUND")
        local = _inside(_expand(local_rows, (3,)), mem_type, self.spans(), "post_descs")
        remote = _inside(
            _expand(remote_rows, (3,)), remote_mem_type or mem_type, spans, "post_descs"
        )
        if len(local) != len(remote):
            raise InvalidArgument("remote_rows", f"{len(remote)} remote for {len(local)} local")
        return self._post(op, remote_agent, list(zip(local, remote, strict=True)), notif)

    def _post(
        self, op: XferOp, remote_agent: str, pairs: list[tuple[Span, Span]], notif: bytes
    ) -> Xfer:
        for i, (a, b) in enumerate(pairs):
            if a[1] != b[1]:
                raise InvalidArgument(f"pair[{i}]", "NIXL_ERR_MISMATCH: lengths differ")
        self.network.live(remote_agent)  # a vanished peer fails the post at once
        self.network.posts += 1
        self.network.posted.set()
        xfer = Xfer(op, remote_agent, len(pairs), time.monotonic(), _Posted(pairs, notif))
        self._xfers.add(xfer)
        return xfer

    def poll(self, xfer: Xfer) -> XferState:
        if xfer.state is not XferState.PROC:
            return xfer.state
        if xfer.released:
            raise FailedPrecondition("poll: transfer was released")
        if self.network.holding:
            return XferState.PROC
        try:
            self._carry_out(xfer)
        except (Unavailable, TransferError) as e:
            xfer.state, xfer.error = XferState.ERR, e
            return xfer.state
        xfer.state = XferState.DONE
        return xfer.state

    def _carry_out(self, xfer: Xfer) -> None:
        peer = self.network.live(xfer.remote_agent)
        posted: _Posted = xfer._handle
        theirs = peer.spans()
        for _, remote in posted.pairs:
            if not any(_within(remote, s) for s in theirs):
                raise TransferError(
                    f"{xfer.op.value} with agent {xfer.remote_agent!r}: NIXL_ERR_BACKEND: "
                    f"remote memory at {remote[0]:#x} is no longer registered",
                    nixl_status="NIXL_ERR_BACKEND",
                )
        for local, remote in posted.pairs:
            src, dst = (remote, local) if xfer.op is XferOp.READ else (local, remote)
            ctypes.memmove(dst[0], src[0], src[1])
        if posted.notif:
            peer.deliver(self.name, posted.notif)

    def release(self, xfer: Xfer) -> None:
        xfer.released = True
        self._xfers.discard(xfer)

    @property
    def in_flight(self) -> tuple[Xfer, ...]:
        return tuple(self._xfers)

    # -- notifications --------------------------------------------------------

    def send_notif(self, agent: str, msg: bytes) -> None:
        self._check_open()
        if agent not in self._remotes:
            raise NotFound(f"send_notif(agent {agent!r}): NIXL_ERR_NOT_FOUND")
        self.network.live(agent).deliver(self.name, msg)

    def deliver(self, sender: str, msg: bytes) -> None:
        with self._lock:  # senders run on other daemons' NIXL threads
            self._inbox.setdefault(sender, []).append(msg)

    def take_notifs(self) -> dict[str, list[bytes]]:
        self._check_open()
        with self._lock:
            notifs, self._inbox = self._inbox, {}
        return notifs

    # -- lifecycle ------------------------------------------------------------

    def close(self) -> None:
        for xfer in list(self._xfers):
            self.release(xfer)
        for dlist in list(self._dlists):
            self.release_dlist(dlist)
        for reg in list(self._regs):
            reg.refs = 1
            self.deregister(reg)
        self.closed = True

    def _check_open(self) -> None:
        if self.closed:
            raise FailedPrecondition(f"agent {self.name!r} is closed")


def _expand(rows: npt.ArrayLike, widths: tuple[int, ...] = (3, 5)) -> list[tuple[int, int, int]]:
    """Nx3 (address, len, dev) rows, or Nx5 strided ones (… stride, count),
    as one (address, len, dev) per descriptor, in list order."""
    arr = np.asarray(rows, dtype=np.int64)
    if arr.ndim != 2 or arr.shape[1] not in widths or arr.shape[0] == 0:
        raise InvalidArgument("rows", f"expected a non-empty Nx{widths} array, got {arr.shape}")
    if arr.shape[1] == 3:
        return [(int(a), int(n), int(d)) for a, n, d in arr]
    return [
        (int(a) + b * int(stride), int(n), int(d))
        for a, n, d, stride, count in arr
        for b in range(int(count))
    ]


def _within(desc: Span, span: Span) -> bool:
    return desc[2:] == span[2:] and span[0] <= desc[0] and desc[0] + desc[1] <= span[0] + span[1]


def _inside(
    descs: list[tuple[int, int, int]], mem_type: MemoryType, spans: list[Span], what: str
) -> list[Span]:
    out: list[Span] = []
    for i, (address, length, dev) in enumerate(descs):
        desc = (address, length, dev, mem_type.value)
        if not any(_within(desc, s) for s in spans):
            raise NotFound(
                f"{what}: NIXL_ERR_NOT_FOUND: descriptor {i} ({length} bytes at {address:#x},"
                f" {mem_type.value} {dev}) is not inside registered memory"
            )
        out.append(desc)
    return out


def read(address: int, size: int) -> bytes:
    return ctypes.string_at(address, size)


__all__ = ["FakeAgent", "FakeNetwork", "read"]
