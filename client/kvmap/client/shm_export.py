"""Worker side: export CPU tensors' memory as shared-memory file descriptors.

``share_memory_()`` moves a tensor's storage into shared memory *in place*
(every view of the storage follows, since they share one StorageImpl); torch's
``file_descriptor`` strategy creates it with ``shm_open`` and unlinks the name
at once, so nothing is left in ``/dev/shm`` if the worker crashes. The fd from
``_share_fd_cpu_()`` is then sent to the daemon over the fd hand-off socket.

Views are grouped by backing storage, so a storage holding many layer views is
exported (and registered by the daemon) once. The fd belongs to the storage:
do not close it; it stays valid while the storage lives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class SharedStorage:
    """One exported backing storage."""

    fd: int
    size_bytes: int
    data_ptr: int  # after sharing: where the storage now lives in this process


@dataclass(frozen=True)
class SharedView:
    """Where one input tensor lives: which storage, at which byte offset."""

    storage_index: int
    offset_bytes: int


def export_tensor(tensor: torch.Tensor) -> tuple[int, int, int]:
    """Share ``tensor``'s storage in place; return (fd, storage size, byte offset)."""
    storages, views = export_tensors([tensor])
    return storages[0].fd, storages[0].size_bytes, views[0].offset_bytes


def export_tensors(
    tensors: Sequence[torch.Tensor],
) -> tuple[list[SharedStorage], list[SharedView]]:
    """Share every distinct storage behind ``tensors`` once.

    Returns the storages in first-seen order and, for each input tensor, its
    storage index and byte offset inside that storage.
    """
    storages: list[SharedStorage] = []
    index_of: dict[int, int] = {}  # storage data_ptr after sharing -> index
    views: list[SharedView] = []
    for i, tensor in enumerate(tensors):
        _check(tensor, i)
        # Share before keying: sharing moves the storage, so a view's pointer
        # before sharing would not match a sibling view's pointer after it.
        # On a storage that is already shared this is a no-op.
        shareable: Any = tensor  # share_memory_ is untyped in torch's stubs
        shareable.share_memory_()
        key = int(tensor.untyped_storage().data_ptr())
        if key not in index_of:
            index_of[key] = len(storages)
            storages.append(_fd_of(tensor, i))
        offset = int(tensor.storage_offset()) * tensor.element_size()
        views.append(SharedView(index_of[key], offset))
    return storages, views


def _check(tensor: torch.Tensor, i: int) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensors[{i}]: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"tensors[{i}]: on {tensor.device}; only CPU tensors export as shm")
    if tensor.untyped_storage().nbytes() == 0:
        # An empty storage has no memory (data_ptr 0) and nothing to share.
        raise ValueError(f"tensors[{i}]: its storage is empty")


def _fd_of(tensor: torch.Tensor, i: int) -> SharedStorage:
    storage: Any = tensor.untyped_storage()
    try:
        fd, size = storage._share_fd_cpu_()
    except RuntimeError as e:
        # e.g. a storage already shared under the file_system strategy.
        raise ValueError(f"tensors[{i}]: cannot export its storage as an fd: {e}") from e
    return SharedStorage(int(fd), int(size), int(storage.data_ptr()))
