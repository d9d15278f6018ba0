"""How fast one pull can copy with more than one copying thread: raw NIXL
(no daemon) reading one buffer from another process, cut into K equal parts,
each part posted and progressed to completion by its own thread through its
own NIXL agent (its own UCX context and worker), next to single-thread
memcpy in the same run. docs/benchmarks.md ("Bandwidth of one pull")
records a run.

    python -m kvmap.tools.bench.copy_threads [--mib 256] [--threads 1,2] [--repeats 5]
                                             [--json FILE]

The figures are JSON, on stdout or in ``--json FILE`` (NIXL logs its own
lines to stdout).

Each thread's agent is created, registered and called on that thread only:
no NIXL object is shared between threads. (Two threads calling one agent
with two UCX workers copied as fast, but NIXL 1.5.1 crashed with SIGSEGV
once the thread that had set the agent up posted alongside another: that
is why kvmapd keeps one NIXL thread, and why this measures per-thread
agents.) On loopback a READ's bytes are copied by the initiator with CMA
(``process_vm_readv``) on the thread that drives its worker, so K threads
are K copies at once.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import multiprocessing.connection
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvmap.daemon.adapters.nixl_agent import NixlAgent, XferOp, XferState
from kvmap.tools.bench import host

MIB = 1 << 20
# A hang guard for one copy (seconds), far above any figure measured here.
COPY_TIMEOUT_S = 60.0


def _target(conn: multiprocessing.connection.Connection, nbytes: int) -> None:
    """The owner process: registers its buffer, hands out its metadata and
    address, and drives its worker until told to stop."""
    agent = NixlAgent.create(f"copy-target-{os.getpid()}")
    source = np.full(nbytes, 0x5A, dtype=np.uint8)
    agent.register_dram(source.ctypes.data, nbytes)
    conn.send((agent.metadata(), source.ctypes.data))
    while not conn.poll():
        agent.take_notifs()  # a call into the agent: UCX progresses
        time.sleep(0.0005)
    agent.close()


class _CopyThread:
    """One thread with its own agent, copying bytes ``[start, stop)`` on every round."""

    def __init__(
        self,
        index: int,
        start: int,
        stop: int,
        dst: np.ndarray[Any, Any],
        *,
        owner_metadata: bytes,
        src: int,
    ):
        self.index, self.start, self.stop, self.dst = index, start, stop, dst
        self.owner_metadata, self.src = owner_metadata, src
        self.ready = threading.Event()
        self.error: BaseException | None = None

    def run(self, go: threading.Barrier, done: threading.Barrier, rounds: int) -> None:
        try:
            self._run(go, done, rounds)
        except BaseException as err:  # reported by the driver
            self.error = err
            self.ready.set()
            go.abort()
            done.abort()

    def _run(self, go: threading.Barrier, done: threading.Barrier, rounds: int) -> None:
        agent = NixlAgent.create(f"copy-{os.getpid()}-{self.index}")
        try:
            base = self.dst.ctypes.data
            agent.register_dram(base, self.dst.nbytes)
            remote = agent.add_remote(self.owner_metadata)
            length = self.stop - self.start
            local_rows = np.array([[base + self.start, length, 0]], dtype=np.uint64)
            remote_rows = np.array([[self.src + self.start, length, 0]], dtype=np.uint64)
            self.ready.set()
            for _ in range(rounds):
                go.wait()
                xfer = agent.post_descs(XferOp.READ, local_rows, remote_rows, remote)
                deadline = time.monotonic() + COPY_TIMEOUT_S
                while agent.poll(xfer) is XferState.PROC:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"copy thread {self.index}: no completion")
                agent.release(xfer)
                if xfer.state is not XferState.DONE:
                    raise RuntimeError(f"copy thread {self.index}: {xfer.error}")
                done.wait()
        finally:
            agent.close()


def copy_gbps(
    nbytes: int, threads: int, repeats: int, owner_metadata: bytes, src: int
) -> dict[str, Any]:
    """GB/s of one ``nbytes`` READ cut into ``threads`` parts copied at once
    (median of ``repeats`` after a warm-up round), every byte checked."""
    dst = np.zeros(nbytes, dtype=np.uint8)
    cuts = np.linspace(0, nbytes, threads + 1).astype(int)
    workers = [
        _CopyThread(i, int(cuts[i]), int(cuts[i + 1]), dst, owner_metadata=owner_metadata, src=src)
        for i in range(threads)
    ]
    go, done = threading.Barrier(threads + 1), threading.Barrier(threads + 1)
    running = [
        threading.Thread(target=w.run, args=(go, done, repeats + 1), daemon=True) for w in workers
    ]
    for t in running:
        t.start()
    samples = []
    try:
        for w in workers:
            w.ready.wait(COPY_TIMEOUT_S)
        for _ in range(repeats + 1):
            dst[::4096] = 0
            start = time.perf_counter()
            go.wait(COPY_TIMEOUT_S)
            done.wait(COPY_TIMEOUT_S)
            samples.append(time.perf_counter() - start)
            if not (dst == 0x5A).all():
                raise RuntimeError(f"{threads} threads: bytes differ from the source")
    except threading.BrokenBarrierError:
        errors = [w.error for w in workers if w.error is not None]
        raise RuntimeError(f"{threads} threads: {errors}") from None
    finally:
        for t in running:
            t.join(COPY_TIMEOUT_S)
    seconds = statistics.median(samples[1:])
    return {"threads": threads, "gbps": nbytes / seconds / 1e9, "bytes": nbytes}


def run(mib: int, threads: list[int], repeats: int) -> list[dict[str, Any]]:
    nbytes = mib * MIB
    memcpy = host.memcpy_gbps(nbytes)
    rows: list[dict[str, Any]] = [{"variant": "memcpy, one thread", "gbps": memcpy}]
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    owner = ctx.Process(target=_target, args=(child, nbytes), daemon=True)
    owner.start()
    try:
        if not parent.poll(COPY_TIMEOUT_S):
            raise TimeoutError("the owner process did not start")
        owner_metadata, src = parent.recv()
        for k in threads:
            fig = copy_gbps(nbytes, k, repeats, owner_metadata, src)
            rows.append({"variant": f"{k} copy threads, an agent each", **fig})
            print(f"  .. {k} copy threads: {fig['gbps']:.2f} GB/s", file=sys.stderr, flush=True)
    finally:
        parent.send("stop")
        owner.join(COPY_TIMEOUT_S)
        if owner.is_alive():
            owner.kill()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvmap.tools.bench.copy_threads", allow_abbrev=False)
    p.add_argument("--mib", type=int, default=256, help="bytes of the one READ (MiB)")
    p.add_argument("--threads", default="1,2", help="copy threads to try, comma-separated")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", metavar="FILE", help="write the figures here, not to stdout")
    args = p.parse_args(argv)
    # UCX stays on loopback, as in every kvmap bench (inherited by the owner).
    os.environ["UCX_NET_DEVICES"] = "lo"
    threads = [int(k) for k in args.threads.split(",") if k]
    figures = json.dumps(run(args.mib, threads, args.repeats), indent=1)
    if args.json:
        Path(args.json).write_text(figures + "\n")
    else:
        print(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
