"""``kvmapd bench``: descriptors, registration, post latency and bandwidth of
every planner against the per-layer ``baseline``, side by side, through real
daemons and real NIXL agents on this machine.

    kvmapd bench [--profile NAME ...] [--planner NAME ...] [--json] [--plot FILE.png]

Modules: ``profiles`` (the geometries, with their sources), ``blockpool``
(request block ids and the fragmentation model), ``worker`` (the stand-in
vLLM worker process), ``contact`` (first-contact steps, timed one by one),
``runner`` (the measurement), ``results`` (the figures, typed, and their
``--json`` form), ``report`` (tables) and ``plot`` (matplotlib).
See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import FrameType

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
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return run(p.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    # Lazy: the runner pulls in numpy and the launcher, which other
    # subcommands do not need.
    from kvmap.tools.bench import report, runner  # noqa: PLC0415

    if args.repeats < 1:
        print("kvmapd bench: --repeats must be at least 1", file=sys.stderr)
        return 2

    def progress(line: str) -> None:
        if not args.quiet:
            print(f"  .. {line}", file=sys.stderr, flush=True)

    opts = runner.Options(
        profiles=args.profile or list(DEFAULT_PROFILES),
        planners=args.planner or runner.default_planners(),
        repeats=args.repeats,
        request_budget=args.request_mib * MIB,
        bandwidth_budget=args.bandwidth_mib * MIB,
        memcpy_bytes=args.memcpy_mib * MIB,
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
