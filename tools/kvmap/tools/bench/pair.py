"""A planner's processes: its prefill and decode daemons, a bench worker
next to each (``Pair``), and what is read from them directly: the daemons'
resident memory, their CPU time, and the agent metadata a peer downloads."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Any

from kvmap.tools.bench.host import cpu_seconds, switches_between, thread_switches
from kvmap.tools.bench.options import MIB
from kvmap.tools.bench.results import Rss
from kvmap.tools.bench.worker import packed_ids
from kvmap.tools.bench.workload import Request
from kvmap.tools.launch import DaemonProc, WorkerProc, spawn_worker, start_daemon
from kvmap.tools.peers import peer_channel, read_secret, session_peer_secret
from kvmap.v1 import peer_pb2, peer_pb2_grpc, types_pb2

WORKER_TIMEOUT_S = 180.0


def start_daemons(
    workdir: Path, planners_: list[str], flags: tuple[str, ...]
) -> dict[str, tuple[DaemonProc, DaemonProc]]:
    """Start a prefill and a decode daemon per planner, all at once, each
    with ``flags`` (``Options.daemon_flags``) and a state dir of its own on
    this machine's disk, as deployed (deploy/k8s: an emptyDir): the store's
    writes are part of what a pull and a grant cost."""
    out: dict[tuple[str, str], DaemonProc] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def start(planner: str, side: str) -> None:
        try:
            home = workdir / planner / side
            d = start_daemon(
                home,
                *("--planner", planner, "--state-dir", str(home / "state"), *flags),
                name=side,
            )
        except BaseException as err:
            with lock:
                errors.append(err)
            return
        with lock:
            out[(planner, side)] = d

    threads = [
        threading.Thread(target=start, args=(p, side))
        for p in planners_
        for side in ("prefill", "decode")
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for d in out.values():
            d.kill()
        raise errors[0]
    return {p: (out[(p, "prefill")], out[(p, "decode")]) for p in planners_}


def _start_worker(daemon: DaemonProc, side: str) -> WorkerProc:
    return spawn_worker(
        daemon, "kvmap.tools.bench.worker", [], f"bench-worker-{side}", WORKER_TIMEOUT_S
    )


def call(w: WorkerProc, cmd: dict[str, Any]) -> dict[str, Any]:
    out = w.call(cmd, timeout=WORKER_TIMEOUT_S)
    if not out.get("ok"):
        raise RuntimeError(f"bench worker {cmd['cmd']} failed: {out.get('code')}: {out}")
    return out


def daemon_rss(pid: int) -> int:
    """The daemon's own resident memory: RSS minus the shared KV-cache pages
    it maps (those belong to the worker and are counted there)."""
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            key, _, rest = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                fields[key] = int(rest.split()[0]) * 1024
    return fields.get("RssAnon", 0) + fields.get("RssFile", 0)


def agent_metadata(target: str, engine_id: str) -> peer_pb2.GetAgentMetadataResponse:
    """What a peer downloads at first contact (the Peer handshake), presenting
    the peer secret the daemons started here share."""
    secret = read_secret(session_peer_secret())
    with peer_channel(target, secret, [("grpc.max_receive_message_length", 64 * MIB)]) as ch:
        stub = peer_pb2_grpc.PeerStub(ch)
        resp: peer_pb2.GetAgentMetadataResponse = stub.GetAgentMetadata(
            peer_pb2.GetAgentMetadataRequest(worker=types_pb2.WorkerId(engine_id=engine_id)),
            timeout=30,
        )
    return resp


class Pair:
    """A planner's two daemons (prefill, decode) and a bench worker next to
    each. The decode worker pulls; the prefill worker owns the source."""

    def __init__(
        self, stack: contextlib.ExitStack, planner: str, daemons: tuple[DaemonProc, DaemonProc]
    ) -> None:
        self.planner = planner
        self.prefill, self.decode = daemons
        stack.callback(self.prefill.stop)
        stack.callback(self.decode.stop)
        self.pw = _start_worker(self.prefill, "prefill")
        stack.callback(self.pw.stop)
        self.dw = _start_worker(self.decode, "decode")
        stack.callback(self.dw.stop)
        self.pulls = 0

    def register(self, side: str, name: str, profile: str, divisor: int) -> dict[str, Any]:
        """Register worker ``<side>-<name>`` with the profile's geometry."""
        return call(
            self.pw if side == "prefill" else self.dw,
            {
                "cmd": "register",
                "name": name,
                "engine_id": f"{side}-{name}",
                "profile": profile,
                "divisor": divisor,
            },
        )

    def deregister(self, side: str, name: str) -> None:
        """Deregister worker ``<side>-<name>``: its registered bytes count
        against the daemon's ``max_registered_bytes`` no more."""
        call(self.pw if side == "prefill" else self.dw, {"cmd": "deregister", "name": name})

    def pull(self, name: str, req: Request, remote: str = "") -> dict[str, Any]:
        """Decode worker ``name`` pulls ``req`` from prefill worker ``remote``
        (default: the prefill worker of the same name), with the capability
        that worker granted for exactly those blocks (outside the timing)."""
        return call(self.dw, self._pull_cmd(name, req, remote))

    def pull_many(
        self,
        pulls: list[tuple[str, Request, str]],
        cpu: dict[str, float] | None = None,
        grant_cpu: dict[str, float] | None = None,
        switches: dict[str, float] | None = None,
    ) -> list[dict[str, Any]]:
        """Every (decode worker, request, prefill worker) pull in flight at
        once (granted first, outside the timing); their answers in order.
        With ``cpu``, the pulls' CPU seconds are added to it by place
        (``CPU_PLACES``; the grants are outside the count, as the timing).
        With ``grant_cpu``, the owner daemon's CPU seconds over the grants
        are added to it (``GRANT_CPU_PLACES``): what a request's grant costs
        the prefill side, which raw NIXL has no counterpart of. With
        ``switches`` (and ``cpu``), the pulls' context switches are added
        to it by place (``SWITCH_PLACES``), over the same window."""
        before_grants = cpu_now(self) if grant_cpu is not None else {}
        cmds = [self._pull_cmd(name, req, remote) for name, req, remote in pulls]
        if grant_cpu is not None:
            _add_cpu(grant_cpu, before_grants, cpu_now(self), GRANT_CPU_PLACES)
        if cpu is None:
            out: list[dict[str, Any]] = call(self.dw, {"cmd": "pull_many", "pulls": cmds})["pulls"]
            return out
        # The window opens once the worker has read the command, built the
        # specs and started the threads (harness work, not the client's) and
        # closes when the last pull is DONE and answered.
        call(self.dw, {"cmd": "stage_pulls", "pulls": cmds})
        # Read only where counted: a /proc read costs ~40 us a thread.
        switched = self._thread_switches() if switches is not None else {}
        before = cpu_now(self)
        released = call(self.dw, {"cmd": "release_pulls"})
        _add_cpu(cpu, before, cpu_now(self), CPU_PLACES)
        if switches is not None:
            after = self._thread_switches()
            counted = {p: switches_between(b, after[p]) for p, b in switched.items()}
            # The worker's pull threads have ended by now: it counts its own.
            counted["decode_worker"] = int(released["switches"])
            for place, n in counted.items():
                switches[place] = switches.get(place, 0.0) + n
        pulled: list[dict[str, Any]] = released["pulls"]
        return pulled

    def _thread_switches(self) -> dict[str, dict[int, int]]:
        """``thread_switches`` of every place but the decode worker."""
        pids = (self.prefill.proc.pid, self.decode.proc.pid, self.pw.pid)
        places = ("prefill_daemon", "decode_daemon", "prefill_worker")
        return {place: thread_switches(pid) for place, pid in zip(places, pids, strict=True)}

    def pull_streams(self, streams: list[list[tuple[str, Request, str]]]) -> float:
        """Each stream's pulls ((decode worker, request, prefill worker), as
        ``pull_many``) one after another on a thread of its own, all streams
        at once (granted first, outside the timing); the wall time from
        their release until the last pull was done."""
        cmds = [[self._pull_cmd(name, req, remote) for name, req, remote in s] for s in streams]
        call(self.dw, {"cmd": "stage_streams", "streams": cmds})
        return float(call(self.dw, {"cmd": "release_pulls"})["wall_seconds"])

    def _pull_cmd(self, name: str, req: Request, remote: str) -> dict[str, Any]:
        self.pulls += 1
        owner = remote or name
        request_id = f"bench-{name}-{self.pulls}"
        blocks: dict[int, dict[int, None]] = {}
        for g, ids in zip(req.groups, req.remote, strict=True):
            blocks.setdefault(g, {}).update(dict.fromkeys(ids))
        grant = call(
            self.pw,
            {
                "cmd": "grant",
                "name": owner,
                "request_id": request_id,
                "groups": [{"group": g, "blocks": list(ids)} for g, ids in blocks.items()],
            },
        )
        return {
            "cmd": "pull",
            "name": name,
            "request_id": request_id,
            "remote_target": self.prefill.tcp_target,
            "remote_engine_id": f"prefill-{owner}",
            # Packed ids: json reads thousands of numbers per group 4x
            # slower than their base64 (``worker._ids``).
            "groups": [
                {
                    "group": g["group"],
                    "local": packed_ids(g["local"]),
                    "remote": packed_ids(g["remote"]),
                }
                for g in req.spec()
            ],
            "capability": grant["capability"],
        }

    def fill(self, name: str, req: Request) -> None:
        """Write the pattern into the source blocks of ``req``."""
        groups = [
            {"group": g, "blocks": ids} for g, ids in zip(req.groups, req.remote, strict=True)
        ]
        call(self.pw, {"cmd": "fill", "name": name, "groups": groups})

    def zero(self, name: str, req: Request) -> None:
        call(self.dw, {"cmd": "zero", "name": name, "groups": req.spec()})

    def verify(self, name: str, req: Request) -> tuple[int, int]:
        """(bytes checked, blocks that differ) of ``req``'s destination."""
        out = call(self.dw, {"cmd": "verify", "name": name, "groups": req.spec()})
        return int(out["bytes"]), int(out["bad_blocks"])

    def contact(self, profile: str, repeats: int) -> dict[str, Any]:
        """First-contact steps timed in the decode worker (bench.contact)."""
        return call(
            self.dw,
            {
                "cmd": "contact",
                "remote_target": self.prefill.tcp_target,
                "remote_engine_id": "prefill-full",
                "profile": profile,
                "planner": self.planner,
                "repeats": repeats,
            },
        )

    def rss(self) -> Rss:
        return Rss(
            prefill=daemon_rss(self.prefill.proc.pid), decode=daemon_rss(self.decode.proc.pid)
        )

    def notified(self) -> int:
        """Transfers the prefill worker was told of (TransferFinished events)."""
        return int(call(self.pw, {"cmd": "events"})["finished"])


