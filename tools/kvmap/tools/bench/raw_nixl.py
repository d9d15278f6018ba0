"""Raw NIXL next to kvmap: two bare NIXL agents in two processes (no daemon,
no gRPC), with the daemon's UCX settings (``launch.local_env``: loopback
only; agents without NIXL's progress thread, as ``NixlAgent.create`` makes
them), posting exactly the descriptor lists a kvmap daemon posts for the same
request: the same planner on the same geometry gives the same regions, the
same piece table (``build_piece_table``), the same prepared strided lists
(``piece_dlist_rows``) and the same index pairs (``plan_transfer``; NIXL
merges the runs among them); only the base addresses are this process's own.

The ``target`` process owns the source memory and drives its UCX worker
every ``LEASE_INTERVAL_S`` while a round runs (what the owner's daemon does
while a transfer's lease is open; ``pace``), every ``IDLE_INTERVAL_S``
otherwise, taking the notification each READ carries (vLLM's
NixlConnector has every READ notify the prefill, which frees the blocks on
it); the ``initiator`` posts READs and polls them at the busy
interval (``BUSY_INTERVAL_S``), as the reading daemon does. Posting N
requests back to back from one thread and then polling them all is what
one daemon's NIXL thread does with N pulls in flight.

Run as ``python -m kvmap.tools.bench.raw_nixl --role target|initiator``:
JSON lines on stdin/stdout (``json_lines``), driven by ``RawPair``.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import ctypes
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvmap.client.fd_handoff import sealed_memfd
from kvmap.core import convert
from kvmap.core import planner as planners
from kvmap.core.geometry import WorkerGeometry
from kvmap.core.transfer_pieces import LayerSelection, PieceTable, Side, build_piece_table
from kvmap.core.transfer_plan import (
    GroupPairs,
    TransferPlan,
    piece_dlist_rows,
    plan_transfer,
)
from kvmap.daemon.adapters import memory
from kvmap.daemon.adapters.nixl_agent import DlistHandle, NixlAgent, Xfer, XferOp, XferState
from kvmap.daemon.adapters.nixl_loader import nixl_module
from kvmap.daemon.engine.progress import BUSY_INTERVAL_S, IDLE_INTERVAL_S, LEASE_INTERVAL_S
from kvmap.tools import json_lines
from kvmap.tools.bench.host import cpu_seconds, own_switches, switches_between, thread_switches
from kvmap.tools.bench.profiles import get_profile
from kvmap.tools.launch import WorkerProc, _readline, local_env

START_TIMEOUT_S = 120.0
CALL_TIMEOUT_S = 600.0


@dataclass
class Space:
    """One geometry's memory in this process, registered with the agent."""

    geometry: WorkerGeometry
    bases: dict[str, int]
    maps: list[memory.MappedMemory]


@dataclass
class Prepped:
    """A planner's lists between a local and a remote space (as a daemon
    caches them per worker pair)."""

    table: PieceTable
    local: DlistHandle
    remote: DlistHandle


