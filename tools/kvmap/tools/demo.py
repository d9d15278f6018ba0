"""``kvmapd demo``: a prefill daemon and a decode daemon, one worker process
each with a GLM-like block-outermost KV cache in shared memory; the decode
side pulls several requests with scattered block ids through kvmap and every
byte is verified. Exits 0 only when all of it verified; leaves no process or
shared memory behind, even when interrupted."""

from __future__ import annotations

import argparse
import logging
import random
import signal
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

from kvmap.core import planner as planners
from kvmap.core.convert import geometry_from_json
from kvmap.daemon.adapters.logs import configure_logging
from kvmap.daemon.cli.kvmapd import OneLineParser
from kvmap.daemon.examples import example_path
from kvmap.tools.grants import GrantRefused, granted
from kvmap.tools.launch import DaemonProc, WorkerProc, start_daemon, start_worker
from kvmap.tools.peers import new_peer_secret


def main(argv: Sequence[str]) -> int:
    """``kvmapd demo ARGS``: parse the arguments and run."""
    p = OneLineParser(prog="kvmapd demo", description=__doc__, allow_abbrev=False)
    # Checked before anything starts: a request needs at least two blocks
    # to scatter over, and every count below one would leave nothing to pull.
    p.add_argument("--blocks", type=_at_least(2), default=128,
                   help="KV blocks per worker (default: 128)")  # fmt: skip
    p.add_argument("--block-tokens", type=_at_least(1), default=64, help="(default: 64)")
    p.add_argument("--mla-layers", type=_at_least(1), default=12, help="(default: 12)")
    p.add_argument("--indexer-layers", type=_at_least(1), default=4, help="(default: 4)")
    p.add_argument("--requests", type=_at_least(1), default=6, help="(default: 6)")
    p.add_argument("--decode-planner", default="baseline", choices=sorted(planners.PLANNERS),
                   help="planner of the decode daemon; the prefill one runs coalesce "
                   "(default: baseline)")  # fmt: skip
    p.add_argument("--seed", type=int, default=7, help="(default: 7)")
    configure_logging("console", level=logging.WARNING)
    return run(p.parse_args(argv))


def _at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, not {value}")
        return value

    parse.__name__ = "count"  # argparse names the type in its "invalid ..." message
    return parse


def _scattered(rng: random.Random, n_blocks: int, count: int) -> list[int]:
    """Block ids as a long-running block pool leaves them: free blocks are
    reused in a shuffled order, with occasional short consecutive runs."""
    ids: list[int] = []
    taken: set[int] = set()
    pool = list(range(n_blocks))
    rng.shuffle(pool)
    # Each block starts a run once, so one pass over the pool takes them all:
    # ``count`` (at most ``n_blocks``) is always reached. (Picking the start
    # by how many ids were taken looped forever once a start's whole run was
    # taken: the demo's 36th request of seed 7 over 24 blocks.)
    for start in pool:
        if len(ids) >= count:
            break
        run = rng.choice((1, 1, 1, 2, 4))
        new = [b for b in range(start, min(start + run, n_blocks)) if b not in taken]
        ids.extend(new)
        taken.update(new)
    return ids[:count]


def _summary(name: str, m: dict[str, Any]) -> str:
    planner = m.get("planner", {})
    regions = m.get("regions", [])
    desc = int(m.get("descriptor_count", 0))
    base = int(m.get("baseline_descriptor_count", 0))
    saving = 100.0 * (1 - desc / base) if base else 0.0
    return (
        f"  {name:<8} planner {planner.get('name')} v{planner.get('version')}, generation "
        f"{m.get('generation')}: {len(regions)} regions, {desc:,} descriptors "
        f"(baseline {base:,}, {saving:.0f}% fewer)"
    )


def _full_scale() -> str:
    """The demo's full-scale line, planned from the bundled GLM-5.3
    example (package data of ``kvmap.daemon.examples``). An install that
    lacks it says so instead of leaving the line out unexplained."""
    path = example_path("glm53-rank")
    if not path.is_file():
        return (
            "  full-scale GLM-5.3 rank: not shown, this install lacks the bundled example "
            f"{path} (package data of kvmap.daemon.examples; reinstall kvmap)"
        )
    geo = geometry_from_json(path.read_text())
    base = planners.get_planner("baseline").plan(geo).descriptor_count
    coal = planners.get_planner("coalesce").plan(geo).descriptor_count
    return (
        f"  full-scale GLM-5.3 rank ({len(geo.views)} layers x {geo.views[0].num_blocks:,} "
        f"blocks): baseline {base:,} vs coalesce {coal:,} registered descriptors "
        f"({base / coal:.1f}x fewer)"
    )


