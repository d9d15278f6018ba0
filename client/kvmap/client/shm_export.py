"""Worker side: export CPU tensors' memory as shared-memory file descriptors.

A tensor's storage is moved *in place* (every view of the storage follows,
since they share one StorageImpl) into a memfd sealed against shrinking and
growing (``sealed_memfd``): the daemon maps the object and NIXL reads it, and
a file that could shrink under that mapping would kill the daemon with
SIGBUS, so the daemon refuses an fd without ``F_SEAL_SHRINK``. (torch's own
``share_memory_()`` uses ``shm_open``, whose files cannot be sealed.) A memfd
has no name, so nothing is left behind if the worker crashes. Its fd is then
sent to the daemon over the fd hand-off socket.

Views are grouped by backing storage, so a storage holding many layer views is
exported (and registered by the daemon) once. The fd belongs to the storage:
do not close it; it stays valid while the storage lives.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvmap.client.fd_handoff import is_sealed, sealed_memfd


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
        # Move before keying: moving changes the storage's pointer, so a
        # view's pointer before would not match a sibling view's after it.
        # On a storage already in a sealed memfd this is a no-op.
        _move_to_sealed_memfd(tensor.untyped_storage(), i)
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


def _move_to_sealed_memfd(storage: Any, i: int) -> None:
    """Move ``storage``'s bytes, in place, into a new sealed memfd (unless it
    lives in one already): every tensor viewing it follows."""
    if storage.is_shared() and _shared_fd_is_sealed(storage):
        return
    size = int(storage.nbytes())
    # Named after the process, as torch names its objects: /proc/<pid>/maps tells whose it is.
    fd = sealed_memfd(f"kvmap-kv-{os.getpid()}-{i}", size)
    try:
        untyped: Any = torch.UntypedStorage  # its private constructors are untyped
        moved = untyped._new_shared_fd_cpu(fd, size)  # maps a dup of fd
    finally:
        os.close(fd)
    moved.copy_(storage)
    # Swapped, not re-pointed per tensor: the storage keeps its identity, so
    # the tensors vLLM holds see the memfd's pages; ``moved`` now holds the
    # old memory and frees it when dropped.
    storage._swap_data_ptr_(moved)


def _shared_fd_is_sealed(storage: Any) -> bool:
    try:
        fd, _ = storage._share_fd_cpu_()  # the storage's own fd, not a new one
    except RuntimeError:  # shared under the file_system strategy: no fd
        return False
    return is_sealed(int(fd))


def _fd_of(tensor: torch.Tensor, i: int) -> SharedStorage:
    storage: Any = tensor.untyped_storage()
    try:
        fd, size = storage._share_fd_cpu_()
    except RuntimeError as e:
        # e.g. a storage already shared under the file_system strategy.
        raise ValueError(f"tensors[{i}]: cannot export its storage as an fd: {e}") from e
    return SharedStorage(int(fd), int(size), int(storage.data_ptr()))