@dataclass
class RawSide:
    role: str
    agent: NixlAgent
    spaces: dict[str, Space] = field(default_factory=dict)
    remote_agent: str = ""
    remote_bases: dict[str, dict[str, int]] = field(default_factory=dict)
    prepped: dict[str, Prepped] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)
    # Set while a round runs (``pace``): the target drives UCX at the busy
    # pace then and at the idle pace otherwise, as the owner's daemon does
    # with and without an open lease, so that it takes no CPU from kvmap's
    # rounds between its own.
    busy: threading.Event = field(default_factory=threading.Event)
    # Requests posted so far: each READ's notification names its own.
    posts: int = 0

    # -- both sides -------------------------------------------------------

    def register(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Sparse memfds for every allocation of ``profile`` at ``divisor``,
        mapped and registered once each (as the daemon does)."""
        key = cmd["key"]
        geometry = get_profile(cmd["profile"]).geometry(int(cmd["divisor"]), key)
        maps: list[memory.MappedMemory] = []
        bases: dict[str, int] = {}
        for alloc in geometry.allocations:
            fd = sealed_memfd(f"kvmap-raw-{alloc.id}", alloc.size_bytes)
            mapped = memory.import_shm_fd(fd, 0, alloc.size_bytes)
            maps.append(mapped)
            self.agent.register_dram(mapped.address, mapped.size)
            bases[alloc.id] = mapped.address
        self.spaces[key] = Space(geometry, bases, maps)
        return {"ok": True, "bases": bases}

    def touch(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Make the pages of ``groups``' blocks resident (``blocks`` per
        group), or of whole allocations when ``all``."""
        space = self.spaces[cmd["key"]]
        if cmd.get("all"):
            for m in space.maps:
                ctypes.memset(m.address, 1, m.size)
            return {"ok": True}
        for g in cmd["groups"]:
            for v in space.geometry.views:
                if v.transfer_group != g["group"]:
                    continue
                base = space.bases[v.allocation_id] + v.offset_bytes
                for b in g["blocks"]:
                    ctypes.memset(base + b * v.block_stride_bytes, 1, v.block_len_bytes)
        return {"ok": True}

    def metadata(self, cmd: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True, "metadata": base64.b64encode(self.agent.metadata()).decode()}

    def progress(self) -> None:
        """The owner's side: drive UCX as its daemon does, at the lease pace
        while a round runs (a lease is open) and the idle pace otherwise."""
        while not self.stop.is_set():
            with contextlib.suppress(Exception):
                self.agent.take_notifs()
            time.sleep(LEASE_INTERVAL_S if self.busy.is_set() else IDLE_INTERVAL_S)

    def pace(self, cmd: dict[str, Any]) -> dict[str, Any]:
        if cmd["busy"]:
            self.busy.set()
        else:
            self.busy.clear()
        return {"ok": True}

    # -- the initiator ------------------------------------------------------

    def connect(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.remote_agent = self.agent.add_remote(base64.b64decode(cmd["metadata"]))
        self.remote_bases = {k: dict(v) for k, v in cmd["bases"].items()}
        return {"ok": True, "agent": self.remote_agent}

    def prepare(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """``planner``'s lists between local space ``local`` and the remote
        space ``remote`` (both of ``profile`` at ``divisor``)."""
        profile = get_profile(cmd["profile"])
        planner = planners.get_planner(cmd["planner"])
        local = self.spaces[cmd["local"]]
        remote_geometry = profile.geometry(int(cmd["divisor"]), cmd["remote"])
        local_model = convert.model_from_plan(
            local.geometry, planner.plan(local.geometry), 1, local.bases
        )
        remote_model = convert.model_from_plan(
            remote_geometry, planner.plan(remote_geometry), 1, self.remote_bases[cmd["remote"]]
        )
        selections = [LayerSelection(g) for g in cmd["groups"]]
        table = build_piece_table(local_model, remote_model, selections)
        self.prepped[cmd["id"]] = Prepped(
            table,
            self.agent.prep_local(piece_dlist_rows(table, Side.LOCAL, 0)),
            self.agent.prep_remote(self.remote_agent, piece_dlist_rows(table, Side.REMOTE, 0)),
        )
        return {"ok": True}

    def pull(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """``repeats`` rounds of posting every request of ``requests`` (each
        ``{"prep", "groups": [{"group", "local", "remote"}]}``) back to back,
        then polling them all. Per round: each request's post seconds, and
        seconds from the round's first post to its DONE. ``split`` posts each
        request as that many xfer handles; ``explicit`` posts every
        descriptor as an explicit row (no prepared lists)."""
        split, explicit = int(cmd.get("split", 1)), bool(cmd.get("explicit", False))
        jobs = [
            (self.prepped[r["prep"]], _plan(self.prepped[r["prep"]], r)) for r in cmd["requests"]
        ]
        pids = [os.getpid(), *(int(p) for p in cmd.get("cpu_pids", []))]
        rounds = []
        for _ in range(int(cmd.get("repeats", 1))):
            # CPU of the round only (this process and the target's), the
            # planning above and the command's parsing left out, as the
            # daemons' CPU is counted around a round of pulls.
            # Context switches likewise: this process's own (every thread,
            # those that end included), the others' thread by thread. Read
            # outside the CPU readings: a read of the target's threads from
            # /proc costs this process ~40 us a thread, which would count as
            # the round's CPU.
            own_before = own_switches()
            others_before = [thread_switches(pid) for pid in pids[1:]]
            before = [cpu_seconds(pid) for pid in pids]
            rounds.append(self._round(jobs, split, explicit))
            rounds[-1]["cpu_seconds"] = [
                cpu_seconds(pid) - b for pid, b in zip(pids, before, strict=True)
            ]
            others = [
                switches_between(b, thread_switches(pid))
                for pid, b in zip(pids[1:], others_before, strict=True)
            ]
            rounds[-1]["switches"] = [own_switches() - own_before, *others]
        return {
            "ok": True,
            "rounds": rounds,
            "bytes": [p.bytes for _, p in jobs],
            "descriptors": [p.descriptors for _, p in jobs],
        }

    def _round(
        self, jobs: list[tuple[Prepped, TransferPlan]], split: int, explicit: bool
    ) -> dict[str, list[float]]:
        start = time.perf_counter()
        posted: list[list[Xfer]] = []
        posts: list[float] = []
        for prepped, plan in jobs:
            self.posts += 1
            notif = f"raw-{self.posts}".encode()
            t = time.perf_counter()
            posted.append(self._post(prepped, plan, split, explicit, notif))
            posts.append(time.perf_counter() - t)
        done = [0.0] * len(jobs)
        pending = set(range(len(jobs)))
        while pending:
            for i in list(pending):
                states = [self.agent.poll(x) for x in posted[i]]
                if any(s is XferState.ERR for s in states):
                    raise RuntimeError(f"raw NIXL transfer failed: {posted[i]}")
                if all(s is XferState.DONE for s in states):
                    done[i] = time.perf_counter() - start
                    pending.discard(i)
            if pending:
                time.sleep(BUSY_INTERVAL_S)
        for xs in posted:
            for x in xs:
                self.agent.release(x)
        return {"post_seconds": posts, "pull_seconds": done}

    def _post(
        self, p: Prepped, plan: TransferPlan, split: int, explicit: bool, notif: bytes
    ) -> list[Xfer]:
        """What the daemon's ``Posting.post_and_wait`` posts for a plan of
        ``plan_transfer`` (one prepped transfer of index pairs), optionally
        cut into ``split`` handles, or every descriptor explicit. The last
        handle carries ``notif`` to the target when it is done, as vLLM's
        NixlConnector has each READ carry its request's notification (the
        prefill frees the blocks on it); the daemon sends its owner one too."""
        op = XferOp.READ
        li, ri = plan.local_indices, plan.remote_indices
        if not len(li):
            return []
        if explicit:
            local, remote = _index_rows(p, Side.LOCAL, li), _index_rows(p, Side.REMOTE, ri)

            def post(a: Any, b: Any, notif: bytes) -> Xfer:
                return self.agent.post_descs(op, a, b, self.remote_agent, notif=notif)
        else:
            local, remote = li, ri

            def post(a: Any, b: Any, notif: bytes) -> Xfer:
                return self.agent.post_prepped(op, p.local, a, p.remote, b, notif=notif)

        halves = zip(np.array_split(local, split), np.array_split(remote, split), strict=True)
        pieces = [(a, b) for a, b in halves if len(a)]
        last = len(pieces) - 1
        return [post(a, b, notif if i == last else b"") for i, (a, b) in enumerate(pieces)]


def _plan(p: Prepped, request: dict[str, Any]) -> TransferPlan:
    pairs = [GroupPairs(g["group"], g["local"], g["remote"]) for g in request["groups"]]
    return plan_transfer(p.table, pairs)


def _index_rows(p: Prepped, side: Side, idx: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Explicit (addr, len, dev) rows of prepared descriptors ``idx``."""
    rows = p.table.side(side)
    piece = np.searchsorted(rows.first_index, idx, side="right") - 1
    block = idx - rows.first_index[piece]
    addr = rows.addr[piece] + rows.stride[piece] * block
    return np.stack([addr, p.table.len_bytes[piece], np.zeros_like(addr)], axis=1)


COMMANDS = ("register", "touch", "metadata", "connect", "prepare", "pull", "pace")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvmap-bench-raw-nixl", allow_abbrev=False)
    p.add_argument("--role", choices=("target", "initiator"), required=True)
    p.add_argument("--num-workers", type=int, default=0, help="UCX backend num_workers")
    p.add_argument("--threads", type=int, default=0, help="UCX threads (kvmapd's nixl_threads)")
    args = p.parse_args(argv)
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # NIXL and UCX log to fd 1
    sys.stdout = sys.stderr
    agent = _agent(f"raw-{args.role}-{os.getpid()}", args.num_workers, args.threads)
    side = RawSide(args.role, agent)
    progress = None
    if args.role == "target":
        progress = threading.Thread(target=side.progress, daemon=True, name="raw-progress")
        progress.start()

    def handle(cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd.get("cmd", "")
        if op not in COMMANDS:
            return {"ok": False, "code": "UNKNOWN_COMMAND", "message": str(op)}
        out: dict[str, Any] = getattr(side, op)(cmd)
        return out

    try:
        json_lines.serve({"ready": True, "pid": os.getpid()}, handle, answers)
    finally:
        side.stop.set()
        if progress is not None:
            progress.join(1.0)
        agent.close()
    return 0


def _agent(name: str, num_workers: int, threads: int) -> NixlAgent:
    if not num_workers:
        return NixlAgent.create(name, threads=threads)
    # A backend parameter NixlAgent does not expose: the bandwidth variants only.
    nixl_api = nixl_module("_api")
    config = nixl_api.nixl_agent_config(enable_prog_thread=False, backends=[])
    raw = nixl_api.nixl_agent(name, config)
    raw.create_backend("UCX", {"num_workers": str(num_workers)})
    return NixlAgent(name, raw, False)


# The driver -------------------------------------------------------------------


def spawn(workdir: Path, role: str, env: dict[str, str], extra: list[str]) -> WorkerProc:
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / f"raw-{role}.log"
    cmd = [sys.executable, "-m", "kvmap.tools.bench.raw_nixl", "--role", role, *extra]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env={**local_env(workdir), **env},
            cwd=workdir,
        )
    try:
        ready = json.loads(_readline(proc, START_TIMEOUT_S, log_path))
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise
    return WorkerProc(proc=proc, ready=ready, log_path=log_path)


class RawPair:
    """A target and an initiator process; the initiator pulls from the target."""

    def __init__(
        self,
        stack: contextlib.ExitStack,
        workdir: Path,
        env: dict[str, str] | None = None,
        num_workers: int = 0,
        nixl_threads: int = 0,
    ) -> None:
        extra = ["--num-workers", str(num_workers)] if num_workers else []
        extra += ["--threads", str(nixl_threads)]
        self.target = spawn(workdir / "target", "target", env or {}, extra)
        stack.callback(self.target.stop)
        self.initiator = spawn(workdir / "initiator", "initiator", env or {}, extra)
        stack.callback(self.initiator.stop)
        self.bases: dict[str, dict[str, int]] = {}

    @staticmethod
    def _call(w: WorkerProc, cmd: dict[str, Any]) -> dict[str, Any]:
        out = w.call(cmd, timeout=CALL_TIMEOUT_S)
        if not out.get("ok"):
            raise RuntimeError(f"raw NIXL {cmd['cmd']} failed: {out}")
        return out

    def register(self, key: str, profile: str, divisor: int) -> None:
        """The same geometry on both sides under ``key``."""
        cmd = {"cmd": "register", "key": key, "profile": profile, "divisor": divisor}
        self.bases[key] = self._call(self.target, cmd)["bases"]
        self._call(self.initiator, cmd)

    def touch(self, key: str, groups: list[dict[str, Any]] | None = None) -> None:
        """Source blocks (or, without ``groups``, all memory) of ``key``."""
        cmd = {"cmd": "touch", "key": key, "all": groups is None, "groups": groups or []}
        self._call(self.target, cmd)
        if groups is None:
            self._call(self.initiator, cmd)

    def connect(self) -> None:
        md = self._call(self.target, {"cmd": "metadata"})["metadata"]
        self._call(self.initiator, {"cmd": "connect", "metadata": md, "bases": self.bases})

    def prepare(
        self,
        prep: str,
        planner: str,
        key: str,
        *,
        profile: str,
        divisor: int,
        groups: tuple[int, ...],
    ) -> None:
        self._call(
            self.initiator,
            {
                "cmd": "prepare",
                "id": prep,
                "planner": planner,
                "local": key,
                "remote": key,
                "profile": profile,
                "divisor": divisor,
                "groups": list(groups),
            },
        )

    def pull(self, requests: list[dict[str, Any]], repeats: int, **variant: Any) -> dict[str, Any]:
        """``repeats`` rounds of ``requests`` (``RawSide.pull``); each
        round's ``cpu_seconds`` and ``switches`` (context switches) are
        [initiator, target]. The target is at the busy pace only meanwhile."""
        self._call(self.target, {"cmd": "pace", "busy": True})
        try:
            return self._call(
                self.initiator,
                {
                    "cmd": "pull",
                    "requests": requests,
                    "repeats": repeats,
                    "cpu_pids": [self.target.pid],
                    **variant,
                },
            )
        finally:
            self._call(self.target, {"cmd": "pace", "busy": False})


if __name__ == "__main__":
    sys.exit(main())
