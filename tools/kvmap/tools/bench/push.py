"""``kvmapd bench --push``: how much of a request's KV transfer a decode
worker waits for once prefill has computed its last layer, pulled after the
prefill finished, pushed whole at finish, or pushed layer group by layer
group while the next layers compute.

Two real daemons (one planner, default coalesce) and a stand-in worker next
to each (``bench.push_worker``, real shared memory), on a profile's geometry
(glm53: 101 layers in two transfer groups) with scattered block ids on both
sides (``blockpool``: consecutive ids on both sides merge into one
descriptor, as the other series). The pages are divided by a power of two
until the largest request fits ``--push-mib`` (layers, blocks and therefore
descriptors stay as at full scale). The prefill worker "computes" a request
of B blocks one layer at a time (``--layer-ms`` each), writing each layer's
pattern into its blocks; then, per repetition (the first one a discarded
warm-up), in turn:

- ``pull``: after the last layer the decode worker pulls the request
  (read grant from the prefill worker, minted beforehand). Exposed: the
  Pull call to DONE, as if decode heard of the finish at once (the most
  favourable to the pull: a router's hop comes on top in a real deployment).
- ``push_finish``: after the last layer the prefill worker pushes the whole
  request into the decode worker's blocks (open write grant the decode
  worker minted beforehand, as it does when it offers them). Exposed: the end
  of the last layer to the TransferFinished PUSHED_TO event's arrival in the
  decode worker, when decode can start (the Push's DONE at the prefill
  worker is reported beside it).
- ``layer_group_G``: the layers cut into G contiguous groups as the connector
  cuts them (``connector.pushes.layer_groups``); each group is pushed, with
  its ``layer_names``, as soon as its last layer is written. Exposed: the
  end of the last layer to the arrival of the last of the G events.

After every transfer the decode worker checks every byte of the request
(both sides' blocks are zeroed before each repetition): a wrong byte fails
the run. See docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvmap.client.connector.pushes import layer_groups
from kvmap.core.geometry import WorkerGeometry
from kvmap.tools.bench import blockpool
from kvmap.tools.bench.host import machine
from kvmap.tools.bench.options import MIB
from kvmap.tools.bench.pair import WORKER_TIMEOUT_S, call, start_daemons
from kvmap.tools.bench.profiles import Profile, get_profile
from kvmap.tools.bench.workload import DECODE_SEED, PREFILL_SEED, Request, timing_divisor
from kvmap.tools.launch import DaemonProc, WorkerProc, spawn_worker

SCHEMA = "kvmapd-bench-push/1"
# The goal the team tracks: a layer-group push exposes at most this share
# of a pull's transfer time.
GOAL = 0.10
WORKER = "push"


@dataclass
class PushOptions:
    profile: str = "glm53"
    blocks: tuple[int, ...] = (64, 256, 1024)
    groups: tuple[int, ...] = (4, 8, 16)
    layer_ms: tuple[float, ...] = (0.5,)
    repeats: int = 5
    # Most bytes per side the largest request moves (pages divided to fit).
    budget: int = 128 * MIB
    planner: str = "coalesce"
    daemon_flags: tuple[str, ...] = ()
    # Where the daemons and workers keep their logs and state (None: a
    # temporary folder, removed at the end).
    workdir: Path | None = None
    progress: Callable[[str], None] = field(default=lambda line: None)

    def kinds(self) -> list[str]:
        return ["pull", "push_finish", *(f"layer_group_{g}" for g in self.groups)]


def push_request(profile: Profile, blocks: int) -> Request:
    """A request of ``blocks`` blocks per group (a windowed group: its last
    blocks), scattered on each side by a churned block pool of its own; a
    group without a block table of its own uses the first group's ids."""
    counts = [
        min(blocks, profile.group_blocks(g)) if g.window_tokens else blocks
        for g in profile.request_groups
    ]
    own = [i == 0 or g.own_blocks for i, g in enumerate(profile.request_groups)]

    def ids(seed: int) -> list[list[int]]:
        drawn = blockpool.scattered(
            profile.num_blocks,
            profile.block_tokens,
            [n if o else 0 for n, o in zip(counts, own, strict=True)],
            seed,
        )
        return [d if o else drawn[0][-n:] for d, n, o in zip(drawn, counts, own, strict=True)]

    groups = tuple(g.transfer_group for g in profile.request_groups)
    return Request(groups, local=ids(DECODE_SEED), remote=ids(PREFILL_SEED))


