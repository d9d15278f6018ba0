"""The NIXL adapter: with ``nixl_loader``, the only module in kvmap that imports NIXL.

``NixlAgent`` wraps one ``nixl_agent`` with the UCX backend. Everything that
crosses this boundary is ours: enums for memory types, backends, operations
and transfer states, numpy descriptor rows, and the project's error tree.

Progress
--------
Agents are created without NIXL's progress thread by default: that thread
spins a whole core even when idle (see ``kvmap.tools.nixl_progress``). Without
it, UCX makes progress only inside our calls, and *both* sides must call in:
a transfer completes only after the initiator polls it (``poll``) *and* the
target agent's worker has progressed (measured: a READ over CMA stalls
forever while the target process makes no NIXL call). So the daemon must
call ``take_notifs()`` regularly even when it initiates nothing; it drives
the worker and returns the notifications that arrived. The target's polling
interval is the floor of every transfer's latency.

Threads
-------
NIXL runs here in its ``NIXL_THREAD_SYNC_NONE`` mode and its bindings release
the GIL (a 1M-descriptor prep runs while other Python threads run), so every
call into NIXL takes this object's lock: the daemon may prep large lists in a
worker thread while its event loop polls.

Error mapping
-------------
NIXL's bindings raise one exception class per ``nixl_status_t``; the Python
layer returns the strings ``"DONE"``, ``"PROC"`` and ``"ERR"``. They become:

==========================  ==========================  ======================
NIXL raises / returns       NIXL status                 kvmap error
==========================  ==========================  ======================
nixlInvalidParamError       NIXL_ERR_INVALID_PARAM      InvalidArgument
nixlMismatchError           NIXL_ERR_MISMATCH           InvalidArgument
nixlNotFoundError           NIXL_ERR_NOT_FOUND          NotFound
nixlNotAllowedError         NIXL_ERR_NOT_ALLOWED        FailedPrecondition
nixlNotPostedError          NIXL_ERR_NOT_POSTED         FailedPrecondition
nixlRepostActiveError       NIXL_ERR_REPOST_ACTIVE      FailedPrecondition
nixlNoTelemetryError        NIXL_ERR_NO_TELEMETRY       FailedPrecondition
nixlNotSupportedError       NIXL_ERR_NOT_SUPPORTED      Unimplemented
nixlRemoteDisconnectError   NIXL_ERR_REMOTE_DISCONNECT  Unavailable
nixlBackendError            NIXL_ERR_BACKEND            TransferError
nixlCancelledError          NIXL_ERR_CANCELED           TransferError
nixlUnknownError            NIXL_ERR_UNKNOWN            TransferError
any other nixl* exception   NIXL_ERR_UNKNOWN            TransferError
non-NIXL exception (bug)    -                           InternalError
"ERR" from post             ERR                         TransferError (raised)
"ERR" from poll             ERR                         XferState.ERR, ``Xfer.error``
==========================  ==========================  ======================

Every message names the call and the NIXL status, e.g.
``prep_remote(agent 'decode-0'): NIXL_ERR_NOT_FOUND: ...``. What NIXL reports
as NOT_FOUND in practice: a remote agent whose metadata was never added, and
descriptors that are not inside memory registered on that side. Inputs we can
check ourselves (array shapes, index ranges, handle ownership) are checked
before NIXL sees them and raise ``InvalidArgument`` naming the argument;
registering memory that overlaps a registration raises ``AlreadyExists``
(NIXL would accept it). A peer whose process died shows up at once as
``Unavailable`` (NIXL_ERR_REMOTE_DISCONNECT) from the next post or notif.

NIXL itself is loaded, without torch, by ``nixl_loader``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any

import numpy as np
import numpy.typing as npt

from kvmap.core.errors import (
    AlreadyExists,
    FailedPrecondition,
    InternalError,
    InvalidArgument,
    KvmapError,
    NotFound,
    TransferError,
    Unavailable,
    Unimplemented,
)
from kvmap.daemon.adapters.nixl_loader import disable_ucx_memory_events, nixl_module

# The value types live with the engine's port (which imports no NIXL); they
# are re-exported here so ``from nixl_agent import XferOp`` keeps working.
from kvmap.daemon.adapters.nixl_port import (
    Backend,
    DlistHandle,
    IndexArray,
    MemoryType,
    Registration,
    Xfer,
    XferOp,
    XferState,
)

_CLOSE_PROGRESS_ROUNDS = 8


# (our error class, NIXL status name) per NIXL exception class name. Looked up
# by name: the classes live in a CUDA-specific module (nixl_cu12/nixl_cu13).
_EXC_MAP: dict[str, tuple[type[KvmapError], str]] = {
    "nixlInvalidParamError": (InvalidArgument, "NIXL_ERR_INVALID_PARAM"),
    "nixlMismatchError": (InvalidArgument, "NIXL_ERR_MISMATCH"),
    "nixlNotFoundError": (NotFound, "NIXL_ERR_NOT_FOUND"),
    "nixlNotAllowedError": (FailedPrecondition, "NIXL_ERR_NOT_ALLOWED"),
    "nixlNotPostedError": (FailedPrecondition, "NIXL_ERR_NOT_POSTED"),
    "nixlRepostActiveError": (FailedPrecondition, "NIXL_ERR_REPOST_ACTIVE"),
    "nixlNoTelemetryError": (FailedPrecondition, "NIXL_ERR_NO_TELEMETRY"),
    "nixlNotSupportedError": (Unimplemented, "NIXL_ERR_NOT_SUPPORTED"),
    "nixlRemoteDisconnectError": (Unavailable, "NIXL_ERR_REMOTE_DISCONNECT"),
    "nixlBackendError": (TransferError, "NIXL_ERR_BACKEND"),
    "nixlCancelledError": (TransferError, "NIXL_ERR_CANCELED"),
    "nixlUnknownError": (TransferError, "NIXL_ERR_UNKNOWN"),
}


def exception_map_drift() -> dict[str, list[str]]:
    """Compare ``_EXC_MAP`` with the exception classes of the installed NIXL.

    ``unmapped``: NIXL raises it but we have no row (it would become
    NIXL_ERR_UNKNOWN); ``stale``: we map a class NIXL no longer has.
    """
    bindings = nixl_module("_bindings")
    present = {
        name
        for name in dir(bindings)
        if isinstance(getattr(bindings, name), type)
        and issubclass(getattr(bindings, name), BaseException)
    }
    return {"unmapped": sorted(present - set(_EXC_MAP)), "stale": sorted(set(_EXC_MAP) - present)}


def translate(exc: BaseException, what: str, arg: str = "") -> KvmapError:
    """Turn an exception raised by NIXL during ``what`` into our error.

    ``arg`` names the argument that InvalidArgument should point at.
    Exceptions that are not NIXL's own (a TypeError from its Python layer)
    mean we called it wrongly: InternalError, not a transfer failure.
    """
    name = type(exc).__name__
    if name not in _EXC_MAP and not type(exc).__module__.startswith("nixl"):
        return InternalError(f"{what}: unexpected {name} from NIXL: {exc}")
    kind, status = _EXC_MAP.get(name, (TransferError, "NIXL_ERR_UNKNOWN"))
    detail = str(exc)
    message = f"{what}: {status}" + (f": {detail}" if detail and detail != status else "")
    if kind is InvalidArgument:
        return InvalidArgument(arg, message)
    if kind is TransferError:
        return TransferError(message, nixl_status=status)
    return kind(message)


class NixlAgent:
    """A NIXL agent with the UCX backend, typed and mapped into kvmap errors
    (the engine's ``nixl_port.NixlPort``)."""

    def __init__(self, name: str, agent: Any, progress_thread: bool) -> None:
        self.name = name
        self.progress_thread = progress_thread
        self._agent = agent
        self._lock = threading.Lock()
        # Live objects, so close() can free them all (identity-hashed).
        self._registrations: set[Registration] = set()
        self._dlists: set[DlistHandle] = set()
        self._xfers: set[Xfer] = set()
        self._closed = False

    @property
    def threads(self) -> int:
        """The UCX threads NIXL runs for this agent, as NIXL reports them."""
        if Backend.UCX.value not in self._agent.backends:
            return 0
        with self._call("get_backend_params(UCX)") as agent:
            params = agent.get_backend_params(Backend.UCX.value)
        return int(params.get("num_threads", 0))

    # -- lifecycle -------------------------------------------------------

    @classmethod
    def create(
        cls,
        name: str,
        *,
        progress_thread: bool = False,
        backends: Sequence[Backend] = (Backend.UCX,),
        threads: int = 0,
    ) -> NixlAgent:
        """Create an agent. ``threads`` > 0 gives UCX that many threads of
        its own, each with a UCX worker: a transfer of more descriptors than
        NIXL's chunk size (``NIXL_MIN_CHUNK_SIZE``, 1024) is cut into chunks
        that these threads post and progress at once (vLLM's NixlConnector
        runs 4). Raises Unavailable when NIXL or UCX cannot start."""
        if not name:
            raise InvalidArgument("name", "agent name must not be empty")
        try:
            # Imported here so that importing kvmap.daemon stays cheap and a
            # missing/broken NIXL install surfaces as one clear error.
            nixl_api = nixl_module("_api")
        except ImportError as e:
            raise Unavailable(f"NIXL is not installed or cannot load: {e}") from e
        # Before UCX reads its configuration (at the backend's creation).
        disable_ucx_memory_events()
        config = nixl_api.nixl_agent_config(
            enable_prog_thread=progress_thread,
            backends=[b.value for b in backends],
            num_threads=threads,
        )
        try:
            agent = nixl_api.nixl_agent(name, config)
        except Exception as e:
            raise translate(e, f"create agent {name!r}") from e
        missing = [b.value for b in backends if b.value not in agent.backends]
        if missing:
            # nixl_agent only logs a warning when a plugin is missing.
            raise Unavailable(f"NIXL backend(s) {missing} unavailable for agent {name!r}")
        return cls(name, agent, progress_thread)

    def close(self) -> None:
        """Release every transfer and list and deregister all memory. Idempotent."""
        if self._closed:
            return
        # Closing: one failed release must not stop the others.
        for xfer in list(self._xfers):
            with suppress(KvmapError):
                self.release(xfer)
        # Drive UCX a few rounds before destroying the agent: after a peer
        # died, a failed post leaves operations queued in UCX, and destroying
        # the worker with them queued aborts the process (a ucs_arbiter
        # assertion; measured, and one progress round clears it).
        for _ in range(_CLOSE_PROGRESS_ROUNDS):
            with suppress(KvmapError):
                self.take_notifs()
        for dlist in list(self._dlists):
            with suppress(KvmapError):
                self.release_dlist(dlist)
        for reg in list(self._registrations):
            with suppress(KvmapError):
                self.deregister(reg)
        self._closed = True
        self._agent = None

    def __enter__(self) -> NixlAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _call(self, what: str, arg: str = "") -> Iterator[Any]:
        """Hold the lock around one NIXL call and translate what it raises."""
        if self._closed:
            raise FailedPrecondition(f"{what}: agent {self.name!r} is closed")
        with self._lock:
            try:
                yield self._agent
            except KvmapError:
                raise
            except Exception as e:
                raise translate(e, what, arg) from e

    # -- memory ----------------------------------------------------------

    def register(
        self, address: int, size: int, dev_id: int = 0, mem_type: MemoryType = MemoryType.DRAM
    ) -> Registration:
        """Register one allocation (never one per layer, never spanning two)."""
        if address <= 0:
            raise InvalidArgument("address", f"address {address:#x} is not a valid pointer")
        if size <= 0:
            raise InvalidArgument("size", f"size {size} must be positive")
        if dev_id < 0:
            raise InvalidArgument("dev_id", f"device id {dev_id} is negative")
        for other in self._registrations:
            if (other.mem_type, other.dev_id, other.address, other.size) == (
                mem_type,
                dev_id,
                address,
                size,
            ):
                other.refs += 1
                return other
            if (
                other.mem_type is mem_type
                and other.dev_id == dev_id
                and (address < other.address + other.size and other.address < address + size)
            ):
                # NIXL accepts overlaps silently; for us one is always a bug
                # (an allocation registered twice, or a region spanning two).
                raise AlreadyExists(
                    f"{size} bytes at {address:#x} overlap the registration of"
                    f" {other.size} bytes at {other.address:#x}"
                )
        rows = np.array([[address, size, dev_id]], dtype=np.uint64)
        with self._call(f"register {size} bytes at {address:#x}") as agent:
            dlist = agent.register_memory(rows, mem_type.value)
        reg = Registration(address, size, dev_id, mem_type, dlist)
        self._registrations.add(reg)
        return reg

    def register_dram(self, address: int, size: int, dev_id: int = 0) -> Registration:
        """``register`` for host memory: the CPU path's only memory type."""
        return self.register(address, size, dev_id, MemoryType.DRAM)

    def deregister(self, reg: Registration) -> None:
        """Deregister (once every ``register`` of the span has been undone);
        a call on an inactive registration is a no-op."""
        if not reg.active:
            return
        reg.refs -= 1
        if reg.refs > 0:
            return
        with self._call(f"deregister {reg.size} bytes at {reg.address:#x}") as agent:
            agent.deregister_memory(reg._dlist)
        reg.active = False
        self._registrations.discard(reg)

    # -- metadata and peers ---------------------------------------------

    def metadata(self) -> bytes:
        """This agent's metadata (connection info + registered memory).

        Fetch it again after (de)registering: peers need the new copy.
        """
        with self._call("metadata") as agent:
            md: bytes = agent.get_agent_metadata()
        return md

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns the peer's agent name."""
        if not metadata:
            raise InvalidArgument("metadata", "empty agent metadata")
        with self._call("add_remote", "metadata") as agent:
            name = agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_remote(self, name: str) -> None:
        """Forget a peer and disconnect from it (unknown names are ignored)."""
        with self._call(f"remove_remote({name!r})") as agent:
            agent.remove_remote_agent(name)

    # -- descriptor lists -----------------------------------------------

    def prep_local(
        self, rows: npt.ArrayLike, mem_type: MemoryType = MemoryType.DRAM
    ) -> DlistHandle:
        """Prepare local descriptors: Nx3 (address, len, dev_id) or Nx5 strided
        (address, len, dev_id, stride, count; each row is ``count`` descriptors).

        Descriptor ``i`` of the list is the i-th of all rows' expansions, in order.
        """
        return self._prep("", rows, mem_type, "prep_local")

    def prep_remote(
        self, agent: str, rows: npt.ArrayLike, mem_type: MemoryType = MemoryType.DRAM
    ) -> DlistHandle:
        """Prepare descriptors in ``agent``'s memory (its metadata must be added)."""
        if not agent:
            raise InvalidArgument("agent", "remote agent name must not be empty")
        return self._prep(agent, rows, mem_type, f"prep_remote(agent {agent!r})")

    def _prep(
        self, agent_name: str, rows: npt.ArrayLike, mem_type: MemoryType, what: str
    ) -> DlistHandle:
        arr = _rows(rows, "rows", (3, 5))
        num = int(arr[:, 4].sum()) if arr.shape[1] == 5 else arr.shape[0]
        if num == 0:
            raise InvalidArgument("rows", "descriptor list is empty")
        with self._call(what, "rows") as agent:
            # "" makes nixl_agent use NIXL_INIT_AGENT: the local side.
            handle = agent.prep_xfer_dlist(agent_name, arr, mem_type.value)
        dlist = DlistHandle(agent_name, mem_type, num, handle)
        self._dlists.add(dlist)
        return dlist

    def release_dlist(self, dlist: DlistHandle) -> None:
        """Free a prepared list; a second call is a no-op."""
        if dlist.released:
            return
        with self._call("release_dlist") as _:
            dlist._handle.release()
        dlist.released = True
        self._dlists.discard(dlist)

    # -- transfers -------------------------------------------------------

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
        """Create and post a transfer between descriptors of two prepared lists.

        ``local_idx[i]`` and ``remote_idx[i]`` name a pair of equally long
        descriptors. ``notif`` reaches the remote agent when the transfer is done.
        """
        if not local.local or local not in self._dlists:
            raise InvalidArgument("local", "not a live local descriptor list of this agent")
        if remote.local or remote not in self._dlists:
            raise InvalidArgument("remote", "not a live remote descriptor list of this agent")
        li = _indices(local_idx, local.num_descs, "local_idx")
        ri = _indices(remote_idx, remote.num_descs, "remote_idx")
        if li.shape != ri.shape:
            raise InvalidArgument(
                "remote_idx", f"{ri.size} remote indices for {li.size} local indices"
            )
        what = f"{op.value} with agent {remote.agent!r}"
        with self._call(what, "local_idx") as agent:
            handle = agent.make_prepped_xfer(
                op.value, local._handle, li, remote._handle, ri, _notif(notif)
            )
        return self._post(op, remote.agent, int(li.size), handle, what)

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
        """Create and post a transfer from explicit Nx3 descriptor rows
        (``remote_mem_type`` defaults to ``mem_type``, the local side's).

        NIXL validates and prepares both lists on every call; prefer
        ``post_prepped`` for repeated transfers over the same regions.
        """
        la = _rows(local_rows, "local_rows", (3,))
        ra = _rows(remote_rows, "remote_rows", (3,))
        if la.shape[0] == 0:
            raise InvalidArgument("local_rows", "descriptor list is empty")
        if la.shape != ra.shape:
            raise InvalidArgument(
                "remote_rows", f"{ra.shape[0]} remote descriptors for {la.shape[0]} local"
            )
        mismatch = np.nonzero(la[:, 1] != ra[:, 1])[0]
        if mismatch.size:
            i = int(mismatch[0])
            raise InvalidArgument(
                f"remote_rows[{i}]", f"length {ra[i, 1]} differs from local length {la[i, 1]}"
            )
        what = f"{op.value} with agent {remote_agent!r}"
        with self._call(what, "local_rows") as agent:
            ld = agent.get_xfer_descs(la, mem_type.value)
            rd = agent.get_xfer_descs(ra, (remote_mem_type or mem_type).value)
            handle = agent.initialize_xfer(op.value, ld, rd, remote_agent, _notif(notif))
        return self._post(op, remote_agent, int(la.shape[0]), handle, what)

    def _post(self, op: XferOp, remote_agent: str, num: int, handle: Any, what: str) -> Xfer:
        xfer = Xfer(op, remote_agent, num, time.monotonic(), handle)
        self._xfers.add(xfer)
        try:
            with self._call(what) as agent:
                # b"": keep the notification given when the request was made.
                status = agent.transfer(handle, b"")
        except KvmapError:
            with suppress(KvmapError):
                self.release(xfer)
            raise
        if status == "ERR":
            with suppress(KvmapError):
                self.release(xfer)
            raise TransferError(f"{what}: posting failed (ERR)", nixl_status="ERR")
        if status == "DONE":
            xfer.state = XferState.DONE
        return xfer

    def poll(self, xfer: Xfer) -> XferState:
        """Check a transfer (this also drives UCX progress). Never raises for a
        failed transfer: the state is ERR and ``xfer.error`` says why."""
        if xfer.state is not XferState.PROC:
            return xfer.state
        if xfer.released:
            raise FailedPrecondition("poll: transfer was released")
        what = f"{xfer.op.value} with agent {xfer.remote_agent!r}"
        try:
            with self._call(what) as agent:
                status = agent.check_xfer_state(xfer._handle)
        except KvmapError as e:
            # A peer that went away shows up here (REMOTE_DISCONNECT / BACKEND).
            status = "ERR"
            # A vanished peer stays Unavailable: the caller may retry elsewhere.
            xfer.error = (
                e if isinstance(e, TransferError | Unavailable) else TransferError(e.message, "ERR")
            )
        if status == "DONE":
            xfer.state = XferState.DONE
        elif status == "ERR":
            xfer.state = XferState.ERR
            if xfer.error is None:
                xfer.error = TransferError(f"{what}: transfer failed (ERR)", nixl_status="ERR")
        return xfer.state

    def release(self, xfer: Xfer) -> None:
        """Free a transfer; NIXL cancels it if still in progress. Idempotent."""
        if xfer.released:
            return
        with self._call(f"release {xfer.op.value} with agent {xfer.remote_agent!r}") as _:
            xfer._handle.release()
        xfer.released = True
        self._xfers.discard(xfer)

    # -- notifications ---------------------------------------------------

    def send_notif(self, agent: str, msg: bytes) -> None:
        """Send a notification not tied to a transfer."""
        with self._call(f"send_notif(agent {agent!r})", "msg") as a:
            a.send_notif(agent, _notif(msg))

    def take_notifs(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by sender agent name.

        Also the call that drives this agent's UCX worker when no progress
        thread runs: call it periodically even when expecting nothing.
        """
        with self._call("take_notifs") as agent:
            notifs: dict[str, list[bytes]] = agent.get_new_notifs()
        return notifs

    # -- introspection ---------------------------------------------------

    @property
    def registrations(self) -> tuple[Registration, ...]:
        return tuple(self._registrations)

    @property
    def in_flight(self) -> tuple[Xfer, ...]:
        """Transfers posted and not released."""
        return tuple(self._xfers)


def _notif(msg: bytes) -> bytes:
    if not isinstance(msg, bytes):
        raise InvalidArgument("notif", f"must be bytes, not {type(msg).__name__}")
    return msg


def _rows(rows: npt.ArrayLike, arg: str, widths: tuple[int, ...]) -> npt.NDArray[np.uint64]:
    """Validate descriptor rows and return them as a C-contiguous uint64 array."""
    try:
        raw = np.asarray(rows)
    except (TypeError, ValueError) as e:
        raise InvalidArgument(arg, f"not a numeric array: {e}") from e
    shape = " or ".join(f"Nx{w}" for w in widths)
    if raw.ndim != 2 or raw.shape[1] not in widths:
        raise InvalidArgument(arg, f"expected an {shape} array, got shape {raw.shape}")
    if raw.size and not np.issubdtype(raw.dtype, np.integer):
        raise InvalidArgument(arg, f"expected integers, got {raw.dtype}")
    if raw.size and np.issubdtype(raw.dtype, np.signedinteger) and (raw < 0).any():
        r = int(np.argwhere(raw < 0)[0][0])
        raise InvalidArgument(f"{arg}[{r}]", "negative value in descriptor row")
    arr = np.ascontiguousarray(raw, dtype=np.uint64)
    if arr.shape[0] and (arr[:, 1] == 0).any():
        r = int(np.nonzero(arr[:, 1] == 0)[0][0])
        raise InvalidArgument(f"{arg}[{r}]", "descriptor length is 0")
    return arr


def _indices(idx: IndexArray, bound: int, arg: str) -> npt.NDArray[np.int32]:
    arr = np.asarray(idx)
    if arr.ndim != 1 or arr.size == 0:
        raise InvalidArgument(arg, "expected a non-empty 1-D list of indices")
    if not np.issubdtype(arr.dtype, np.integer):
        raise InvalidArgument(arg, f"expected integers, got {arr.dtype}")
    bad = np.nonzero((arr < 0) | (arr >= bound))[0]
    if bad.size:
        i = int(bad[0])
        raise InvalidArgument(
            f"{arg}[{i}]", f"index {int(arr[i])} outside the list's {bound} descriptors"
        )
    return arr.astype(np.int32, copy=False)


__all__ = [
    "Backend",
    "DlistHandle",
    "IndexArray",
    "MemoryType",
    "NixlAgent",
    "Registration",
    "Xfer",
    "XferOp",
    "XferState",
    "nixl_module",
    "translate",
]
