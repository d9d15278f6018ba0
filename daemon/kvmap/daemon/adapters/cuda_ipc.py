"""CUDA memory import: a worker's CUDA IPC handle -> a device address in kvmapd.

A GPU worker shares each backing allocation of its KV cache as the legacy
CUDA IPC handle (``cudaIpcMemHandle_t``, 64 bytes) of the ``cudaMalloc``
block the allocation lives in, the allocation's offset inside that block,
the block's size, and the UUID of its device (``types.proto``:
``CudaIpcHandle``, ``Device.uuid``). The daemon maps the block with
``cuIpcOpenMemHandle`` and registers ``base + offset_bytes`` as VRAM with
NIXL, so NIXL reads and writes land in the worker's own GPU memory.

Rules this module keeps:

* A handle can be opened only once per process and device, and torch's
  caching allocator carves many tensors out of one block: blocks are cached
  by handle bytes with a reference count, so two allocations of one block
  share one open, and the block is closed when the last of them closes.
* The device is chosen by UUID, never by ordinal: the worker's ``cuda:0``
  need not be the daemon's device 0 (containers see different
  ``CUDA_VISIBLE_DEVICES``). ``CudaMapping.dev_id`` is the daemon's own
  ordinal, which is what NIXL's ``dev_id`` for VRAM must be (the UCX backend
  checks it against the pointer's device).
* Bounds come from the driver, not only from the client: the block size the
  worker claims must fit the mapping ``cuMemGetAddressRange`` reports, so a
  registration can never reach past the worker's block.
* Nothing of a dead worker is kept: an open IPC mapping keeps the exporting
  process's memory allocated after that process exits, so the GPU memory of
  a restarted engine would stay pinned. Callers close each mapping when its
  worker goes (``registration`` does, on Attach end and deregistration).

Footprint: the daemon allocates no KV memory and loads no kernels. Per GPU it
retains that device's *primary context* (shared with UCX in the same
process), created on the first CUDA registration and released only by
``shutdown()``; releasing it between workers would tear down a context UCX
may still hold streams in. A primary context costs a few hundred MiB of
device memory (the device script ``tests/gpu/run_on_device.sh`` prints the
measured figure); a daemon that never sees a CUDA registration creates none.

The driver calls live in ``cuda_driver`` (ctypes over libcuda); everything
here is plain logic over a ``CudaDriver``, unit-tested with a fake driver.
"""

from __future__ import annotations

import string
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

import structlog

from kvmap.core.errors import (
    FailedPrecondition,
    InternalError,
    InvalidArgument,
    KvmapError,
    ResourceExhausted,
)
from kvmap.core.geometry import AllocationSpec, CudaIpcHandle
from kvmap.daemon.adapters.cuda_driver import (
    IPC_HANDLE_SIZE,
    UUID_SIZE,
    CudaCallError,
    CudaUnavailable,
    LibCuda,
)
from kvmap.daemon.adapters.nixl_port import MemoryType

log = structlog.get_logger("kvmapd.cuda_ipc")

# torch >= 2.2 prefixes its IPC handles with a version byte and a type byte.
_TORCH_HANDLE_VERSION = 2
_TORCH_CUDA_MALLOC = ord("c")
_TORCH_EXPANDABLE = ord("e")

# Errors of cuIpcOpenMemHandle that mean "this handle cannot be opened here":
# the exporter exited or freed the block, the handle is garbage, or the
# exporter is in another PID namespace (legacy IPC checks the process).
_BAD_HANDLE_ERRORS = frozenset(
    {
        "CUDA_ERROR_INVALID_VALUE",
        "CUDA_ERROR_INVALID_HANDLE",
        "CUDA_ERROR_MAP_FAILED",
        "CUDA_ERROR_ALREADY_MAPPED",
        "CUDA_ERROR_OPERATING_SYSTEM",
        "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
        "CUDA_ERROR_INVALID_DEVICE",
    }
)
_OPEN_HINT = (
    "the exporting worker may have exited or freed the block, or runs in another PID "
    "namespace (legacy CUDA IPC needs one: set shareProcessNamespace: true on the pod)"
)