def compute_order(geometry: WorkerGeometry, req: Request) -> list[tuple[str, int]]:
    """The request's layers ((name, transfer group)) in the order the stand-in
    prefill computes them: its views' order, as the push worker's."""
    return [
        (v.layer_name, v.transfer_group) for v in geometry.views if v.transfer_group in req.groups
    ]


def whole_push(req: Request, layers: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """The one push at finish: every group, every layer, after the last one."""
    groups = [
        {"group": g, "local": src, "remote": dst}
        for g, src, dst in zip(req.groups, req.remote, req.local, strict=True)
    ]
    return [{"after": len(layers) - 1, "groups": groups}]


def group_pushes(req: Request, layers: list[tuple[str, int]], count: int) -> list[dict[str, Any]]:
    """One push per layer group: its layers of each transfer group, after its
    last layer. The prefill's blocks (``remote`` in a pull) are the local ones."""
    ids = {g: (src, dst) for g, src, dst in zip(req.groups, req.remote, req.local, strict=True)}
    out = []
    for group in layer_groups(layers, count):
        after = max(layers.index((n, g)) for g, names in group.items() for n in names)
        out.append(
            {
                "after": after,
                "groups": [
                    {"group": g, "local": ids[g][0], "remote": ids[g][1], "layers": list(names)}
                    for g, names in group.items()
                ],
            }
        )
    return out


class PushPair:
    """The two daemons and a push worker next to each, each worker with the
    profile's geometry registered as ``prefill-push`` / ``decode-push``."""

    def __init__(self, stack: contextlib.ExitStack, daemons: tuple[DaemonProc, DaemonProc]) -> None:
        self.prefill, self.decode = daemons
        stack.callback(self.prefill.stop)
        stack.callback(self.decode.stop)
        self.pw = self._worker(self.prefill, "prefill")
        stack.callback(self.pw.stop)
        self.dw = self._worker(self.decode, "decode")
        stack.callback(self.dw.stop)
        self.transfers = 0

    @staticmethod
    def _worker(daemon: DaemonProc, side: str) -> WorkerProc:
        return spawn_worker(
            daemon, "kvmap.tools.bench.push_worker", [], f"push-worker-{side}", WORKER_TIMEOUT_S
        )

    def register(self, profile: str, divisor: int) -> None:
        for side, w in (("prefill", self.pw), ("decode", self.dw)):
            cmd = {"cmd": "register", "name": WORKER, "engine_id": f"{side}-{WORKER}"}
            call(w, {**cmd, "profile": profile, "divisor": divisor})

    def request_id(self, kind: str) -> str:
        self.transfers += 1
        return f"bench-push-{kind}-{self.transfers}"


def _blocks(groups: tuple[int, ...], ids: list[list[int]]) -> list[dict[str, Any]]:
    return [{"group": g, "blocks": b} for g, b in zip(groups, ids, strict=True)]


def _nixl(out: dict[str, Any]) -> float:
    """The NIXL share of a transfer, as its daemon reports it: post (make the
    prepped list, post it) plus completion (until NIXL said done); the rest
    of its exposed time is RPCs, the owner's check and the event."""
    return float(out["stats"]["post_seconds"]) + float(out["stats"]["completion_seconds"])


def _descriptors(outs: list[dict[str, Any]]) -> int:
    return sum(int(o["stats"]["descriptors"]) for o in outs)


def _pull_trial(pair: PushPair, req: Request, layer_ms: float) -> dict[str, Any]:
    """Compute every layer, then the decode worker pulls the request."""
    rid = pair.request_id("pull")
    grant = {"cmd": "grant", "name": WORKER, "request_id": rid}
    cap = call(pair.pw, {**grant, "groups": _blocks(req.groups, req.remote)})["capability"]
    compute = call(pair.pw, {"cmd": "compute", "name": WORKER, "layer_ms": layer_ms})
    pull = {"cmd": "pull", "name": WORKER, "request_id": rid, "capability": cap}
    pull |= {"remote_target": pair.prefill.tcp_target, "remote_engine_id": f"prefill-{WORKER}"}
    out = call(pair.dw, {**pull, "groups": req.spec()})
    # The owner must be told its blocks were read, as a prefill worker is.
    call(pair.pw, {"cmd": "arrivals", "request_id": rid, "count": 1})
    return {
        "exposed": float(out["wall_seconds"]),
        "nixl": _nixl(out),
        "descriptors": int(out["stats"]["descriptors"]),
        "bytes": int(out["stats"]["bytes"]),
        "transfers": 1,
        "compute": compute["t_end"] - compute["t_start"],
        "overruns": compute["overruns"],
    }


def _push_trial(
    pair: PushPair, req: Request, layer_ms: float, pushes: list[dict[str, Any]], kind: str
) -> dict[str, Any]:
    """Compute every layer, each of ``pushes`` going after its layer, into
    the blocks the decode worker granted for writing; timed to the decode
    worker's last TransferFinished event."""
    rid = pair.request_id(kind)
    grant = {"cmd": "grant_write", "name": WORKER, "request_id": rid}
    cap = call(pair.dw, {**grant, "groups": _blocks(req.groups, req.local)})["capability"]
    cmd = {"cmd": "compute", "name": WORKER, "layer_ms": layer_ms, "pushes": pushes}
    cmd |= {"remote_target": pair.decode.tcp_target, "remote_engine_id": f"decode-{WORKER}"}
    # Every push declares how many use the open grant (the connector's readers).
    cmd |= {"request_id": rid, "capability": cap, "readers": len(pushes)}
    out = call(pair.pw, cmd)
    events = call(pair.dw, {"cmd": "arrivals", "request_id": rid, "count": len(pushes)})["events"]
    wrong = [e for e in events if e["direction"] != "TRANSFER_DIRECTION_PUSHED_TO"]
    # The last push to finish uses the grant up: decode has every layer.
    if wrong or not any(e["exhausted"] for e in events):
        raise AssertionError(f"{kind}: decode's events are not {len(pushes)} pushes: {events}")
    end = float(out["t_end"])
    return {
        "exposed": max(e["t"] for e in events) - end,
        "exposed_done": max(p["t_done"] for p in out["pushes"]) - end,
        "nixl": _nixl(max(out["pushes"], key=lambda p: p["t_done"])),
        "descriptors": _descriptors(out["pushes"]),
        "bytes": sum(int(p["stats"]["bytes"]) for p in out["pushes"]),
        "transfers": len(pushes),
        "compute": end - out["t_start"],
        "overruns": out["overruns"],
    }


def verify_decode(decode_worker: WorkerProc, req: Request, kind: str) -> int:
    """Every byte of the decode worker's blocks of ``req`` holds the
    prefill's pattern (a wrong one fails the run); the bytes checked."""
    out = call(decode_worker, {"cmd": "verify", "name": WORKER, "groups": req.spec()})
    if int(out["bad_blocks"]):
        raise AssertionError(
            f"{kind}: {out['bad_blocks']} (layer, block) pairs of the decode worker differ "
            "from the prefill's after the transfer"
        )
    return int(out["bytes"])


class Row:
    """One (block count, layer time): the trials of each kind."""

    def __init__(self, opts: PushOptions, req: Request, layers: list[tuple[str, int]]) -> None:
        self.req = req
        self.pushes = {"push_finish": whole_push(req, layers)}
        for g in opts.groups:
            self.pushes[f"layer_group_{g}"] = group_pushes(req, layers, g)
        self.samples: dict[str, list[dict[str, Any]]] = {k: [] for k in opts.kinds()}
        self.verified_bytes = 0

    def trial(self, pair: PushPair, kind: str, layer_ms: float) -> dict[str, Any]:
        call(pair.pw, {"cmd": "wipe"})
        call(pair.dw, {"cmd": "zero", "name": WORKER, "groups": self.req.spec()})
        if kind == "pull":
            out = _pull_trial(pair, self.req, layer_ms)
        else:
            out = _push_trial(pair, self.req, layer_ms, self.pushes[kind], kind)
        self.verified_bytes += verify_decode(pair.dw, self.req, kind)
        return out


def _quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile, linear between the closest ranks (p90 of 5 samples
    lies between the 4th and the 5th)."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _series(samples: list[dict[str, Any]]) -> dict[str, Any]:
    exposed = [s["exposed"] for s in samples]
    out: dict[str, Any] = {
        "exposed_seconds": exposed,
        "exposed_median": statistics.median(exposed),
        "exposed_p90": _quantile(exposed, 0.9),
        "descriptors": samples[-1]["descriptors"],
        "bytes": samples[-1]["bytes"],
        "transfers": samples[-1]["transfers"],
        "compute_median": statistics.median(s["compute"] for s in samples),
        "overrun_layers": max(s["overruns"] for s in samples),
    }
    # The transfer that finished last (a layer-group push: the last one).
    out["nixl_median"] = statistics.median(s["nixl"] for s in samples)
    if "exposed_done" in samples[0]:
        out["exposed_done_median"] = statistics.median(s["exposed_done"] for s in samples)
    return out


def _row_json(row: Row, blocks: int, layer_ms: float, opts: PushOptions) -> dict[str, Any]:
    series = {k: _series(v) for k, v in row.samples.items()}
    pull = series["pull"]["exposed_median"]
    ratios = {
        k: s["exposed_median"] / pull if pull > 0 else 0.0 for k, s in series.items() if k != "pull"
    }
    met = [g for g in opts.groups if ratios[f"layer_group_{g}"] <= GOAL]
    return {
        "blocks": blocks,
        "layer_ms": layer_ms,
        "series": series,
        "vs_pull": ratios,
        "goal_met_groups": met,
        "verified_bytes": row.verified_bytes,
    }


def _measure_row(
    pair: PushPair, opts: PushOptions, req: Request, layers: list[tuple[str, int]], layer_ms: float
) -> Row:
    """Every kind's trials, taking turns within each repetition (so a change
    in the machine's load hits every kind alike); repetition 0 warms up
    (first contact, the memory's first touch) and is not kept."""
    row = Row(opts, req, layers)
    for rep in range(opts.repeats + 1):
        for kind in opts.kinds():
            sample = row.trial(pair, kind, layer_ms)
            if rep:
                row.samples[kind].append(sample)
    return row


def run_push(opts: PushOptions) -> dict[str, Any]:
    """Measure every (block count, layer time); the figures as JSON."""
    started = time.perf_counter()
    profile = get_profile(opts.profile)
    reqs = {b: push_request(profile, b) for b in opts.blocks}
    divisor = timing_divisor(profile, reqs[max(opts.blocks)], opts.budget)
    geometry = profile.geometry(divisor)
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        tmp = opts.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="kvmap-"))
        daemons = start_daemons(Path(tmp), [opts.planner], opts.daemon_flags)[opts.planner]
        pair = PushPair(stack, daemons)
        pair.register(profile.name, divisor)
        for blocks, req in reqs.items():
            layers = compute_order(geometry, req)
            call(
                pair.pw,
                {"cmd": "prepare", "name": WORKER, "groups": _blocks(req.groups, req.remote)},
            )
            for layer_ms in opts.layer_ms:
                opts.progress(f"{profile.name}: {blocks} blocks, {layer_ms} ms a layer")
                row = _measure_row(pair, opts, req, layers, layer_ms)
                rows.append(_row_json(row, blocks, layer_ms, opts))
    return {
        "schema": SCHEMA,
        "machine": asdict(machine()),
        "profile": profile.name,
        "planner": opts.planner,
        "page_divisor": divisor,
        "page_bytes": sorted({v.block_len_bytes for v in geometry.views}, reverse=True),
        "layers": len(compute_order(geometry, reqs[max(opts.blocks)])),
        "repeats": opts.repeats,
        "goal": GOAL,
        "exposed": {
            "pull": "Pull call to DONE at the decode worker (decode told of the finish at once)",
            "push": "end of the last layer to the decode worker's last PUSHED_TO event",
            "push_done": "end of the last layer to the last Push's DONE at the prefill worker",
        },
        "rows": rows,
        "verified": True,
        "seconds": time.perf_counter() - started,
    }