# Where a concurrency round's CPU time is counted: each daemon's event loop
# (its main thread) and its other threads (the NIXL thread above all, and
# grpc's), and both bench workers (the stand-in vLLM workers: the decode one
# calls Pull, the prefill one reads its Attach stream's TransferFinished
# events).
CPU_PLACES = (
    "prefill_loop",
    "prefill_threads",
    "decode_loop",
    "decode_threads",
    "decode_worker",
    "prefill_worker",
)


# Where a concurrency round's context switches are counted: each daemon
# (every thread), and both bench workers. On a VM each wake of a blocked
# thread costs tens of microseconds of CPU (~40 us on the 2-vCPU VM of
# docs/benchmarks.md, "Caveats"): the figure says how many a pull takes.
SWITCH_PLACES = ("prefill_daemon", "decode_daemon", "decode_worker", "prefill_worker")


# Where a grant's CPU time is counted: the owner daemon's event loop and its
# other threads (the prefill worker's share is the bench's JSON command of
# thousands of block ids as much as the client's call, so it is left out).
GRANT_CPU_PLACES = ("prefill_loop", "prefill_threads")


def _add_cpu(
    into: dict[str, float],
    before: dict[str, float],
    after: dict[str, float],
    places: tuple[str, ...],
) -> None:
    """Add each place's CPU seconds between two ``cpu_now`` readings."""
    for k in places:
        # A thread's tick can land between the two reads that split
        # main thread from the rest: never count less than nothing.
        into[k] = into.get(k, 0.0) + max(0.0, after[k] - before[k])


def _process_cpu(pid: int) -> tuple[float, float]:
    """(main thread, other threads) CPU seconds of a process so far. The
    process's own stat counts every thread, those that ended included, so
    a thread ending between two readings takes nothing away."""
    main = cpu_seconds(pid, pid)
    return main, cpu_seconds(pid) - main


def cpu_now(pair: Pair) -> dict[str, float]:
    """CPU seconds so far in each of ``CPU_PLACES`` of a planner's pair."""
    p_loop, p_threads = _process_cpu(pair.prefill.proc.pid)
    d_loop, d_threads = _process_cpu(pair.decode.proc.pid)
    workers = (cpu_seconds(pair.dw.pid), cpu_seconds(pair.pw.pid))
    places = (p_loop, p_threads, d_loop, d_threads, *workers)
    return dict(zip(CPU_PLACES, places, strict=True))
