"""CUDA IPC import without a GPU: handle and UUID checks, device choice by
UUID, one open per block with reference counts, bounds, error messages.

A fake stands in for the CUDA driver only (``cuda_driver.LibCuda``, the
ctypes layer); the GPU tests in tests/gpu run the same code on a real one.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest

from kvmap.core.errors import (
    FailedPrecondition,
    InternalError,
    InvalidArgument,
    ResourceExhausted,
)
from kvmap.core.geometry import AllocationSpec, CudaIpcHandle, DeviceKind, DeviceRef
from kvmap.daemon.adapters import cuda_ipc
from kvmap.daemon.adapters.cuda_driver import CudaCallError, CudaUnavailable, LibCuda
from kvmap.daemon.adapters.cuda_ipc import (
    CudaIpcImporter,
    check_handle,
    format_uuid,
    import_allocation,
    parse_uuid,
)
from kvmap.daemon.adapters.nixl_port import MemoryType

pytestmark = pytest.mark.timeout(30)

UUIDS = [bytes([d]) * 16 for d in (0xA0, 0xB1, 0xC2)]
H1 = bytes(range(1, 65))
H2 = bytes(range(65, 129))
BLOCK = 1 << 20


@dataclass
class FakeDriver:
    """The driver's contract: a handle opens once per process (a second open
    of an open handle fails), contexts must be retained before use."""

    uuids: list[bytes] = field(default_factory=lambda: list(UUIDS))
    sizes: dict[bytes, int] = field(default_factory=dict)  # mapping size per handle
    fail_open: str = ""  # CUresult name to fail cuIpcOpenMemHandle with
    contexts: set[int] = field(default_factory=set)
    open: dict[int, tuple[int, bytes]] = field(default_factory=dict)  # base -> (ordinal, handle)
    calls: list[str] = field(default_factory=list)
    next_base: int = 0x7F0000000000

    def device_uuids(self) -> list[bytes]:
        return list(self.uuids)

    def retain_context(self, ordinal: int) -> None:
        self.calls.append(f"retain {ordinal}")
        self.contexts.add(ordinal)

    def release_context(self, ordinal: int) -> None:
        self.calls.append(f"release {ordinal}")
        self.contexts.discard(ordinal)

    def open_handle(self, ordinal: int, handle: bytes) -> int:
        assert ordinal in self.contexts, "opened without a retained context"
        self.calls.append(f"open {ordinal}")
        if self.fail_open:
            raise CudaCallError("cuIpcOpenMemHandle", 1, self.fail_open, "driver says no")
        if any(h == handle for _, h in self.open.values()):
            raise CudaCallError("cuIpcOpenMemHandle", 208, "CUDA_ERROR_ALREADY_MAPPED", "twice")
        base = self.next_base
        self.next_base += 1 << 32
        self.open[base] = (ordinal, handle)
        return base

    def close_handle(self, ordinal: int, address: int) -> None:
        self.calls.append(f"close {ordinal}")
        assert self.open.pop(address)[0] == ordinal

    def mapped_size(self, ordinal: int, address: int) -> int:
        return self.sizes.get(self.open[address][1], BLOCK)


@pytest.fixture
def driver() -> FakeDriver:
    return FakeDriver()


@pytest.fixture
def importer(driver: FakeDriver) -> CudaIpcImporter:
    return CudaIpcImporter(lambda: driver)


def _import(
    imp: CudaIpcImporter,
    *,
    handle: bytes = H1,
    offset: int = 0,
    size: int = 4096,
    block: int = BLOCK,
    uuid: str = "",
) -> cuda_ipc.CudaMapping:
    return imp.import_handle(
        handle=handle,
        offset=offset,
        size=size,
        block_size=block,
        device_uuid=uuid or format_uuid(UUIDS[1]),
        field="allocations[0]",
    )


# UUIDs --------------------------------------------------------------------------


def test_uuids_format_like_nvidia_smi_and_parse_back() -> None:
    """A raw 16-byte UUID formats as nvidia-smi's "GPU-xxxxxxxx-..." text, and that text parses back
    to the same bytes whatever its case, prefix (GPU-, MIG-, none) or dashes."""
    raw = bytes.fromhex("5e0e1f2a3b4c5d6e7f8091a2b3c4d5e6")
    text = format_uuid(raw)
    assert text == "GPU-5e0e1f2a-3b4c-5d6e-7f80-91a2b3c4d5e6"
    for spelling in (text, text.upper(), text[4:], "MIG-" + text[4:], text.replace("-", "")[3:]):
        assert parse_uuid(spelling, "f") == raw, spelling


@pytest.mark.parametrize("bad", ["GPU-1234", "GPU-zz0e1f2a-3b4c-5d6e-7f80-91a2b3c4d5e6", "0"])
def test_malformed_uuid_names_the_field(bad: str) -> None:
    """A UUID of the wrong length or with non-hex digits is rejected with INVALID_ARGUMENT naming
    the given field."""
    with pytest.raises(InvalidArgument) as e:
        parse_uuid(bad, "allocations[2].device.uuid")
    assert e.value.field == "allocations[2].device.uuid"
    assert "is not a CUDA device UUID" in e.value.problem


def test_missing_uuid_says_why_it_is_needed(importer: CudaIpcImporter) -> None:
    """An import with a blank device UUID is rejected on device.uuid, explaining that ordinals
    differ between containers."""
    with pytest.raises(InvalidArgument) as e:
        _import(importer, uuid=" ")
    assert e.value.field == "allocations[0].device.uuid"
    assert "ordinals differ between containers" in e.value.problem


# Handles ------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 63, 65, 128])
def test_handle_must_be_64_bytes(n: int) -> None:
    """A CUDA IPC handle of any length other than 64 bytes is rejected with a message giving the
    field, the expected size and the actual length."""
    with pytest.raises(InvalidArgument) as e:
        check_handle(b"\x01" * n, "allocations[0].cuda_ipc.handle")
    assert str(e.value) == (
        f"allocations[0].cuda_ipc.handle: expected 64 bytes (a cudaIpcMemHandle_t), got {n}"
    )


def test_torch_versioned_and_expandable_handles_get_a_hint() -> None:
    """A torch-versioned handle (2-byte prefix) and an expandable-segments handle are rejected with
    a hint about the cause."""
    with pytest.raises(InvalidArgument, match="2-byte prefix"):
        check_handle(b"\x02c" + H1, "h")
    with pytest.raises(InvalidArgument, match="expandable_segments:True"):
        check_handle(b"\x02e" + b"\x05" * 40, "h")


def test_all_zero_handle_is_rejected() -> None:
    """A 64-byte handle of all zeros is rejected as INVALID_ARGUMENT."""
    with pytest.raises(InvalidArgument, match="all zeros"):
        check_handle(bytes(64), "h")


# Offsets and bounds ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("offset", "size", "block", "where", "text"),
    [
        (0, 0, BLOCK, "allocations[0].size_bytes", "must be positive"),
        (0, 16, 0, "allocations[0].cuda_ipc.block_size_bytes", "must be positive"),
        (-1, 16, BLOCK, "allocations[0].cuda_ipc.offset_bytes", "negative"),
        (BLOCK - 8, 16, BLOCK, "allocations[0].cuda_ipc.offset_bytes", "past the end"),
    ],
)
def test_bad_spans_are_rejected_before_the_driver_is_loaded(
    offset: int, size: int, block: int, where: str, text: str
) -> None:
    """Zero sizes, a negative offset or a span past the block's end are rejected on the right field
    before the CUDA driver is ever loaded, leaving no handle open."""
    loads: list[int] = []

    def load() -> FakeDriver:
        loads.append(1)
        return FakeDriver()

    imp = CudaIpcImporter(load)
    with pytest.raises(InvalidArgument) as e:
        _import(imp, offset=offset, size=size, block=block)
    assert e.value.field == where and text in e.value.problem
    assert loads == [] and imp.live_handles() == 0


def test_address_is_block_base_plus_offset(importer: CudaIpcImporter, driver: FakeDriver) -> None:
    """An imported mapping's address is the opened block's base plus the offset, with the requested
    size and VRAM memory type."""
    m = _import(importer, offset=8192, size=4096)
    (base,) = driver.open
    assert m.block_address == base and m.address == base + 8192 and m.size == 4096
    assert m.mem_type is MemoryType.VRAM
    m.close()


def test_allocation_ending_exactly_at_block_end_is_accepted(importer: CudaIpcImporter) -> None:
    """An allocation whose end coincides with the block's end is accepted (the bound is
    inclusive)."""
    with _import(importer, offset=BLOCK - 4096, size=4096) as m:
        assert not m.closed


def test_block_size_larger_than_the_real_mapping_is_rejected_and_closed(
    importer: CudaIpcImporter, driver: FakeDriver
) -> None:
    """A declared block size larger than the driver's real mapping is rejected on block_size_bytes,
    citing the real size, and the handle is closed again."""
    driver.sizes[H1] = BLOCK // 2
    with pytest.raises(InvalidArgument) as e:
        _import(importer, size=4096, block=BLOCK)
    assert e.value.field == "allocations[0].cuda_ipc.block_size_bytes"
    assert f"IPC mapping on {format_uuid(UUIDS[1])} is {BLOCK // 2} bytes" in e.value.problem
    assert importer.live_handles() == 0 and driver.open == {}


# Devices --------------------------------------------------------------------------


def test_device_is_chosen_by_uuid_not_by_ordinal(
    importer: CudaIpcImporter, driver: FakeDriver
) -> None:
    """The device is the one whose UUID matches (ordinal 2 here), and its context is retained before
    the handle is opened on it."""
    m = _import(importer, uuid=format_uuid(UUIDS[2]))
    assert m.dev_id == 2 and m.device_uuid == format_uuid(UUIDS[2])
    assert driver.calls == ["retain 2", "open 2"]
    m.close()


def test_unknown_uuid_lists_what_the_daemon_sees(
    importer: CudaIpcImporter, driver: FakeDriver
) -> None:
    """A UUID no visible device has is rejected with a message listing the UUIDs the daemon does
    see, and nothing is opened."""
    other = "GPU-" + "ee" * 4 + "-eeee-eeee-eeee-" + "ee" * 6
    with pytest.raises(InvalidArgument) as e:
        _import(importer, uuid=other)
    assert str(e.value).startswith(
        f"allocations[0].device.uuid: no visible CUDA device has UUID {other}"
    )
    assert format_uuid(UUIDS[0]) in e.value.problem
    assert driver.open == {} and importer.live_handles() == 0


# One open per block, reference counted ------------------------------------------------


def test_two_allocations_of_one_block_share_one_open(
    importer: CudaIpcImporter, driver: FakeDriver
) -> None:
    """Two allocations in one block share a single driver open; the block closes only when the last
    mapping closes, and a repeated close does not drop another mapping's reference."""
    a = _import(importer, offset=0, size=4096)
    b = _import(importer, offset=65536, size=8192)
    assert driver.calls.count("open 1") == 1 and len(driver.open) == 1
    assert b.address - a.address == 65536
    assert importer.live_handles() == 1 and importer.live_mappings() == 2
    a.close()
    assert importer.live_handles() == 1 and driver.open  # b still uses the block
    a.close()  # idempotent: does not steal b's reference
    assert importer.live_handles() == 1
    b.close()
    assert importer.live_handles() == 0 and importer.live_mappings() == 0
    assert driver.open == {} and driver.calls.count("close 1") == 1
    assert a.closed and b.closed