# --- the CLI's side (kvmapd bench --push) -------------------------------------

LABELS = {"pull": "pull after finish", "push_finish": "push at finish"}


def _label(kind: str) -> str:
    return LABELS.get(kind, kind.replace("layer_group_", "layer groups G="))


COLUMNS = (
    ("series", 20),
    ("median ms", 10),
    ("p90 ms", 9),
    ("descriptors", 13),
    ("pushes", 8),
    ("vs pull", 9),
    ("Push DONE ms", 14),
    ("NIXL ms", 9),
)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _cells(kind: str, s: dict[str, Any], ratio: float) -> str:
    cells = (
        _label(kind),
        _ms(s["exposed_median"]),
        _ms(s["exposed_p90"]),
        f"{s['descriptors']:,}",
        "-" if kind == "pull" else str(s["transfers"]),
        f"{ratio:.2f}",
        _ms(s.get("exposed_done_median")),
        _ms(s["nixl_median"]),
    )
    return _line(cells)


def _line(cells: tuple[str, ...]) -> str:
    """A table line: the first cell left-aligned, numbers right-aligned."""
    widths = [w for _, w in COLUMNS]
    return "  " + "".join(
        c.ljust(w) if i == 0 else c.rjust(w)
        for i, (c, w) in enumerate(zip(cells, widths, strict=True))
    )


