"""Measure what NIXL's UCX progress thread costs, and what driving progress
ourselves costs in latency.

Two agents in two processes over loopback UCX (``UCX_NET_DEVICES=lo``):

1. idle CPU of one agent alone: progress thread on / off (off: the process
   only sleeps, or polls ``take_notifs`` at a fixed interval, as kvmapd does);
2. READ latency of 64 scattered 4 KiB blocks, initiator busy-polling its
   transfer, with the target either running the progress thread or polling
   ``take_notifs`` every ``interval`` seconds; and the target's CPU while
   serving and while idle but connected.

Run: ``.venv/bin/python -m kvmap.tools.nixl_progress [--seconds 3] [--iters 200]``.
Not a test: figures depend on the machine (this one has few cores, so a
spinning thread competes with everything else).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection

import numpy as np

# Importing creates no UCX context; each process sets UCX_NET_DEVICES before
# its agent exists.
from kvmap.daemon.adapters.nixl_agent import NixlAgent, XferOp, XferState

BLOCK = 4096
NBLOCKS = 1024
XFER_BLOCKS = 64


def _cpu_share(seconds: float, work: object = None) -> float:
    """Cores used by this process (all threads) over ``seconds``."""
    c0, t0 = time.process_time(), time.perf_counter()
    deadline = t0 + seconds
    while time.perf_counter() < deadline:
        if callable(work):
            work()
        else:
            time.sleep(0.05)
    return (time.process_time() - c0) / (time.perf_counter() - t0)


def _poller(agent: object, interval: float) -> object:
    def work() -> None:
        agent.take_notifs()  # type: ignore[attr-defined]
        time.sleep(interval)

    return work


def idle_child(conn: Connection, progress_thread: bool, interval: float, seconds: float) -> None:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    agent = NixlAgent.create(f"idle-{os.getpid()}", progress_thread=progress_thread)
    time.sleep(0.3)  # let start-up settle
    work = _poller(agent, interval) if interval > 0 else None
    conn.send(_cpu_share(seconds, work))
    agent.close()


def target_child(conn: Connection, progress_thread: bool, interval: float, seconds: float) -> None:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    agent = NixlAgent.create("bench-target", progress_thread=progress_thread)
    buf = (np.arange(NBLOCKS * BLOCK) % 251).astype(np.uint8)
    agent.register_dram(buf.ctypes.data, buf.nbytes)
    conn.send((agent.metadata(), buf.ctypes.data))
    agent.add_remote(conn.recv())
    c0, t0 = time.process_time(), time.perf_counter()
    while not conn.poll(0):
        if progress_thread:
            time.sleep(0.001)  # NIXL's thread does the work; stay out of its way
        else:
            agent.take_notifs()
            if interval > 0:
                time.sleep(interval)
    conn.recv()
    serving = (time.process_time() - c0) / (time.perf_counter() - t0)
    work = None if progress_thread else _poller(agent, interval)
    conn.send((serving, _cpu_share(seconds, work)))
    conn.recv()
    agent.close()


def run_idle(progress_thread: bool, interval: float, seconds: float) -> float:
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    p = ctx.Process(target=idle_child, args=(theirs, progress_thread, interval, seconds))
    p.start()
    try:
        if not ours.poll(seconds + 60):
            raise TimeoutError("idle child did not report")
        share: float = ours.recv()
        return share
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()


def run_latency(
    progress_thread: bool, interval: float, iters: int, seconds: float
) -> tuple[list[float], float, float]:
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    p = ctx.Process(target=target_child, args=(theirs, progress_thread, interval, seconds))
    p.start()
    agent = NixlAgent.create("bench-initiator", progress_thread=progress_thread)
    try:
        buf = np.zeros(NBLOCKS * BLOCK, dtype=np.uint8)
        agent.register_dram(buf.ctypes.data, buf.nbytes)
        if not ours.poll(120):
            raise TimeoutError("target did not start")
        md, remote_addr = ours.recv()
        peer = agent.add_remote(md)
        ours.send(agent.metadata())
        local = agent.prep_local(np.array([[buf.ctypes.data, BLOCK, 0, BLOCK, NBLOCKS]]))
        remote = agent.prep_remote(peer, np.array([[remote_addr, BLOCK, 0, BLOCK, NBLOCKS]]))
        rng = np.random.default_rng(0)
        lat = []
        for i in range(iters + 5):  # the first few include connection set-up
            li = rng.choice(NBLOCKS, XFER_BLOCKS, replace=False)
            ri = rng.choice(NBLOCKS, XFER_BLOCKS, replace=False)
            t0 = time.perf_counter()
            xfer = agent.post_prepped(XferOp.READ, local, li, remote, ri, notif=b"n%d" % i)
            deadline = t0 + 30
            while agent.poll(xfer) is XferState.PROC:
                if time.perf_counter() > deadline:
                    raise TimeoutError("transfer did not complete")
            if xfer.state is not XferState.DONE:
                raise RuntimeError(f"transfer failed: {xfer.error}")
            lat.append(time.perf_counter() - t0)
            agent.release(xfer)
            want = (np.arange(BLOCK) + ri[0] * BLOCK) % 251
            assert np.array_equal(buf[li[0] * BLOCK : (li[0] + 1) * BLOCK], want)
        ours.send("stop")
        if not ours.poll(seconds + 60):
            raise TimeoutError("target did not report")
        serving, idle = ours.recv()
        ours.send("bye")
        return lat[5:], serving, idle
    finally:
        agent.close()
        p.join(30)
        if p.is_alive():
            p.kill()


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q)) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--seconds", type=float, default=3.0, help="CPU sampling window")
    parser.add_argument("--iters", type=int, default=200, help="transfers per configuration")
    args = parser.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    print(f"machine: {os.cpu_count()} CPUs; UCX_NET_DEVICES={os.environ['UCX_NET_DEVICES']}")

    print(f"\n1. idle agent, CPU in cores over {args.seconds:.0f} s")
    idle_cases = [
        ("progress thread", True, 0.0),
        ("no thread, no calls", False, 0.0),
        ("no thread, take_notifs every 10 ms", False, 0.01),
        ("no thread, take_notifs every 1 ms", False, 0.001),
        ("no thread, take_notifs every 0.2 ms", False, 0.0002),
    ]
    for label, thread, interval in idle_cases:
        print(f"   {label:<38} {run_idle(thread, interval, args.seconds):6.3f}")

    print(
        f"\n2. READ of {XFER_BLOCKS} x {BLOCK} B scattered blocks, {args.iters} transfers;"
        " target CPU in cores"
    )
    print(
        f"   {'target progress':<30} {'p50 us':>8} {'p90 us':>8} {'p99 us':>8}"
        f" {'serving':>8} {'idle*':>6}"
    )
    lat_cases = [
        ("progress thread (both sides)", True, 0.0),
        ("take_notifs busy loop", False, 0.0),
        ("take_notifs every 0.2 ms", False, 0.0002),
        ("take_notifs every 1 ms", False, 0.001),
        ("take_notifs every 10 ms", False, 0.01),
    ]
    for label, thread, interval in lat_cases:
        lat, serving, idle = run_latency(thread, interval, args.iters, args.seconds)
        print(
            f"   {label:<30} {_pct(lat, 50):8.0f} {_pct(lat, 90):8.0f} {_pct(lat, 99):8.0f}"
            f" {serving:8.3f} {idle:6.3f}"
        )
    print("   * idle: connected, no transfers, same progress driving as while serving")


if __name__ == "__main__":
    main()