def test_a_closed_block_opens_again(importer: CudaIpcImporter, driver: FakeDriver) -> None:
    """After a block's last mapping closes, importing the same handle opens it afresh (the context
    is retained only once)."""
    _import(importer).close()
    with _import(importer) as m:
        assert not m.closed and importer.live_handles() == 1
    assert driver.calls == ["retain 1", "open 1", "close 1", "open 1", "close 1"]


def test_distinct_handles_are_distinct_blocks(importer: CudaIpcImporter) -> None:
    """Two different handles are opened as two blocks at different addresses, and both close when
    their mappings do."""
    with _import(importer, handle=H1) as a, _import(importer, handle=H2) as b:
        assert importer.live_handles() == 2 and a.block_address != b.block_address
    assert importer.live_handles() == 0


def test_same_handle_on_another_device_is_rejected(
    importer: CudaIpcImporter, driver: FakeDriver
) -> None:
    """Importing a handle already open on one device for another device is rejected on device.uuid
    ("already open on") without adding a mapping."""
    with _import(importer, uuid=format_uuid(UUIDS[1])):
        with pytest.raises(InvalidArgument) as e:
            _import(importer, uuid=format_uuid(UUIDS[0]))
        assert e.value.field == "allocations[0].device.uuid"
        assert "already open on" in e.value.problem
        assert importer.live_mappings() == 1
    assert driver.open == {}


