"""The benchmark run: for each profile and planner, two real daemons (prefill
and decode, separate processes, real NIXL agents over loopback UCX) and one
bench worker process next to each; register, handshake, pull, verify, and
collect the figures as a ``results.BenchResult``.

What is measured where (``docs/benchmarks.md`` has the long version):

- ``full`` worker, full-scale geometry on sparse memfds (nothing is touched
  but the blocks a pull moves): regions, registered descriptors, NIXL
  registrations, agent metadata and region-map bytes, ready time
  (RegisterWorker round trip: fd hand-off, import, validate, plan, NIXL
  register, prepare the local list), first-contact cost (end to end through
  the daemons, and step by step in ``contact``), pull bandwidth at full page
  size, daemon resident memory.
- ``req`` worker, the same geometry with every page divided by a stated
  power of two so that a 128K-token request fits in memory: layers, blocks
  and block ids are untouched, so descriptors per transfer are exactly the
  full-scale ones (cross-checked against ``plan_transfer`` on the full-scale
  maps). Post time (``make_prepped_xfer`` + ``transfer``, as the daemon
  reports it) and completion time of the scattered and the contiguous request.
- ``desc`` worker, pages divided until the scattered request moves at most
  ``descriptor_budget``: post time as descriptor work alone.
- ``c0..`` workers, pages divided until the largest concurrency level fits
  ``concurrency_budget``: N scattered requests with distinct blocks in
  flight at once (``pull_many``), post and Pull-to-DONE percentiles.
- Raw NIXL (``raw_nixl``): two bare agents in two more processes, the same
  geometries, posting the lists each planner's daemon posts, after each
  kvmap series; and the TP pod (``pod``) on a daemon of its own.

The run in modules, each importing only those above it: ``options`` (what
to measure), ``workload`` (the requests and their scale), ``pair`` (a
planner's processes), ``series`` (what a planner's run collects),
``figures`` (its ``PlannerResult``), ``measure`` (one profile, every
planner), ``host`` (machine and memcpy), ``pod`` and this module.
"""

from __future__ import annotations

import time

from kvmap.core import planner as planners
from kvmap.tools.bench import pod
from kvmap.tools.bench.figures import add_ratios
from kvmap.tools.bench.host import machine, memcpy_all_cores_gbps, memcpy_gbps
from kvmap.tools.bench.measure import measure_profile
from kvmap.tools.bench.options import Options
from kvmap.tools.bench.profiles import get_profile
from kvmap.tools.bench.restart import measure_restart
from kvmap.tools.bench.results import SCHEMA, BenchResult, PlannerResult, ProfileInfo
from kvmap.tools.bench.series import median
from kvmap.tools.bench.throughput import measure_throughput
from kvmap.tools.bench.workload import plan_profile

__all__ = ["Options", "default_planners", "run_bench"]


def default_planners() -> list[str]:
    """``baseline`` first, then every other planner the daemon knows."""
    names = sorted(planners.PLANNERS)
    return ["baseline", *[n for n in names if n != "baseline"]] if "baseline" in names else names


def run_bench(opts: Options) -> BenchResult:
    started = time.perf_counter()
    profiles = [get_profile(name) for name in opts.profiles]
    for name in opts.planners:
        planners.get_planner(name)  # fail before starting anything
    results: dict[str, dict[str, PlannerResult]] = {}
    infos: dict[str, ProfileInfo] = {}
    # memcpy is measured next to every profile's pulls, so that a busy
    # neighbour slows both alike; the headline figure is their median.
    memcpy: list[float] = []
    all_cores: list[float] = []
    for profile in profiles:
        memcpy.append(memcpy_gbps(opts.memcpy_bytes))
        all_cores.append(memcpy_all_cores_gbps(opts.memcpy_bytes))
        opts.progress(f"{profile.name}: memcpy {memcpy[-1]:.2f} GB/s single thread, "
                      f"{all_cores[-1]:.2f} GB/s all cores")  # fmt: skip
        pp = plan_profile(profile, opts, memcpy[-1])
        results[profile.name] = add_ratios(measure_profile(pp, opts))
        infos[profile.name] = pp.info
    tp8 = pod.measure_pod(opts) if opts.tp8_profile else None
    throughput = measure_throughput(opts) if opts.throughput_profile else None
    restart = measure_restart(opts) if opts.restart_rounds > 0 else None
    return BenchResult(
        schema=SCHEMA,
        machine=machine(),
        memcpy_gbps=median(memcpy),
        memcpy_bytes=opts.memcpy_bytes,
        repeats=opts.repeats,
        profiles=results,
        profile_info=infos,
        seconds=time.perf_counter() - started,
        memcpy_all_cores_gbps=median(all_cores),
        tp8=tp8,
        throughput=throughput,
        restart=restart,
        nixl_threads=opts.nixl_threads,
        check_before_read=opts.check_before_read,
    )
