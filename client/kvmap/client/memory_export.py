"""A worker's KV memory exported for its daemon: the one step of
registering that changes the worker's memory. ``geometry.build_registration``
then describes the registration over what this exported, and moves nothing.

CPU storages are moved, in place, into sealed shared memory
(``shm_export``: every byte copied once per storage, every tensor viewing
the storage following it) and travel as fds over the fd hand-off socket;
CUDA storages are exported as IPC handles (``cuda_export``: nothing is
copied). Each distinct storage is one allocation, whatever number of layers
it backs; one export is either shared memory or CUDA IPC.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvmap.client import cuda_export, shm_export
from kvmap.v1 import types_pb2


@dataclass(frozen=True)
class ExportedMemory:
    """What an export made of a list of tensors: one ``Allocation`` per
    distinct storage (ids ``kv0``, ``kv1``, ...; a shared-memory one names
    its fd by index into ``fds``), the fds to send with the registration
    (none for CUDA IPC), and, per input tensor, the index of its storage."""

    allocations: list[types_pb2.Allocation]
    fds: list[int]
    storage_of: list[int]


def allocation_id(storage_index: int) -> str:
    """The id of the allocation of an export's ``storage_index``-th storage."""
    return f"kv{storage_index}"


def export_memory(tensors: Sequence[torch.Tensor]) -> ExportedMemory:
    """Export every distinct storage behind ``tensors`` once (the module
    docstring says how); they must all be on one device type."""
    devices = {t.device.type for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"one export is of one device type, not {sorted(devices)}")
    if devices == {"cpu"}:
        return _export_shm(tensors)
    return _export_cuda(tensors)


def _export_shm(tensors: Sequence[torch.Tensor]) -> ExportedMemory:
    """Move CPU storages into shared memory: one allocation and one fd each."""
    storages, placed = shm_export.export_tensors(tensors)
    allocations = [
        types_pb2.Allocation(
            id=allocation_id(i),
            size_bytes=s.size_bytes,
            device=types_pb2.Device(type=types_pb2.DEVICE_TYPE_CPU),
            shm_fd=types_pb2.ShmFdHandle(index=i),
        )
        for i, s in enumerate(storages)
    ]
    return ExportedMemory(allocations, [s.fd for s in storages], [p.storage_index for p in placed])


def _export_cuda(tensors: Sequence[torch.Tensor]) -> ExportedMemory:
    """Export CUDA storages as IPC handles: one allocation each, no fds."""
    storages, placed = cuda_export.export_cuda_tensors(tensors)
    allocations = [c.allocation(allocation_id(i)) for i, c in enumerate(storages)]
    return ExportedMemory(allocations, [], [p.storage_index for p in placed])
