"""``python -m kvmap.tools.gpu_demo``: the P/D pull demo with KV caches in
GPU memory, for each planner in turn (``baseline``, then ``coalesce``).

Per planner: a prefill and a decode kvmapd (both on that planner), one GPU
worker each (``gpu_demo_worker``) with the GLM-5.3 rank geometry (78 MLA +
23 indexer layers, 64-token blocks) scaled down to ``--blocks`` blocks, the
decode side pulls the same scattered block lists through kvmap and every
byte is verified on the GPU. Prints registered descriptors, descriptors per
request, post time and GB/s per planner, and the daemons' GPU memory. At the
end it kills the prefill worker and checks that its GPU memory comes back
(a daemon that kept the worker's IPC mapping would pin it).

Exits 0 only when every byte verified, every pull's owner was notified and
the dead worker's memory was released. Needs a CUDA GPU, a CUDA torch and a
kvmapd that registers CUDA IPC memory; see docs/gpu.md and
tests/gpu/run_on_device.sh.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvmap.tools.grants import GrantRefused, granted
from kvmap.tools.launch import DaemonProc, WorkerProc, start_daemon, start_worker

WORKER_START_TIMEOUT_S = 180.0
PULL_TIMEOUT_S = 120.0
RELEASE_TIMEOUT_S = 20.0


@dataclass
class Pull:
    request: str
    blocks: int
    descriptors: int = 0
    post_s: float = 0.0
    done_s: float = 0.0
    nbytes: int = 0
    bad_blocks: int = -1
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.bad_blocks == 0

    @property
    def gbps(self) -> float:
        seconds = self.post_s + self.done_s
        return self.nbytes / seconds / 1e9 if seconds else 0.0


@dataclass
class Phase:
    planner: str
    prefill_descriptors: int = 0
    decode_descriptors: int = 0
    pulls: list[Pull] = field(default_factory=list)
    finished: int = 0
    released: bool | None = None  # None: not checked in this phase
    warm_up_ok: bool = True

    @property
    def ok(self) -> bool:
        return (
            self.warm_up_ok
            and bool(self.pulls)
            and all(p.ok for p in self.pulls)
            and self.finished == len(self.pulls)
            and self.released is not False
        )


def scattered(rng: random.Random, n_blocks: int, count: int) -> list[int]:
    """Distinct block ids as a long-running block pool leaves them: shuffled,
    with occasional short runs of consecutive ids."""
    pool = list(range(n_blocks))
    rng.shuffle(pool)
    ids: list[int] = []
    seen: set[int] = set()
    i = 0
    while len(ids) < count:
        start = pool[i % n_blocks]
        i += 1
        for b in range(start, min(start + rng.choice((1, 1, 1, 2, 4)), n_blocks)):
            if b not in seen and len(ids) < count:
                seen.add(b)
                ids.append(b)
    return ids


def summary_table(phases: list[Phase]) -> list[str]:
    """One line per planner: what the issue asks to compare."""
    lines = [
        f"  {'planner':<10}{'registered descs':>18}{'descs/request':>15}{'post ms p50':>13}"
        f"{'post ms max':>13}{'GB/s':>8}  verified"
    ]
    for ph in phases:
        done = [p for p in ph.pulls if not p.error]
        descs = statistics.median(p.descriptors for p in done) if done else 0
        posts = [p.post_s * 1e3 for p in done]
        nbytes = sum(p.nbytes for p in done)
        seconds = sum(p.post_s + p.done_s for p in done)
        lines.append(
            f"  {ph.planner:<10}{ph.prefill_descriptors:>18,}{int(descs):>15,}"
            f"{statistics.median(posts) if posts else 0:>13.2f}{max(posts, default=0):>13.2f}"
            f"{nbytes / seconds / 1e9 if seconds else 0:>8.2f}  {'yes' if ph.ok else 'NO'}"
        )
    return lines


def pull_line(p: Pull) -> str:
    if p.error:
        return f"  {p.request:<10} FAILED {p.error}"
    verdict = "yes" if p.ok else f"NO: {p.bad_blocks} blocks differ"
    return (
        f"  {p.request:<10}{p.blocks:>7}{p.descriptors:>9,}{p.post_s * 1e3:>9.2f}"
        f"{p.done_s * 1e3:>9.2f}{p.nbytes / 1e6:>9.1f}{p.gbps:>8.2f}  {verdict}"
    )


# Processes -------------------------------------------------------------------------


def start_gpu_worker(
    daemon: DaemonProc, engine_id: str, *extra: str, timeout: float = WORKER_START_TIMEOUT_S
) -> WorkerProc:
    """``launch.start_worker`` for ``gpu_demo_worker``."""
    return start_worker(
        daemon, engine_id, *extra, timeout=timeout, module="kvmap.tools.gpu_demo_worker"
    )


def gpu_memory_mib(uuid: str) -> tuple[int | None, dict[int, int]]:
    """(memory used on the device, MiB per process) from nvidia-smi, or
    (None, {}) where it is missing or says nothing."""
    which = ["-i", uuid] if uuid else []
    fmt = "--format=csv,noheader,nounits"
    try:
        total = subprocess.run(
            ["nvidia-smi", *which, "--query-gpu=memory.used", fmt],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout  # fmt: skip
        apps = subprocess.run(
            ["nvidia-smi", *which, "--query-compute-apps=pid,used_memory", fmt],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None, {}
    per_pid: dict[int, int] = {}
    for row in apps.splitlines():
        pid, _, mib = row.partition(",")
        if pid.strip().isdigit() and mib.strip().isdigit():
            per_pid[int(pid)] = int(mib)
    used = total.strip().splitlines()[0].strip() if total.strip() else ""
    return (int(used) if used.isdigit() else None), per_pid


# One planner -------------------------------------------------------------------------


def _pull(
    workers: tuple[WorkerProc, WorkerProc],
    prefill: DaemonProc,
    remote_worker: Any,
    name: str,
    blocks: tuple[list[int], ...],
) -> Pull:
    dw, pw = workers  # the puller, and the owner that grants the blocks
    local, remote = blocks
    cmd = {
        "cmd": "pull",
        "request_id": name,
        "remote_target": prefill.tcp_target,
        "remote_worker": remote_worker,
        "groups": [
            {"group": 0, "local": local, "remote": remote},
            {"group": 1, "local": local, "remote": remote},
        ],
    }
    try:
        # As a vLLM prefill worker does, the owner grants exactly these blocks.
        out = dw.call(granted(pw, cmd), timeout=PULL_TIMEOUT_S)
    except GrantRefused as err:
        out = err.answer
    if not out.get("ok"):
        return Pull(name, len(local), error=f"{out.get('code')}: {out.get('message')}")
    st = out["stats"]
    return Pull(
        name,
        len(local),
        descriptors=int(st["descriptors"]),
        post_s=float(st["post_seconds"]),
        done_s=float(st["completion_seconds"]),
        nbytes=int(st["bytes"]),
        bad_blocks=int(out.get("bad_blocks", -1)),
    )


def _finished(pw: WorkerProc, expected: set[str], timeout_s: float = 10.0) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        events = pw.call({"cmd": "events"})["events"]
        done = {e["transfer_finished"]["request_id"] for e in events if "transfer_finished" in e}
        if expected <= done or time.monotonic() > deadline:
            return len(expected & done)
        time.sleep(0.05)


def _wait_released(uuid: str, before: int, want_mib: float, timeout_s: float) -> int | None:
    """Seconds-bounded wait until the device's used memory is ``want_mib``
    below ``before``; returns the MiB that came back, or None on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        used, _ = gpu_memory_mib(uuid)
        if used is not None and before - used >= want_mib:
            return before - used
        time.sleep(0.25)
    return None