def test_concurrent_imports_of_one_handle_open_it_once(
    importer: CudaIpcImporter, driver: FakeDriver
) -> None:
    """Eight threads importing the same handle at once cause a single driver open and eight
    mappings, all released on close."""
    start = threading.Barrier(8)

    def one(i: int) -> cuda_ipc.CudaMapping:
        start.wait()
        return _import(importer, offset=i * 4096)

    with ThreadPoolExecutor(8) as pool:
        maps = list(pool.map(one, range(8)))
    assert driver.calls.count("open 1") == 1 and importer.live_mappings() == 8
    for m in maps:
        m.close()
    assert driver.open == {} and importer.live_handles() == 0


# Driver failures --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("CUDA_ERROR_INVALID_VALUE", InvalidArgument),
        ("CUDA_ERROR_MAP_FAILED", InvalidArgument),
        ("CUDA_ERROR_OUT_OF_MEMORY", ResourceExhausted),
        ("CUDA_ERROR_NOT_SUPPORTED", FailedPrecondition),
    ],
)
def test_open_failures_map_to_statuses_and_leave_nothing_open(
    importer: CudaIpcImporter, driver: FakeDriver, name: str, kind: type[Exception]
) -> None:
    """cuIpcOpenMemHandle errors map to INVALID_ARGUMENT (with a shareProcessNamespace hint),
    RESOURCE_EXHAUSTED or FAILED_PRECONDITION, name the handle field and the CUDA error, and
    leave nothing open."""
    driver.fail_open = name
    with pytest.raises(kind) as e:
        _import(importer)
    assert "allocations[0].cuda_ipc.handle" in str(e.value) and name in str(e.value)
    if kind is InvalidArgument:
        assert "shareProcessNamespace" in str(e.value)
    assert importer.live_handles() == 0 and importer.live_mappings() == 0