def _row_lines(row: dict[str, Any], layers: int) -> list[str]:
    series = row["series"]
    lines = [
        f"{row['blocks']} blocks ({series['pull']['bytes'] / MIB:.1f} MiB), "
        f"{row['layer_ms']:g} ms a layer x {layers} = {layers * row['layer_ms']:g} ms of compute "
        f"(took {max(s['compute_median'] for s in series.values()) * 1e3:.1f})",
        _line(tuple(n for n, _ in COLUMNS)),
    ]
    lines += [_cells(k, s, row["vs_pull"].get(k, 1.0)) for k, s in series.items()]
    lines.append(f"  {_goal_line(row)}")
    overruns = max(s["overrun_layers"] for s in series.values())
    if overruns:
        lines.append(f"  (the compute overran its schedule in up to {overruns} of {layers} layers)")
    return lines


def _goal_line(row: dict[str, Any]) -> str:
    groups = {k: r for k, r in row["vs_pull"].items() if k.startswith("layer_group_")}
    best = min(groups, key=lambda k: groups[k])
    verdict = (
        f"met at G={', '.join(map(str, row['goal_met_groups']))}"
        if row["goal_met_groups"]
        else "not met"
    )
    return (
        f"goal (layer groups expose <= {GOAL:.0%} of the pull): {verdict}; "
        f"best {_label(best).split()[-1]} at {groups[best]:.0%}"
    )