def _check_release(pw: WorkerProc, decode: DaemonProc, uuid: str) -> bool | None:
    """Kill the prefill worker: True when most of its KV cache's GPU memory
    comes back while both daemons run (the prefill kvmapd closed its IPC
    mapping). Otherwise stop the decode daemon to tell whose mapping pinned
    it (the prefill kvmapd's, or the decode side's UCX cuda_ipc cache)."""
    before, _ = gpu_memory_mib(uuid)
    if before is None:
        print("  dead-worker check skipped: nvidia-smi reports no memory figures")
        return None
    want = 0.9 * int(pw.ready.get("kv_bytes", 0)) / 2**20
    start = time.monotonic()
    pw.kill()
    back = _wait_released(uuid, before, want, RELEASE_TIMEOUT_S)
    if back is not None:
        print(
            f"  killed the prefill worker: {back:,} MiB of GPU memory came back in"
            f" {time.monotonic() - start:.1f}s (its KV cache: {want / 0.9:,.0f} MiB)"
        )
        return True
    print(f"  killed the prefill worker: its memory did NOT come back in {RELEASE_TIMEOUT_S:.0f}s")
    decode.stop()
    if _wait_released(uuid, before, want, 10.0) is not None:
        print("  ... it came back once the decode daemon stopped: its UCX cuda_ipc cache held it")
    else:
        print("  ... and not when the decode daemon stopped: the prefill kvmapd holds it")
    return False