class CudaDriver(Protocol):
    """What the importer needs from the CUDA driver (``cuda_driver.LibCuda``)."""

    def device_uuids(self) -> list[bytes]: ...
    def retain_context(self, ordinal: int) -> None: ...
    def release_context(self, ordinal: int) -> None: ...
    def open_handle(self, ordinal: int, handle: bytes) -> int: ...
    def close_handle(self, ordinal: int, address: int) -> None: ...
    def mapped_size(self, ordinal: int, address: int) -> int: ...


# Pure checks ------------------------------------------------------------------


def format_uuid(raw: bytes) -> str:
    """16 UUID bytes as nvidia-smi prints them: ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``."""
    if len(raw) != UUID_SIZE:
        raise ValueError(f"a CUDA UUID has {UUID_SIZE} bytes, not {len(raw)}")
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def parse_uuid(text: str, field: str) -> bytes:
    """The 16 bytes of a device UUID written as nvidia-smi, torch or NVML do
    (``GPU-``/``MIG-`` prefix or none, any case, dashes optional)."""
    s = text.strip()
    if not s:
        raise InvalidArgument(
            field,
            "required for CUDA memory: the device's UUID as nvidia-smi -L prints it "
            "(GPU-...); ordinals differ between containers",
        )
    body = s
    for prefix in ("GPU-", "MIG-"):
        if body.upper().startswith(prefix):
            body = body[len(prefix) :]
            break
    digits = body.replace("-", "")
    if len(digits) != 2 * UUID_SIZE or any(c not in string.hexdigits for c in digits):
        raise InvalidArgument(
            field, f"{text!r} is not a CUDA device UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)"
        )
    return bytes.fromhex(digits)


def check_handle(handle: bytes, field: str) -> bytes:
    """A raw legacy IPC handle, or InvalidArgument saying what was sent instead."""
    n = len(handle)
    if n == IPC_HANDLE_SIZE:
        if not any(handle):
            raise InvalidArgument(field, "all zeros: not a cudaIpcMemHandle_t")
        return bytes(handle)
    hint = ""
    if n >= 2 and handle[0] == _TORCH_HANDLE_VERSION and handle[1] == _TORCH_EXPANDABLE:
        hint = (
            ": torch's handle of an expandable segment, which kvmapd cannot open; start vLLM "
            "without PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
        )
    elif n == 2 + IPC_HANDLE_SIZE and handle[0] == _TORCH_HANDLE_VERSION:
        hint = ": torch's versioned handle; send the 64 bytes after its 2-byte prefix"
    raise InvalidArgument(
        field, f"expected {IPC_HANDLE_SIZE} bytes (a cudaIpcMemHandle_t), got {n}{hint}"
    )


def check_span(offset: int, size: int, block_size: int, field: str) -> None:
    """The allocation [offset, offset + size) lies inside its block.
    ``field`` is the allocation's path, e.g. ``allocations[0]``."""
    if size <= 0:
        raise InvalidArgument(f"{field}.size_bytes", f"size {size} must be positive")
    if block_size <= 0:
        raise InvalidArgument(
            f"{field}.cuda_ipc.block_size_bytes",
            f"{block_size} must be positive (the size of the whole IPC-mapped block)",
        )
    if offset < 0:
        raise InvalidArgument(f"{field}.cuda_ipc.offset_bytes", f"offset {offset} is negative")
    if offset + size > block_size:
        raise InvalidArgument(
            f"{field}.cuda_ipc.offset_bytes",
            f"offset {offset} + size {size} = {offset + size} is past the end of the"
            f" {block_size}-byte IPC block",
        )


def pick_device(uuids: list[bytes], want: bytes, field: str) -> int:
    """The daemon's ordinal of the device with UUID ``want``."""
    for ordinal, uuid in enumerate(uuids):
        if uuid == want:
            return ordinal
    seen = ", ".join(format_uuid(u) for u in uuids) or "no device"
    raise InvalidArgument(
        field,
        f"no visible CUDA device has UUID {format_uuid(want)} (this kvmapd sees {seen};"
        " give the sidecar the same GPUs as the worker)",
    )