def render(result: dict[str, Any]) -> str:
    """The figures as one table per (block count, layer time)."""
    head = [
        f"kvmapd bench --push: {result['profile']} ({result['layers']} layers), "
        f"{result['planner']} planner, pages / {result['page_divisor']} "
        f"({', '.join(f'{b:,} B' for b in result['page_bytes'])}), "
        f"median and p90 of {result['repeats']}, every byte verified",
        "exposed: what decode waits for once the last layer is computed; pull: "
        + result["exposed"]["pull"],
        "  push: " + result["exposed"]["push"] + "; Push DONE: " + result["exposed"]["push_done"],
        "NIXL: post + completion of the transfer that finished last, as its daemon reports it",
    ]
    lines = list(head)
    for row in result["rows"]:
        lines += ["", *_row_lines(row, result["layers"])]
    return "\n".join(lines) + "\n"


def run_cli(args: Any, progress: Callable[[str], None]) -> int:
    """``kvmapd bench --push ...`` (``bench.main``'s arguments)."""
    flags = ("--nixl-threads", str(args.nixl_threads))
    opts = PushOptions(
        profile=args.push_profile,
        blocks=args.push_blocks,
        groups=args.push_groups,
        layer_ms=args.layer_ms,
        repeats=args.repeats,
        budget=args.push_mib * MIB,
        planner=args.planner[-1] if args.planner else "coalesce",
        daemon_flags=flags if args.check_before_read else (*flags, "--no-check-before-read"),
        progress=progress,
    )
    result = run_push(opts)
    print(
        json.dumps(result, indent=2) if args.json else render(result), end="\n" if args.json else ""
    )
    return 0
