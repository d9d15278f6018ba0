"""The machine the bench runs on: what it is, how fast it copies memory
(the limit a CPU pull can approach), and what its processes spend (CPU
seconds, context switches)."""

from __future__ import annotations

import contextlib
import glob
import itertools
import os
import platform
import resource
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


def thread_switches(pid: int) -> dict[int, int]:
    """Context switches so far (voluntary and not) of each live thread of
    process ``pid``, by thread id; from /proc. Each is a time the thread
    left a core: it blocked (waiting for a socket, a lock, a queue, a
    timer) or was preempted, and every one it blocked for costs a wake."""
    out: dict[int, int] = {}
    for task in glob.glob(f"/proc/{pid}/task/*"):
        # A thread may end while it is read: it is simply not counted.
        with contextlib.suppress(OSError, ValueError):
            with open(f"{task}/status", encoding="ascii") as f:
                counts = [line.split()[1] for line in f if "ctxt_switches:" in line]
            out[int(task.rpartition("/")[2])] = sum(int(n) for n in counts)
    return out


def switches_between(before: dict[int, int], after: dict[int, int]) -> int:
    """Context switches between two ``thread_switches`` readings: each
    thread's own difference, a thread that began in between all of its
    count; one that ended in between counts nothing (it is gone)."""
    return sum(n - before.get(tid, 0) for tid, n in after.items())


def own_switches() -> int:
    """Context switches so far of this process: every thread, those that
    ended included (getrusage), where /proc loses a thread once it ends."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_nvcsw + usage.ru_nivcsw


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """utime + stime so far of process ``pid`` (all its threads, those that
    ended included) or, with ``tid``, of that one thread; from /proc."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    with open(path, encoding="ascii") as f:
        utime, stime = f.read().rpartition(")")[2].split()[11:13]
    return (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")
