"""The CUDA driver API through ctypes: the only module in kvmap that touches
``libcuda.so.1``.

kvmapd links no CUDA runtime and imports no CUDA build of torch: it needs a
handful of driver calls to open the IPC handles its workers send (see
``cuda_ipc``, which holds all the logic and is tested against a fake of
this class). Everything here is a thin, typed wrapper: it keeps no state
beyond the library handle and the primary contexts it retained, and turns
every non-zero ``CUresult`` into ``CudaCallError`` with the driver's own name
and description of the error.

Contexts: kvmapd uses each device's *primary* context (the one the CUDA
runtime, torch and UCX use too), retained once per device, and makes it
current only around its own calls (push/pop), so a thread that had another
context current (a NIXL thread, say) finds it unchanged.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

LIBCUDA = "libcuda.so.1"
IPC_HANDLE_SIZE = 64  # sizeof(CUipcMemHandle)
UUID_SIZE = 16  # sizeof(CUuuid)
# Enable peer access lazily when the memory lives on another device than the
# context's: required by cuIpcOpenMemHandle, harmless on the same device.
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1

_CUresult = ctypes.c_int
_CUdevice = ctypes.c_int
_CUcontext = ctypes.c_void_p
_CUdeviceptr = ctypes.c_uint64


class _IpcMemHandle(ctypes.Structure):
    # Passed by value to cuIpcOpenMemHandle, as in cuda.h.
    _fields_ = [("reserved", ctypes.c_ubyte * IPC_HANDLE_SIZE)]


class _Uuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * UUID_SIZE)]


# The driver calls LibCuda binds; every one returns a CUresult.
_SIGNATURES: dict[str, tuple[tuple[str, ...], list[Any]]] = {
    # name: (symbols to try, newest first; argtypes)
    "cuGetErrorName": (("cuGetErrorName",), [_CUresult, ctypes.POINTER(ctypes.c_char_p)]),
    "cuGetErrorString": (
        ("cuGetErrorString",),
        [_CUresult, ctypes.POINTER(ctypes.c_char_p)],
    ),
    "cuInit": (("cuInit",), [ctypes.c_uint]),
    "cuDeviceGetCount": (("cuDeviceGetCount",), [ctypes.POINTER(ctypes.c_int)]),
    "cuDeviceGet": (("cuDeviceGet",), [ctypes.POINTER(_CUdevice), ctypes.c_int]),
    # _v2 reports a MIG instance's own UUID, as nvidia-smi -L does.
    "cuDeviceGetUuid": (
        ("cuDeviceGetUuid_v2", "cuDeviceGetUuid"),
        [ctypes.POINTER(_Uuid), _CUdevice],
    ),
    "cuDevicePrimaryCtxRetain": (
        ("cuDevicePrimaryCtxRetain",),
        [ctypes.POINTER(_CUcontext), _CUdevice],
    ),
    "cuDevicePrimaryCtxRelease": (
        ("cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease"),
        [_CUdevice],
    ),
    "cuCtxPushCurrent": (("cuCtxPushCurrent_v2", "cuCtxPushCurrent"), [_CUcontext]),
    "cuCtxPopCurrent": (
        ("cuCtxPopCurrent_v2", "cuCtxPopCurrent"),
        [ctypes.POINTER(_CUcontext)],
    ),
    "cuIpcOpenMemHandle": (
        ("cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle"),
        [ctypes.POINTER(_CUdeviceptr), _IpcMemHandle, ctypes.c_uint],
    ),
    "cuIpcCloseMemHandle": (("cuIpcCloseMemHandle",), [_CUdeviceptr]),
    "cuMemGetAddressRange": (
        ("cuMemGetAddressRange_v2", "cuMemGetAddressRange"),
        [ctypes.POINTER(_CUdeviceptr), ctypes.POINTER(ctypes.c_size_t), _CUdeviceptr],
    ),
}


class CudaUnavailable(Exception):
    """libcuda cannot be loaded or initialised in this process."""


class CudaCallError(Exception):
    """A driver call returned an error. ``name`` is the CUresult's name
    (``CUDA_ERROR_INVALID_VALUE``), ``description`` the driver's text."""

    def __init__(self, call: str, code: int, name: str, description: str) -> None:
        super().__init__(f"{call}: {name} ({description})")
        self.call = call
        self.code = code
        self.name = name
        self.description = description