def open_error(err: CudaCallError, field: str, device: str) -> KvmapError:
    """What a failed cuIpcOpenMemHandle means for the caller."""
    what = f"cannot open the CUDA IPC handle on {device}: {err.name} ({err.description})"
    if err.name == "CUDA_ERROR_OUT_OF_MEMORY":
        return ResourceExhausted(f"{field}.cuda_ipc.handle: {what}")
    if err.name in _BAD_HANDLE_ERRORS:
        return InvalidArgument(f"{field}.cuda_ipc.handle", f"{what}; {_OPEN_HINT}")
    return FailedPrecondition(f"{field}.cuda_ipc.handle: {what}")


# The importer -------------------------------------------------------------------


@dataclass(eq=False)
class _Block:
    """One opened cudaMalloc block: shared by the allocations carved from it."""

    handle: bytes
    ordinal: int
    base: int
    size: int  # as the driver reports the mapping
    refs: int = 0
    open: bool = True


class CudaMapping:
    """One allocation inside an opened block. ``address`` is its byte 0 in
    this process; register ``(address, size, dev_id, mem_type)`` with NIXL."""

    mem_type = MemoryType.VRAM

    def __init__(
        self, owner: CudaIpcImporter, block: _Block, offset: int, size: int, uuid: str
    ) -> None:
        self._owner = owner
        self._block = block
        self.offset = offset
        self.size = size
        self.address = block.base + offset
        self.block_address = block.base
        self.dev_id = block.ordinal  # the daemon's ordinal: NIXL's dev_id for VRAM
        self.device_uuid = uuid
        self.source = f"cuda_ipc {uuid} block 0x{block.base:x}"
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed or not self._block.open

    def close(self) -> None:
        """Drop this allocation's use of its block (closing the block if it
        was the last). Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        self._owner._release(self._block)

    def __enter__(self) -> CudaMapping:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"0x{self.address:x}"
        return (
            f"CudaMapping({self.device_uuid}, dev_id={self.dev_id}, offset={self.offset},"
            f" size={self.size}, {state})"
        )


def load_driver() -> CudaDriver:
    return LibCuda()


class CudaIpcImporter:
    """Opens IPC handles once per process, shares blocks, closes them when
    their last allocation goes. Thread-safe. One per daemon process (the
    daemon's ``DaemonApp`` makes it; a handle opens only once per process)."""

    def __init__(self, load: Callable[[], CudaDriver] = load_driver) -> None:
        self._load = load
        self._driver: CudaDriver | None = None
        self._uuids: list[bytes] = []
        self._contexts: set[int] = set()
        self._blocks: dict[bytes, _Block] = {}
        self._mappings = 0
        self._lock = threading.Lock()

    def _ensure_driver(self) -> CudaDriver:
        if self._driver is None:
            # Not cached on failure: a driver that appears later (a fixed
            # mount) is picked up by the next registration.
            try:
                driver = self._load()
                uuids = driver.device_uuids()
            except (CudaUnavailable, CudaCallError) as e:
                raise FailedPrecondition(f"no CUDA driver in this kvmapd container: {e}") from e
            self._driver, self._uuids = driver, uuids
        return self._driver

    def import_handle(
        self,
        *,
        handle: bytes,
        offset: int,
        size: int,
        block_size: int,
        device_uuid: str,
        field: str = "allocation",
    ) -> CudaMapping:
        """Map ``size`` bytes at ``offset`` of the block behind ``handle`` on
        the device with UUID ``device_uuid``. ``field`` names the allocation in
        errors (``allocations[0]``). Inputs are checked before the driver is
        touched; on any failure nothing stays open."""
        raw = check_handle(handle, f"{field}.cuda_ipc.handle")
        check_span(offset, size, block_size, field)
        want = parse_uuid(device_uuid, f"{field}.device.uuid")
        with self._lock:
            driver = self._ensure_driver()
            ordinal = pick_device(self._uuids, want, f"{field}.device.uuid")
            uuid = format_uuid(want)
            block = self._blocks.get(raw)
            if block is None:
                block = self._open(driver, raw, ordinal, field, uuid)
            elif block.ordinal != ordinal:
                raise InvalidArgument(
                    f"{field}.device.uuid",
                    f"this handle is already open on {format_uuid(self._uuids[block.ordinal])},"
                    f" not {uuid}",
                )
            if block_size > block.size:
                if block.refs == 0:
                    self._close_block(block)
                raise InvalidArgument(
                    f"{field}.cuda_ipc.block_size_bytes",
                    f"{block_size} bytes claimed, but the IPC mapping on {uuid} is"
                    f" {block.size} bytes",
                )
            block.refs += 1
            self._mappings += 1
        return CudaMapping(self, block, offset, size, uuid)

    def _open(self, driver: CudaDriver, raw: bytes, ordinal: int, field: str, uuid: str) -> _Block:
        if ordinal not in self._contexts:
            try:
                driver.retain_context(ordinal)
            except CudaCallError as e:
                raise FailedPrecondition(
                    f"{field}.device.uuid: cannot use {uuid} from kvmapd: {e}"
                ) from e
            self._contexts.add(ordinal)
        try:
            base = driver.open_handle(ordinal, raw)
        except CudaCallError as e:
            raise open_error(e, field, uuid) from e
        try:
            size = driver.mapped_size(ordinal, base)
        except CudaCallError as e:
            self._close_quietly(driver, ordinal, base)
            raise InternalError(f"{field}.cuda_ipc.handle: opened, but {e}") from e
        block = _Block(raw, ordinal, base, size)
        self._blocks[raw] = block
        log.info("cuda_ipc_opened", device=uuid, address=f"0x{base:x}", size=size)
        return block

    def _release(self, block: _Block) -> None:
        with self._lock:
            if not block.open:
                return  # closed by shutdown() already
            self._mappings -= 1
            block.refs -= 1
            if block.refs <= 0:
                self._close_block(block)

    def _close_block(self, block: _Block) -> None:
        block.open = False
        if self._blocks.get(block.handle) is block:
            del self._blocks[block.handle]
        if self._driver is not None:
            self._close_quietly(self._driver, block.ordinal, block.base)

    @staticmethod
    def _close_quietly(driver: CudaDriver, ordinal: int, base: int) -> None:
        # Closing runs while a worker is retired: a driver error here must not
        # stop the rest of the release, and there is nothing else to try.
        try:
            driver.close_handle(ordinal, base)
        except CudaCallError as e:
            log.warning("cuda_ipc_close_failed", address=f"0x{base:x}", error=str(e))

    def live_handles(self) -> int:
        """Blocks open in this process (each one IPC handle)."""
        with self._lock:
            return len(self._blocks)

    def live_mappings(self) -> int:
        """``CudaMapping`` objects not yet closed."""
        with self._lock:
            return self._mappings

    def shutdown(self) -> None:
        """Close every block (open mappings report ``closed``) and release the
        primary contexts. For daemon stop, after NIXL deregistered everything."""
        with self._lock:
            for block in list(self._blocks.values()):
                self._close_block(block)
            if self._driver is not None:
                for ordinal in sorted(self._contexts):
                    try:
                        self._driver.release_context(ordinal)
                    except CudaCallError as e:
                        log.warning("cuda_context_release_failed", ordinal=ordinal, error=str(e))
            self._contexts.clear()
            self._mappings = 0


def import_allocation(
    alloc: AllocationSpec, ipc: CudaIpcHandle, *, field: str, importer: CudaIpcImporter
) -> CudaMapping:
    """Map an allocation through its ``cuda_ipc`` handle ``ipc``. ``field``
    is its path in the request (``allocations[3]``); errors name its
    sub-fields."""
    return importer.import_handle(
        handle=ipc.handle,
        offset=ipc.offset_bytes,
        size=alloc.size_bytes,
        block_size=ipc.block_size_bytes,
        device_uuid=alloc.device.uuid,
        field=field,
    )


__all__ = [
    "CudaDriver",
    "CudaIpcImporter",
    "CudaMapping",
    "check_handle",
    "check_span",
    "format_uuid",
    "import_allocation",
    "parse_uuid",
    "pick_device",
]
