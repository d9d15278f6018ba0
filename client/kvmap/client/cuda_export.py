"""Worker side: export CUDA tensors' memory as CUDA IPC handles.

torch's ``UntypedStorage._share_cuda_()`` returns an 8-tuple

    (device, handle, storage_size_bytes, storage_offset_bytes,
     ref_counter_handle, ref_counter_offset, event_handle, event_sync_required)

where ``handle`` names the whole ``cudaMalloc`` block the caching allocator
carved the storage from and ``storage_offset_bytes`` is where the storage
starts inside it. Since torch 2.2 ``handle`` is versioned: a version byte
(2), a type byte (``c``: a legacy ``cudaIpcMemHandle_t`` of 64 bytes
follows; ``e``: an expandable segment's cuMem handle follows), older torch
gives the 64 bytes alone. kvmapd opens legacy handles with
``cudaIpcOpenMemHandle``; storages in expandable segments
(``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) cannot be opened that
way, and export refuses them with a message saying so.

What the daemon gets per storage (``CudaIpcHandle``): the raw 64-byte
handle, the storage's offset in the IPC block, and the size of the whole
block (from the caching allocator's segment list), so it can map the block
once and bounds-check every view against it. Nothing here needs a GPU to be
tested: the torch calls are parameters.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvmap.client.shm_export import SharedView
from kvmap.v1 import types_pb2

CUDA_IPC_HANDLE_SIZE = 64
HANDLE_VERSION = 2
TYPE_CUDA_MALLOC = ord("c")
TYPE_EXPANDABLE_SEGMENT = ord("e")

ShareFn = Callable[[Any], tuple[Any, ...]]
SegmentsFn = Callable[[], list[dict[str, Any]]]
UuidFn = Callable[[int], str]


class CudaExportError(ValueError):
    pass


class ExpandableSegmentsError(CudaExportError):
    pass


EXPANDABLE_HINT = (
    "the KV cache lives in an expandable segment (PYTORCH_CUDA_ALLOC_CONF has "
    "expandable_segments:True); kvmapd opens legacy CUDA IPC handles only: start vLLM "
    "without expandable_segments"
)


@dataclass(frozen=True)
class SharedCuda:
    """``_share_cuda_()``'s answer, parsed."""

    device_index: int
    handle: bytes  # the raw cudaIpcMemHandle_t
    storage_size_bytes: int
    offset_bytes: int  # the storage's offset inside the IPC block


@dataclass(frozen=True)
class CudaStorage:
    """One exported backing storage."""

    device_index: int
    device_uuid: str
    handle: bytes
    offset_bytes: int
    storage_size_bytes: int
    block_size_bytes: int
    data_ptr: int

    def allocation(self, alloc_id: str) -> types_pb2.Allocation:
        """The registration's ``Allocation`` for this storage."""
        return types_pb2.Allocation(
            id=alloc_id,
            size_bytes=self.storage_size_bytes,
            device=types_pb2.Device(
                type=types_pb2.DEVICE_TYPE_CUDA, index=self.device_index, uuid=self.device_uuid
            ),
            cuda_ipc=types_pb2.CudaIpcHandle(
                handle=self.handle,
                offset_bytes=self.offset_bytes,
                block_size_bytes=self.block_size_bytes,
            ),
        )


def expandable_segments_enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether torch's CUDA allocator is configured for expandable segments."""
    env = os.environ if env is None else env
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        for item in env.get(var, "").split(","):
            key, _, value = item.partition(":")
            if key.strip() == "expandable_segments" and value.strip().lower() == "true":
                return True
    return False


def parse_share_cuda(result: Sequence[Any]) -> SharedCuda:
    if len(result) != 8:
        raise CudaExportError(f"_share_cuda_() returned {len(result)} fields, expected 8")
    device, handle, size, offset = result[0], result[1], result[2], result[3]
    if isinstance(handle, str):
        handle = handle.encode("latin-1")
    if not isinstance(handle, bytes | bytearray):
        raise CudaExportError(f"_share_cuda_() handle is {type(handle).__name__}, not bytes")
    raw = bytes(handle)
    if len(raw) == CUDA_IPC_HANDLE_SIZE:
        pass  # torch < 2.2: the legacy handle alone
    elif len(raw) >= 2 and raw[0] == HANDLE_VERSION:
        if raw[1] == TYPE_EXPANDABLE_SEGMENT:
            raise ExpandableSegmentsError(EXPANDABLE_HINT)
        if raw[1] != TYPE_CUDA_MALLOC or len(raw) != 2 + CUDA_IPC_HANDLE_SIZE:
            raise CudaExportError(
                f"unknown CUDA IPC handle type {raw[1]!r} ({len(raw)} bytes) from torch"
            )
        raw = raw[2:]
    else:
        raise CudaExportError(f"unrecognised CUDA IPC handle of {len(raw)} bytes from torch")
    if int(size) <= 0 or int(offset) < 0:
        raise CudaExportError(f"bad storage size {size} or offset {offset} from torch")
    return SharedCuda(int(device), raw, int(size), int(offset))