def test_no_driver_is_failed_precondition_and_is_retried() -> None:
    """A missing CUDA driver is FAILED_PRECONDITION with the loader's reason, and is not cached: the
    next import loads the driver again and succeeds."""
    attempts: list[int] = []
    fake = FakeDriver()

    def load() -> FakeDriver:
        attempts.append(1)
        if len(attempts) == 1:
            raise CudaUnavailable("cannot load libcuda.so.1: no such file")
        return fake

    imp = CudaIpcImporter(load)
    with pytest.raises(FailedPrecondition) as e:
        _import(imp)
    assert str(e.value) == (
        "no CUDA driver in this kvmapd container: cannot load libcuda.so.1: no such file"
    )
    with _import(imp) as m:  # the driver showed up: not cached as missing
        assert m.dev_id == 1
    assert len(attempts) == 2


def test_bad_input_is_invalid_argument_even_without_a_driver() -> None:
    """A malformed handle is INVALID_ARGUMENT even when no CUDA driver can be loaded (input is
    checked first)."""

    def load() -> FakeDriver:
        raise CudaUnavailable("absent")

    with pytest.raises(InvalidArgument):
        _import(CudaIpcImporter(load), handle=b"short")


def test_failed_size_query_closes_the_handle(importer: CudaIpcImporter, driver: FakeDriver) -> None:
    """When the mapped-size query fails after the open, the import raises INTERNAL and the opened
    handle is closed."""

    def broken(ordinal: int, address: int) -> int:
        raise CudaCallError("cuMemGetAddressRange", 1, "CUDA_ERROR_INVALID_VALUE", "x")

    driver.mapped_size = broken  # type: ignore[method-assign]
    with pytest.raises(InternalError):
        _import(importer)
    assert driver.open == {} and importer.live_handles() == 0