def run_phase(args: argparse.Namespace, planner: str, check_release: bool) -> Phase:
    phase = Phase(planner)
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvmap-gpu-demo-")))
        if args.logs:
            stack.callback(_keep_logs, tmp, Path(args.logs) / planner)
        t0 = time.perf_counter()
        prefill, decode, pw, dw = _start_pair(stack, tmp, planner, _geometry_flags(args))
        pm, dm = pw.region_map, dw.region_map
        phase.prefill_descriptors = int(pm.get("descriptor_count", 0))
        phase.decode_descriptors = int(dm.get("descriptor_count", 0))
        uuid = str(pm.get("allocations", [{}])[0].get("device", {}).get("uuid", ""))
        kv_mib = int(pw.ready.get("kv_bytes", 0)) / 2**20
        print(
            f"\n== planner {planner}: two daemons and two GPU workers up in"
            f" {time.perf_counter() - t0:.1f}s ({uuid}, 2 x {kv_mib:,.0f} MiB of KV cache)"
        )
        _print_maps(pm, dm)
        _print_daemon_memory(uuid, prefill, decode)
        _pull_requests(phase, args, (dw, pw), prefill, pm["worker"])
        phase.finished = _finished(pw, {p.request for p in phase.pulls})
        print(
            f"  prefill worker told the pull finished for {phase.finished}/{len(phase.pulls)}"
            " requests"
        )
        if check_release:
            phase.released = _check_release(pw, decode, uuid)
    return phase


def _geometry_flags(args: argparse.Namespace) -> list[str]:
    """The GPU workers' geometry and device flags."""
    return [
        "--blocks", str(args.blocks), "--block-tokens", str(args.block_tokens),
        "--mla-layers", str(args.mla_layers), "--indexer-layers", str(args.indexer_layers),
        "--device", args.device,
    ]  # fmt: skip


def _start_pair(
    stack: ExitStack, tmp: Path, planner: str, geo: list[str]
) -> tuple[DaemonProc, DaemonProc, WorkerProc, WorkerProc]:
    """(prefill daemon, decode daemon, prefill worker, decode worker), each
    stopped when ``stack`` closes; the prefill worker's cache is filled."""
    prefill = start_daemon(tmp / "prefill", "--planner", planner, name="prefill")
    stack.callback(prefill.stop)
    decode = start_daemon(tmp / "decode", "--planner", planner, name="decode")
    stack.callback(decode.stop)
    pw = start_gpu_worker(prefill, "prefill-engine", *geo, "--fill")
    stack.callback(pw.stop)
    dw = start_gpu_worker(decode, "decode-engine", *geo)
    stack.callback(dw.stop)
    return prefill, decode, pw, dw