@contextmanager
def _interrupts_raise() -> Iterator[None]:
    """SIGTERM behaves like Ctrl-C so the ExitStack cleans up either way."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextmanager
def _step(what: str) -> Iterator[None]:
    """One start-up step's progress line: its name at once (a daemon takes
    seconds to start on a busy machine), then how long it took."""
    print(f"kvmap demo: starting {what} ...", end="", flush=True)
    t0 = time.perf_counter()
    try:
        yield
    except BaseException:
        print(" failed", flush=True)
        raise
    print(f" up in {time.perf_counter() - t0:.1f}s", flush=True)


def run(args: argparse.Namespace) -> int:
    with ExitStack() as stack, _interrupts_raise():
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvmap-demo-")))
        t0 = time.perf_counter()
        # The two daemons' shared peer secret (0600, in the demo's private
        # folder): without it each would refuse the other on TCP.
        peers = ("--peer-secret-file", str(new_peer_secret(tmp)))
        # Folders of one letter: a socket path holds 107 bytes and the fd
        # hand-off socket beside it adds ".fds", so a deep TMPDIR still fits.
        with _step("1/4 prefill daemon (planner coalesce)"):
            prefill = start_daemon(tmp / "p", "--planner", "coalesce", *peers, name="prefill")
        stack.callback(prefill.stop)
        with _step(f"2/4 decode daemon (planner {args.decode_planner})"):
            decode = start_daemon(
                tmp / "d", "--planner", args.decode_planner, *peers, name="decode"
            )
        stack.callback(decode.stop)
        geo_args = [
            "--blocks", str(args.blocks), "--block-tokens", str(args.block_tokens),
            "--mla-layers", str(args.mla_layers), "--indexer-layers", str(args.indexer_layers),
        ]  # fmt: skip
        with _step("3/4 prefill worker (registers its KV cache, fills it)"):
            pw = start_worker(prefill, "prefill-engine", *geo_args, "--fill")
        stack.callback(pw.stop)
        with _step("4/4 decode worker (registers its KV cache)"):
            dw = start_worker(decode, "decode-engine", *geo_args)
        stack.callback(dw.stop)
        print(f"kvmap demo: two daemons and two workers up in {time.perf_counter() - t0:.1f}s")
        print(f"  prefill daemon {prefill.tcp_target} (pid {prefill.proc.pid}), "
              f"decode daemon {decode.tcp_target} (pid {decode.proc.pid})")  # fmt: skip
        print(_summary("prefill", pw.region_map))
        print(_summary("decode", dw.region_map))
        print(_full_scale())
        return _pull_requests(args, prefill, pw, dw)


def _pull_requests(
    args: argparse.Namespace, prefill: DaemonProc, pw: WorkerProc, dw: WorkerProc
) -> int:
    rng = random.Random(args.seed)
    remote_worker = pw.region_map["worker"]
    failures = 0
    total_bytes = 0
    total_s = 0.0
    print(f"\n  {'request':<10}{'blocks':>7}{'descs':>8}{'post ms':>9}{'done ms':>9}"
          f"{'MB':>8}{'GB/s':>7}  verified")  # fmt: skip
    for r in range(args.requests):
        n = rng.randint(max(1, args.blocks // 16), max(2, args.blocks // 3))
        remote = _scattered(rng, args.blocks, n)
        local = _scattered(rng, args.blocks, n)
        request_id = f"req-{r}"
        cmd = {
            "cmd": "pull",
            "request_id": request_id,
            "remote_target": prefill.tcp_target,
            "remote_worker": remote_worker,
            "groups": [
                {"group": 0, "local": local, "remote": remote},
                {"group": 1, "local": local, "remote": remote},
            ],
        }
        try:
            # As a vLLM prefill worker does, the owner grants exactly these blocks.
            out = dw.call(granted(pw, cmd))
        except GrantRefused as err:
            out = err.answer
        if not out.get("ok"):
            print(f"  {request_id:<10} FAILED {out.get('code')}: {out.get('message')}")
            failures += 1
            continue
        st = out["stats"]
        seconds = st["post_seconds"] + st["completion_seconds"]
        total_bytes += st["bytes"]
        total_s += seconds
        ok = out.get("bad_blocks") == 0
        failures += 0 if ok else 1
        print(
            f"  {request_id:<10}{n:>7}{st['descriptors']:>8}{st['post_seconds'] * 1e3:>9.2f}"
            f"{st['completion_seconds'] * 1e3:>9.2f}{st['bytes'] / 1e6:>8.1f}"
            f"{st['bytes'] / seconds / 1e9 if seconds else 0:>7.2f}  "
            f"{'yes' if ok else 'NO: ' + str(out.get('bad_blocks')) + ' blocks differ'}"
        )
    finished = _finished_requests(pw, args.requests)
    print(f"\n  prefill worker told the pull finished for {len(finished)}/{args.requests} requests")
    if total_s:
        print(f"  total {total_bytes / 1e6:.1f} MB in {total_s * 1e3:.1f} ms: "
              f"{total_bytes / total_s / 1e9:.2f} GB/s")  # fmt: skip
    ok = failures == 0 and len(finished) == args.requests
    print("kvmap demo: " + ("every byte verified" if ok else f"FAILED ({failures} requests)"))
    return 0 if ok else 1


def _finished_requests(pw: WorkerProc, expected: int, timeout_s: float = 10.0) -> set[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        events = pw.call({"cmd": "events"})["events"]
        done = {e["transfer_finished"]["request_id"] for e in events if "transfer_finished" in e}
        if len(done) >= expected or time.monotonic() > deadline:
            return done
        time.sleep(0.05)