class LibCuda:
    """The driver calls kvmapd makes. Constructing one runs ``cuInit``."""

    def __init__(self, path: str = LIBCUDA) -> None:
        try:
            self._lib = ctypes.CDLL(path)
        except OSError as e:
            raise CudaUnavailable(f"cannot load {path}: {e}") from e
        self._f: dict[str, Any] = {}
        for name, (symbols, argtypes) in _SIGNATURES.items():
            fn = next((getattr(self._lib, s) for s in symbols if hasattr(self._lib, s)), None)
            if fn is None:
                raise CudaUnavailable(f"{path} has no {symbols[0]} (driver too old)")
            fn.argtypes = argtypes
            fn.restype = _CUresult
            self._f[name] = fn
        try:
            self._call("cuInit", 0)
        except CudaCallError as e:
            raise CudaUnavailable(str(e)) from e
        self._contexts: dict[int, int] = {}  # ordinal -> retained primary CUcontext

    def _describe(self, code: int) -> tuple[str, str]:
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        if self._f["cuGetErrorName"](code, ctypes.byref(name)) != 0 or not name.value:
            return f"CUresult {code}", "unknown error"
        self._f["cuGetErrorString"](code, ctypes.byref(text))
        return name.value.decode(), (text.value or b"").decode()

    def _call(self, name: str, *args: Any) -> None:
        code = int(self._f[name](*args))
        if code != 0:
            raise CudaCallError(name, code, *self._describe(code))

    # -- devices -----------------------------------------------------------

    def device_uuids(self) -> list[bytes]:
        """The UUID of every device this process sees, by ordinal."""
        count = ctypes.c_int()
        self._call("cuDeviceGetCount", ctypes.byref(count))
        uuids = []
        for ordinal in range(count.value):
            uuid = _Uuid()
            self._call("cuDeviceGetUuid", ctypes.byref(uuid), self._device(ordinal))
            uuids.append(bytes(uuid.bytes))
        return uuids

    def _device(self, ordinal: int) -> int:
        dev = _CUdevice()
        self._call("cuDeviceGet", ctypes.byref(dev), ordinal)
        return int(dev.value)

    def retain_context(self, ordinal: int) -> None:
        """Retain the device's primary context (once; later calls do nothing)."""
        if ordinal in self._contexts:
            return
        ctx = _CUcontext()
        self._call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), self._device(ordinal))
        self._contexts[ordinal] = int(ctx.value or 0)

    def release_context(self, ordinal: int) -> None:
        if self._contexts.pop(ordinal, None) is not None:
            self._call("cuDevicePrimaryCtxRelease", self._device(ordinal))

    @contextmanager
    def context(self, ordinal: int) -> Iterator[None]:
        """Make the device's retained primary context current around a block."""
        self._call("cuCtxPushCurrent", _CUcontext(self._contexts[ordinal]))
        try:
            yield
        finally:
            self._call("cuCtxPopCurrent", ctypes.byref(_CUcontext()))

    # -- IPC -----------------------------------------------------------------

    def open_handle(self, ordinal: int, handle: bytes) -> int:
        """Map the cudaMalloc block behind ``handle``; returns its base address."""
        raw = _IpcMemHandle()
        ctypes.memmove(raw.reserved, handle, IPC_HANDLE_SIZE)
        ptr = _CUdeviceptr()
        with self.context(ordinal):
            self._call(
                "cuIpcOpenMemHandle", ctypes.byref(ptr), raw, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
            )
        return int(ptr.value)

    def close_handle(self, ordinal: int, address: int) -> None:
        with self.context(ordinal):
            self._call("cuIpcCloseMemHandle", _CUdeviceptr(address))

    def mapped_size(self, ordinal: int, address: int) -> int:
        """Size of the allocation (here: the IPC mapping) that starts at ``address``."""
        base, size = _CUdeviceptr(), ctypes.c_size_t()
        with self.context(ordinal):
            self._call("cuMemGetAddressRange", ctypes.byref(base), ctypes.byref(size), address)
        return int(size.value)


__all__ = ["LIBCUDA", "CudaCallError", "CudaUnavailable", "LibCuda"]
