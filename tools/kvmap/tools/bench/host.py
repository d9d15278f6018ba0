"""The machine the bench runs on: what it is, and how fast it copies memory
(the limit a CPU pull can approach)."""

from __future__ import annotations

import contextlib
import itertools
import os
import platform
import statistics
import threading
import time

import numpy as np

from kvmap.tools.bench.results import Machine


def memcpy_gbps(nbytes: int, rounds: int = 5) -> float:
    """Single-thread memcpy between two resident buffers: the physical limit
    a single-stream CPU pull can approach. Median of ``rounds``."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    np.copyto(dst, src)  # touch both
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        np.copyto(dst, src)
        samples.append(time.perf_counter() - start)
    return nbytes / statistics.median(samples) / 1e9


def memcpy_all_cores_gbps(nbytes: int, rounds: int = 5) -> float:
    """Every core copying its own slice of two resident buffers at once
    (numpy releases the GIL while it copies). Median of ``rounds``."""
    cores = max(1, os.cpu_count() or 1)
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    np.copyto(dst, src)
    cuts = np.linspace(0, nbytes, cores + 1).astype(int)
    slices = [slice(int(a), int(b)) for a, b in itertools.pairwise(cuts)]

    def copy(sl: slice, gate: threading.Barrier) -> None:
        gate.wait()
        np.copyto(dst[sl], src[sl])

    samples = []
    for _ in range(rounds):
        gate = threading.Barrier(cores + 1)
        threads = [threading.Thread(target=copy, args=(sl, gate)) for sl in slices]
        for t in threads:
            t.start()
        gate.wait()
        start = time.perf_counter()
        for t in threads:
            t.join()
        samples.append(time.perf_counter() - start)
    return nbytes / statistics.median(samples) / 1e9


def machine() -> Machine:
    mem = 0
    with contextlib.suppress(OSError), open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return Machine(
        cpu=cpu,
        cpus=os.cpu_count(),
        memory_bytes=mem,
        kernel=platform.release(),
        python=platform.python_version(),
        transport="NIXL UCX backend over loopback (UCX_NET_DEVICES=lo)",
    )


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """utime + stime so far of process ``pid`` (all its threads, those that
    ended included) or, with ``tid``, of that one thread; from /proc."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    with open(path, encoding="ascii") as f:
        utime, stime = f.read().rpartition(")")[2].split()[11:13]
    return (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")
