"""What the CUDA tests share: why they skip (said once, precisely), an
exporter process to open handles from, and byte copies through a device
address in this process (the daemon's side of an IPC mapping)."""

from __future__ import annotations

import ctypes
import json
import select
import subprocess
import sys
from pathlib import Path
from types import TracebackType
from typing import Any

from kvmap.daemon.adapters.cuda_driver import LIBCUDA, CudaUnavailable, LibCuda
from kvmap.daemon.adapters.nixl_loader import nixl_module

EXPORTER = Path(__file__).with_name("exporter.py")


def cuda_skip_reason() -> str:
    """Empty when this machine can run the CUDA tests; else why not."""
    try:
        import torch
    except ImportError as e:
        return f"needs a CUDA GPU: torch is not importable ({e})"
    if not torch.cuda.is_available():
        return (
            f"needs a CUDA GPU: torch {torch.__version__} sees none"
            " (torch.cuda.is_available() is False)"
        )
    try:
        LibCuda()
    except CudaUnavailable as e:
        return f"needs the CUDA driver: {e}"
    return ""


def nixl_skip_reason() -> str:
    try:
        nixl_module("_api")
    except ImportError as e:
        return f"needs NIXL: {e}"
    return ""


REASON = cuda_skip_reason()


class Exporter:
    """``exporter.py`` as a child process: ``info`` describes its storages."""

    def __init__(self, *sizes: int, timeout: float = 120.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(EXPORTER), *map(str, sizes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.info: dict[str, Any] = self._line(timeout)

    def _line(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.kill()
            raise RuntimeError(f"exporter gave no answer in {timeout}s")
        out: dict[str, Any] = json.loads(line)
        return out

    def storage(self, i: int) -> dict[str, Any]:
        s: dict[str, Any] = self.info["storages"][i]
        return s

    def read(self, i: int, off: int, n: int) -> bytes:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": "read", "i": i, "off": off, "n": n}) + "\n")
        self.proc.stdin.flush()
        return bytes.fromhex(self._line(60.0)["hex"])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)

    def __enter__(self) -> Exporter:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write('{"cmd": "exit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(30)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                pass
        self.kill()


def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(LIBCUDA)
    lib.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
    lib.cuMemcpyHtoD_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]
    return lib


def copy_out(driver: LibCuda, ordinal: int, address: int, n: int) -> bytes:
    """``n`` bytes at device ``address`` (mapped in this process)."""
    buf = ctypes.create_string_buffer(n)
    with driver.context(ordinal):
        rc = _lib().cuMemcpyDtoH_v2(buf, address, n)
    assert rc == 0, f"cuMemcpyDtoH: CUresult {rc}"
    return buf.raw


def copy_in(driver: LibCuda, ordinal: int, address: int, data: bytes) -> None:
    lib = _lib()
    with driver.context(ordinal):
        rc = lib.cuMemcpyHtoD_v2(address, data, len(data))
        # From pageable memory the call may return before the DMA lands.
        rc = rc or lib.cuCtxSynchronize()
    assert rc == 0, f"cuMemcpyHtoD: CUresult {rc}"