def test_close_errors_are_swallowed(importer: CudaIpcImporter, driver: FakeDriver) -> None:
    """A driver error while closing a mapping's handle is not raised, and the handle is still
    counted as released."""
    m = _import(importer)

    def broken(ordinal: int, address: int) -> None:
        raise CudaCallError("cuIpcCloseMemHandle", 1, "CUDA_ERROR_INVALID_VALUE", "x")

    driver.close_handle = broken  # type: ignore[method-assign]
    m.close()  # must not raise: it runs while a worker is being released
    assert importer.live_handles() == 0


# Shutdown and the process-wide importer ---------------------------------------------


def test_shutdown_closes_everything_and_releases_contexts(
    importer: CudaIpcImporter, driver: FakeDriver
) -> None:
    """Shutdown closes every open handle on every device and releases the retained contexts; later
    closes of its mappings are harmless no-ops."""
    a = _import(importer, uuid=format_uuid(UUIDS[0]))
    b = _import(importer, handle=H2, uuid=format_uuid(UUIDS[2]))
    importer.shutdown()
    assert driver.open == {} and driver.contexts == set()
    assert a.closed and b.closed and importer.live_handles() == 0
    a.close()  # after shutdown: nothing left to do, nothing raised
    assert importer.live_mappings() == 0


def test_import_allocation_reads_the_handle_fields(
    importer: CudaIpcImporter, driver: FakeDriver
) -> None:
    """import_allocation takes handle, offset, block size and UUID from an allocation and its
    cuda_ipc handle, ignoring the worker's device ordinal, and reports errors under the given
    field prefix."""
    alloc = AllocationSpec("kv0", 4096, DeviceRef(DeviceKind.CUDA, 5, format_uuid(UUIDS[0])))
    ipc = CudaIpcHandle(handle=H1, offset_bytes=1024, block_size_bytes=BLOCK)
    with import_allocation(alloc, ipc, field="allocations[3]", importer=importer) as m:
        # The worker's ordinal (5) is ignored; the daemon's (0) is what NIXL gets.
        assert m.dev_id == 0 and m.address == m.block_address + 1024 and m.size == 4096
    unsized = CudaIpcHandle(handle=H1, offset_bytes=1024, block_size_bytes=0)
    with pytest.raises(InvalidArgument) as e:
        import_allocation(alloc, unsized, field="allocations[3]", importer=importer)
    assert e.value.field == "allocations[3].cuda_ipc.block_size_bytes"


# The ctypes layer, where this machine has no driver ----------------------------------


def test_missing_libcuda_is_cuda_unavailable() -> None:
    """Loading a libcuda path that does not exist raises CudaUnavailable naming the path."""
    with pytest.raises(CudaUnavailable, match=r"cannot load /nonexistent/libcuda\.so\.1"):
        LibCuda("/nonexistent/libcuda.so.1")


def test_library_without_driver_symbols_is_cuda_unavailable() -> None:
    """Loading a library that lacks the driver's symbols (libc) raises CudaUnavailable naming the
    missing symbol."""
    with pytest.raises(CudaUnavailable, match="has no cuGetErrorName"):
        LibCuda("libc.so.6")
