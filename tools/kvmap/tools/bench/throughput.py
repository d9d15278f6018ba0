"""Pod throughput (``throughput`` in the JSON): how many pulls per second
one kvmapd per side sustains for a TP pod at saturation, next to one raw
NIXL agent pair per rank (NixlConnector's model: every worker its own
agent), on the same cores.

``ranks`` decode ranks each pull ``pulls_per_rank`` scattered requests (the
profile's first concurrency request) one after another from a prefill rank
of their own, all ranks at once: through kvmap, ``ranks`` decode workers of
one decode daemon pull from ``ranks`` prefill workers of one prefill daemon;
raw, ``ranks`` initiator processes each post the same lists to a target
process of their own. Every process of a measurement is started pinned to
the measured cores (children inherit the bench's affinity), and each
measurement gets fresh processes, so one side's idle processes never take
the other's cores. The two alternate (ABBA) over ``rounds``.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from kvmap.tools.bench.options import Options
from kvmap.tools.bench.pair import Pair, start_daemons
from kvmap.tools.bench.profiles import get_profile
from kvmap.tools.bench.raw_nixl import RawPair
from kvmap.tools.bench.results import Throughput
from kvmap.tools.bench.workload import ProfilePlan, Request, plan_profile

KINDS = ("kvmap", "raw_nixl")


@contextlib.contextmanager
def pinned(cores: set[int]) -> Iterator[None]:
    """Processes started inside run on ``cores`` only: a child inherits the
    affinity of the thread that starts it."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def core_sets() -> list[set[int]]:
    """The first core, then the first two, of those this process may use."""
    usable = sorted(os.sched_getaffinity(0))
    return [set(usable[:n]) for n in (1, 2) if n <= len(usable)]


def measure_throughput(opts: Options) -> dict[str, Throughput]:
    assert opts.throughput_profile is not None
    pp = plan_profile(get_profile(opts.throughput_profile), opts)
    request = pp.concurrent[0][1]
    out: dict[str, Throughput] = {}
    for cores in core_sets():
        samples: dict[str, list[float]] = {kind: [] for kind in KINDS}
        for i in range(opts.throughput_rounds):
            for kind in KINDS if i % 2 == 0 else KINDS[::-1]:
                rate = _kvmap_rate if kind == "kvmap" else _raw_rate
                samples[kind].append(rate(pp, request, opts, cores))
        t = Throughput(
            cores=len(cores),
            ranks=opts.throughput_ranks,
            pulls_per_rank=opts.throughput_pulls,
            kvmap_pulls_per_second=statistics.median(samples["kvmap"]),
            raw_nixl_pulls_per_second=statistics.median(samples["raw_nixl"]),
            samples=samples,
        )
        out[str(len(cores))] = t
        opts.progress(
            f"throughput, {opts.throughput_ranks} ranks on {len(cores)} core(s): kvmap "
            f"{t.kvmap_pulls_per_second:.0f} pulls/s, raw NIXL "
            f"{t.raw_nixl_pulls_per_second:.0f} pulls/s"
        )
    return out


def _kvmap_rate(pp: ProfilePlan, request: Request, opts: Options, cores: set[int]) -> float:
    """Pulls per second through one kvmapd per side, every rank pulling."""
    planner = opts.single_planner()
    names = [f"r{i}" for i in range(opts.throughput_ranks)]
    # The stack exits first: processes stop before their folder goes.
    with (
        tempfile.TemporaryDirectory(prefix="kvmap-bench-tput-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        with pinned(cores):
            daemons = start_daemons(Path(tmp), [planner], opts.daemon_flags())
            pair = Pair(stack, planner, daemons[planner])
        for name in names:
            for side in ("prefill", "decode"):
                pair.register(side, name, pp.profile.name, pp.concurrency_divisor)
        pair.pull_streams([[(n, request, n)] for n in names])  # first contact, pages
        wall = pair.pull_streams([[(n, request, n)] * opts.throughput_pulls for n in names])
    return len(names) * opts.throughput_pulls / wall


def _raw_rate(pp: ProfilePlan, request: Request, opts: Options, cores: set[int]) -> float:
    """Pulls per second of one raw NIXL agent pair per rank, every rank
    pulling the lists its kvmap counterpart posts."""
    planner = opts.single_planner()
    name = pp.profile.name
    prep = f"{planner}/c"
    with (
        tempfile.TemporaryDirectory(prefix="kvmap-bench-tput-raw-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        with pinned(cores):
            raws = [
                RawPair(stack, Path(tmp) / f"r{i}", nixl_threads=opts.nixl_threads)
                for i in range(opts.throughput_ranks)
            ]
        for raw in raws:
            raw.register("c", name, pp.concurrency_divisor)
            raw.touch("c")
            raw.connect()
            raw.prepare(
                prep, planner, "c", profile=name, divisor=pp.concurrency_divisor,
                groups=pp.bandwidth.groups,
            )  # fmt: skip
        spec = [{"prep": prep, "groups": request.spec()}]
        _together(raws, lambda raw: raw.pull(spec, 1))  # connections, pages
        start = time.perf_counter()
        _together(raws, lambda raw: raw.pull(spec, opts.throughput_pulls))
        wall = time.perf_counter() - start
    return len(raws) * opts.throughput_pulls / wall


def _together(raws: list[RawPair], fn: Callable[[RawPair], object]) -> None:
    """``fn`` on every pair at once, a thread each; the first error raised."""
    errors: list[BaseException] = []

    def one(raw: RawPair) -> None:
        try:
            fn(raw)
        except BaseException as err:  # re-raised below, on the caller's thread
            errors.append(err)

    threads = [threading.Thread(target=one, args=(raw,)) for raw in raws]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
