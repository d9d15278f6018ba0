"""Facts about CUDA IPC on this machine that decide how kvmapd's GPU path
behaves, printed for the device run's record (tests/gpu/run_on_device.sh):

* the driver's devices and UUIDs, and whether a worker's UUID matches one;
* opening a worker's handle the way kvmapd does, and reading it back;
* whether memory kvmapd *imported* can be exported again (legacy IPC
  capable, cuIpcGetMemHandle): UCX's cuda_ipc transport packs such a handle
  for a remote peer, so this says whether daemon-to-daemon pulls on one node
  can use cuda_ipc or must fall back;
* the GPU memory of a process that holds what kvmapd holds (one primary
  context and one mapping), from nvidia-smi.

Exits 0 when the open and the read-back worked, whatever the other facts.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from cuda_env import REASON, Exporter, copy_out
from exporter import expected

from kvmap.daemon.adapters.cuda_driver import LIBCUDA, LibCuda
from kvmap.daemon.adapters.cuda_ipc import CudaIpcImporter, format_uuid

IS_LEGACY_CUDA_IPC_CAPABLE = 10  # CUpointer_attribute
SIZE = 4 << 20


def _reexport(driver: LibCuda, ordinal: int, address: int, original: bytes) -> str:
    lib = ctypes.CDLL(LIBCUDA)
    capable = ctypes.c_int(-1)
    lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
    lib.cuIpcGetMemHandle.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
    handle = ctypes.create_string_buffer(64)
    with driver.context(ordinal):
        rc1 = lib.cuPointerGetAttribute(ctypes.byref(capable), IS_LEGACY_CUDA_IPC_CAPABLE, address)
        rc2 = lib.cuIpcGetMemHandle(handle, address)
    same = "same as the worker's" if handle.raw == original else "a new handle"
    return (
        f"IS_LEGACY_CUDA_IPC_CAPABLE={capable.value} (CUresult {rc1}),"
        f" cuIpcGetMemHandle -> CUresult {rc2}" + (f" ({same})" if rc2 == 0 else "")
    )


def _own_gpu_mib() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({e})"
    for row in out.splitlines():
        pid, _, mib = row.partition(",")
        if pid.strip() == str(os.getpid()):
            return mib.strip()
    return "not listed by nvidia-smi"


def main() -> int:
    if REASON:
        print(f"ipc probe skipped: {REASON}")
        return 0
    driver = LibCuda()
    uuids = driver.device_uuids()
    print("kvmap CUDA IPC probe")
    print("  driver devices: " + ", ".join(f"{i}: {format_uuid(u)}" for i, u in enumerate(uuids)))
    imp = CudaIpcImporter(lambda: driver)
    with Exporter(SIZE) as ex:
        s = ex.storage(0)
        print(f"  worker (pid {ex.info['pid']}): {SIZE:,} bytes on {s['uuid']}, offset"
              f" {s['offset']:,} in a {s['block']:,}-byte block")  # fmt: skip
        raw = bytes.fromhex(s["handle"])
        with imp.import_handle(
            handle=raw, offset=s["offset"], size=s["size"], block_size=s["block"],
            device_uuid=s["uuid"], field="probe",
        ) as m:  # fmt: skip
            ok = copy_out(driver, m.dev_id, m.address, SIZE) == expected(0, SIZE)
            print(f"  opened as kvmapd does: ordinal {m.dev_id}, block at 0x{m.block_address:x},"
                  f" read back {'OK' if ok else 'WRONG BYTES'}")  # fmt: skip
            print(
                f"  imported memory re-export: {_reexport(driver, m.dev_id, m.block_address, raw)}"
            )
            print(f"  GPU memory of this process (primary context + mapping): {_own_gpu_mib()}")
    imp.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