def segment_size(segments: Sequence[Mapping[str, Any]], device: int, address: int) -> int | None:
    """Size of the caching allocator's segment (one cudaMalloc block) that
    starts at ``address`` on ``device``."""
    for seg in segments:
        if int(seg.get("device", device)) == device and int(seg["address"]) == address:
            return int(seg["total_size"])
    return None


def _torch_share(storage: Any) -> tuple[Any, ...]:
    return tuple(storage._share_cuda_())


def _torch_segments() -> list[dict[str, Any]]:
    snapshot: Any = torch.cuda.memory.memory_snapshot  # untyped in torch
    return list(snapshot())


def _torch_uuid(device: int) -> str:
    return f"GPU-{torch.cuda.get_device_properties(device).uuid}"


def export_cuda_tensors(
    tensors: Sequence[Any],
    *,
    share: ShareFn = _torch_share,
    segments: SegmentsFn = _torch_segments,
    uuid: UuidFn = _torch_uuid,
    env: Mapping[str, str] | None = None,
) -> tuple[list[CudaStorage], list[SharedView]]:
    """Export every distinct CUDA storage behind ``tensors`` once; for each
    tensor, its storage index and byte offset in the storage."""
    if expandable_segments_enabled(env):
        raise ExpandableSegmentsError(EXPANDABLE_HINT)
    storages: list[CudaStorage] = []
    index_of: dict[int, int] = {}
    views: list[SharedView] = []
    segs: list[dict[str, Any]] | None = None
    for i, tensor in enumerate(tensors):
        storage, key = _cuda_storage(i, tensor)
        if key not in index_of:
            shared = parse_share_cuda(share(storage))
            # The segment list is a snapshot of the whole allocator: taken
            # once, and only when some storage needs exporting.
            if segs is None:
                segs = segments()
            storages.append(_exported(i, key, shared, segs, uuid))
            index_of[key] = len(storages) - 1
        offset = int(tensor.storage_offset()) * int(tensor.element_size())
        views.append(SharedView(index_of[key], offset))
    return storages, views


def _cuda_storage(i: int, tensor: Any) -> tuple[Any, int]:
    """``tensors[i]``'s storage and its address, which identifies it among
    the tensors (layers may share one storage)."""
    if tensor.device.type != "cuda":
        raise CudaExportError(f"tensors[{i}]: on {tensor.device}, not a CUDA device")
    storage = tensor.untyped_storage()
    key = int(storage.data_ptr())
    if key == 0:
        raise CudaExportError(f"tensors[{i}]: its storage is empty")
    return storage, key


def _exported(
    i: int, data_ptr: int, shared: SharedCuda, segs: Sequence[Mapping[str, Any]], uuid: UuidFn
) -> CudaStorage:
    """The export of ``tensors[i]``'s storage, with the size of the IPC block
    it lies in so the daemon can map that block whole."""
    base = data_ptr - shared.offset_bytes
    block = segment_size(segs, shared.device_index, base)
    if block is None:
        # Not from the caching allocator's list: the storage is all we know.
        block = shared.offset_bytes + shared.storage_size_bytes
    if shared.offset_bytes + shared.storage_size_bytes > block:
        raise CudaExportError(
            f"tensors[{i}]: storage [{shared.offset_bytes}, "
            f"+{shared.storage_size_bytes}) exceeds its {block}-byte IPC block"
        )
    return CudaStorage(
        device_index=shared.device_index,
        device_uuid=uuid(shared.device_index),
        handle=shared.handle,
        offset_bytes=shared.offset_bytes,
        storage_size_bytes=shared.storage_size_bytes,
        block_size_bytes=block,
        data_ptr=data_ptr,
    )
