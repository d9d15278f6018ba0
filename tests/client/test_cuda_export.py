"""CUDA IPC export, as far as a CPU allows: torch's ``_share_cuda_`` tuple,
the handle formats, expandable-segment detection, grouping by storage."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from kvmap.client.cuda_export import (
    CudaExportError,
    ExpandableSegmentsError,
    expandable_segments_enabled,
    export_cuda_tensors,
    parse_share_cuda,
)

RAW = bytes(range(64))


def share_tuple(handle: bytes, size: int = 4096, offset: int = 512) -> tuple[Any, ...]:
    return (0, handle, size, offset, b"ref", 0, b"event", True)


@pytest.mark.parametrize(
    "handle", [RAW, b"\x02c" + RAW, (b"\x02c" + RAW).decode("latin-1")], ids=["v1", "v2", "str"]
)
def test_legacy_handles_parse_to_the_raw_ipc_handle(handle: Any) -> None:
    """torch's _share_cuda_ result with a raw 64-byte handle, a version-prefixed one, or the same as
    a str, parses to the raw handle, device, storage size and offset."""
    got = parse_share_cuda(share_tuple(handle))
    assert (got.device_index, got.handle, got.storage_size_bytes, got.offset_bytes) == (
        0,
        RAW,
        4096,
        512,
    )


def test_expandable_segment_handle_is_refused_with_the_fix() -> None:
    """An expandable-segment handle is refused with ExpandableSegmentsError mentioning the
    expandable_segments setting to change."""
    with pytest.raises(ExpandableSegmentsError, match="expandable_segments"):
        parse_share_cuda(share_tuple(b"\x02e" + b"\x00" * 40))


@pytest.mark.parametrize(
    "result",
    [
        share_tuple(b"\x02x" + RAW),
        share_tuple(b"short"),
        share_tuple(RAW, size=0),
        (0, RAW, 1, 0),
        share_tuple(12345),  # type: ignore[arg-type]
    ],
)
def test_malformed_share_results_are_refused(result: tuple[Any, ...]) -> None:
    """An unknown handle prefix, a short handle, a zero size, a truncated tuple or a non-bytes
    handle is refused with CudaExportError."""
    with pytest.raises(CudaExportError):
        parse_share_cuda(result)


@pytest.mark.parametrize(
    ("env", "enabled"),
    [
        ({}, False),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, True),
        ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128, expandable_segments:true"}, True),
        ({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, True),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, False),
    ],
)
def test_expandable_segments_detection(env: dict[str, str], enabled: bool) -> None:
    """Expandable segments count as enabled exactly when PYTORCH_CUDA_ALLOC_CONF or
    PYTORCH_ALLOC_CONF sets expandable_segments to true (any case, among other options)."""
    assert expandable_segments_enabled(env) is enabled


@dataclass
class FakeStorage:
    ptr: int

    def data_ptr(self) -> int:
        return self.ptr


@dataclass
class FakeTensor:
    storage: FakeStorage
    offset_elems: int
    device: Any = field(default_factory=lambda: SimpleNamespace(type="cuda"))

    def untyped_storage(self) -> FakeStorage:
        return self.storage

    def storage_offset(self) -> int:
        return self.offset_elems

    def element_size(self) -> int:
        return 2


def test_export_groups_views_by_storage_and_finds_the_ipc_block() -> None:
    """Each storage is shared once; its offset and size come from the share result and its block
    size from the caching allocator segment holding it, and views get their storage index and
    byte offset."""
    base = 0x7F00_0000_0000
    s1, s2 = FakeStorage(base + 1024), FakeStorage(base + 1024 + 8192)
    tensors = [FakeTensor(s1, 0), FakeTensor(s1, 100), FakeTensor(s2, 8)]
    shared = {s1.ptr: share_tuple(b"\x02c" + RAW, 8192, 1024), s2.ptr: share_tuple(RAW, 4096, 9216)}
    calls: list[int] = []

    def share(storage: FakeStorage) -> tuple[Any, ...]:
        calls.append(storage.ptr)
        return shared[storage.ptr]

    segments = [{"device": 0, "address": base, "total_size": 2 << 20}]
    storages, views = export_cuda_tensors(
        tensors, share=share, segments=lambda: segments, uuid=lambda d: f"GPU-{d}", env={}
    )
    assert calls == [s1.ptr, s2.ptr]  # each storage exported once
    assert [(s.offset_bytes, s.storage_size_bytes, s.block_size_bytes) for s in storages] == [
        (1024, 8192, 2 << 20),
        (9216, 4096, 2 << 20),
    ]
    assert all(s.handle == RAW and s.device_uuid == "GPU-0" for s in storages)
    assert [(v.storage_index, v.offset_bytes) for v in views] == [(0, 0), (0, 200), (1, 16)]


def test_export_without_a_known_segment_uses_the_storage_extent() -> None:
    """When no allocator segment holds the storage, the block size is the storage's own extent from
    the share result."""
    s = FakeStorage(0x1000)
    storages, _ = export_cuda_tensors(
        [FakeTensor(s, 0)],
        share=lambda _: share_tuple(RAW, 4096, 0),
        segments=lambda: [],
        uuid=lambda d: "GPU-x",
        env={},
    )
    assert storages[0].block_size_bytes == 4096


def test_export_refuses_expandable_segments_cpu_tensors_and_overruns() -> None:
    """Export refuses when expandable segments are enabled, for a CPU tensor, and when the storage
    would run past its allocator segment."""
    t = FakeTensor(FakeStorage(0x1000), 0)
    with pytest.raises(ExpandableSegmentsError):
        export_cuda_tensors([t], env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    cpu = FakeTensor(FakeStorage(0x1000), 0, device=SimpleNamespace(type="cpu"))
    with pytest.raises(CudaExportError, match="not a CUDA device"):
        export_cuda_tensors([cpu], env={})
    with pytest.raises(CudaExportError, match="exceeds"):
        export_cuda_tensors(
            [t],
            share=lambda _: share_tuple(RAW, 4096, 0),
            segments=lambda: [{"device": 0, "address": 0x1000, "total_size": 1024}],
            uuid=lambda d: "GPU-x",
            env={},
        )