def _print_maps(pm: dict[str, Any], dm: dict[str, Any]) -> None:
    for name, m in (("prefill", pm), ("decode", dm)):
        print(
            f"  {name:<8} {len(m.get('regions', []))} regions,"
            f" {int(m.get('descriptor_count', 0)):,} registered descriptors"
            f" (baseline {int(m.get('baseline_descriptor_count', 0)):,})"
        )


def _print_daemon_memory(uuid: str, prefill: DaemonProc, decode: DaemonProc) -> None:
    _, per_pid = gpu_memory_mib(uuid)
    if per_pid:
        print(
            "  kvmapd GPU memory (nvidia-smi): "
            + ", ".join(
                f"{d_name} {per_pid.get(d.proc.pid, 0):,} MiB"
                for d_name, d in (("prefill", prefill), ("decode", decode))
            )
        )


def _pull_requests(
    phase: Phase,
    args: argparse.Namespace,
    workers: tuple[WorkerProc, WorkerProc],
    prefill: DaemonProc,
    remote: Any,
) -> None:
    """A warm-up pull, then ``args.requests`` scattered ones into ``phase``;
    ``workers`` are the decode (puller) and prefill (granting owner) workers."""
    rng = random.Random(args.seed)
    per_request = args.request_blocks or max(1, args.blocks // 8)
    print(
        f"\n  {'request':<10}{'blocks':>7}{'descs':>9}{'post ms':>9}{'done ms':>9}"
        f"{'MB':>9}{'GB/s':>8}  verified"
    )
    requests = [
        (f"req-{r}", scattered(rng, args.blocks, per_request),
         scattered(rng, args.blocks, per_request))
        for r in range(args.requests)
    ]  # fmt: skip
    # Warm-up: handshake, UCX connection and IPC opens happen on first use.
    warm = _pull(workers, prefill, remote, "warm-up", requests[0][1:])
    print(pull_line(warm) + "   (not counted)")
    phase.warm_up_ok = warm.ok
    for name, local, remote_ids in requests:
        phase.pulls.append(_pull(workers, prefill, remote, name, (local, remote_ids)))
        print(pull_line(phase.pulls[-1]))


def _keep_logs(tmp: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for log in tmp.glob("*/*.log"):
        shutil.copy(log, dest / f"{log.parent.name}-{log.name}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="kvmap-gpu-demo", description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    p.add_argument("--blocks", type=int, default=2048, help="KV blocks per worker")
    p.add_argument("--block-tokens", type=int, default=64)
    p.add_argument("--mla-layers", type=int, default=78)
    p.add_argument("--indexer-layers", type=int, default=23)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--request-blocks", type=int, default=0, help="blocks per request (blocks/8)")
    p.add_argument("--planners", default="baseline,coalesce")
    p.add_argument("--device", default="cuda:0", help="the workers' device")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--logs", default="", help="copy daemon and worker logs here")
    p.add_argument("--no-release-check", action="store_true")
    args = p.parse_args(argv)
    planners = [s for s in args.planners.split(",") if s]
    print(
        f"kvmap GPU demo: GLM-5.3 rank geometry scaled to {args.blocks:,} blocks"
        f" ({args.mla_layers} MLA + {args.indexer_layers} indexer layers,"
        f" {args.block_tokens} tokens per block), {args.requests} requests per planner"
    )
    phases = []
    for i, planner in enumerate(planners):
        last = i == len(planners) - 1
        phases.append(run_phase(args, planner, check_release=last and not args.no_release_check))
    print("\n" + "\n".join(summary_table(phases)))
    ok = all(ph.ok for ph in phases)
    print("kvmap GPU demo: " + ("every byte verified" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
