"""A stand-in for a vLLM worker, run as its own process by ``kvmapd bench``:
it maps each allocation of a profile's geometry as a sparse memfd (only the
blocks a request touches ever get memory), registers it with its kvmapd over
the client library (fds over SCM_RIGHTS), keeps an Attach stream open per
registered worker, and obeys JSON-line commands on stdin, answering one JSON
line each on stdout.

Block contents are a pure function of (view index, block id, word), distinct
for every 8-byte word of the cache (``kvmap.tools.block_pattern``), so the
decode side verifies what it pulled without seeing the prefill side's memory,
and a block pulled from any other block, view or offset fails.
Memory is filled and checked as 32-bit words through strided numpy views,
one view per layer, so a full 128K-token request checks in well under a
second.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import contextlib
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import as_strided

from kvmap.client.client import KvmapClient
from kvmap.client.errors import status_name
from kvmap.client.fd_handoff import sealed_memfd
from kvmap.core.errors import KvmapError, Unavailable
from kvmap.core.geometry import ViewSpec, WorkerGeometry
from kvmap.tools import block_pattern, json_lines
from kvmap.tools.bench.host import own_switches
from kvmap.tools.bench.profiles import WORD, get_profile
from kvmap.v1 import registry_pb2, transfers_pb2, types_pb2

Words = npt.NDArray[np.uint32]

REGISTER_ATTEMPTS = 3
# How long staged pulls wait for their release before giving up.
STAGED_TIMEOUT_S = 600.0


def pattern(view_index: int, blocks: npt.NDArray[np.int64], words: int) -> Words:
    """The words of blocks ``blocks`` of view ``view_index`` on a prefill worker."""
    return block_pattern.words32_numpy(view_index, blocks, words)


@dataclass
class Registered:
    """One registered worker: its geometry, memory and Attach events."""

    name: str
    worker: types_pb2.WorkerId
    geometry: WorkerGeometry
    maps: dict[str, mmap.mmap]
    finished: int = 0
    stream_errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def words(self, view: ViewSpec) -> Words:
        """View ``view`` as a (num_blocks, block_len / 4) array of words."""
        base = np.frombuffer(self.maps[view.allocation_id], dtype=np.uint32)
        start = base[view.offset_bytes // WORD :]
        arr: Words = as_strided(
            start,
            shape=(view.num_blocks, view.block_len_bytes // WORD),
            strides=(view.block_stride_bytes, WORD),
        )
        return arr

    def views_of(self, group: int) -> list[tuple[int, ViewSpec]]:
        return [(i, v) for i, v in enumerate(self.geometry.views) if v.transfer_group == group]

    def close(self) -> None:
        for m in self.maps.values():
            with contextlib.suppress(BufferError):
                m.close()


def _ids(values: list[int] | str) -> npt.NDArray[np.int64]:
    """Block ids sent as a JSON list, or as base64 of packed little-endian
    int64 (``packed_ids``, what ``pull`` commands carry: json reads a
    32-pull command 4x faster than with lists of numbers)."""
    if isinstance(values, str):
        return np.frombuffer(binascii.a2b_base64(values), dtype="<i8").astype(np.int64, copy=False)
    return np.asarray(values, dtype=np.int64)


def _id_list(values: list[int] | str) -> list[int]:
    """``_ids`` as the list a TransferSpec's repeated field takes fastest."""
    if isinstance(values, str):
        ids: list[int] = _ids(values).tolist()
        return ids
    return values


def packed_ids(values: list[int]) -> str:
    """``values`` as ``_ids`` reads them back: base64 of little-endian int64."""
    return base64.b64encode(np.asarray(values, dtype="<i8").tobytes()).decode("ascii")


def _register_request(
    worker: types_pb2.WorkerId, geometry: WorkerGeometry
) -> registry_pb2.RegisterWorkerRequest:
    """``geometry`` as a RegisterWorker request, allocation ``i`` handed over
    as the ``i``-th fd."""
    req = registry_pb2.RegisterWorkerRequest(
        worker=worker,
        kv_cache_layout=geometry.kv_cache_layout,
        block_size_tokens=geometry.block_size_tokens,
        tp_size=geometry.tp_size,
    )
    for i, alloc in enumerate(geometry.allocations):
        req.allocations.add(
            id=alloc.id,
            size_bytes=alloc.size_bytes,
            device=types_pb2.Device(type=types_pb2.DEVICE_TYPE_CPU),
            shm_fd=types_pb2.ShmFdHandle(index=i),
        )
    for v in geometry.views:
        req.views.add(
            layer_name=v.layer_name,
            allocation_id=v.allocation_id,
            transfer_group=v.transfer_group,
            cache_kind=int(v.cache_kind),
            dtype=v.dtype,
            offset_bytes=v.offset_bytes,
            block_len_bytes=v.block_len_bytes,
            block_stride_bytes=v.block_stride_bytes,
            num_blocks=v.num_blocks,
        )
    return req


def timed_pull(client: KvmapClient, spec: transfers_pb2.TransferSpec) -> dict[str, Any]:
    """One pull's answer: its wall time from the Pull call to DONE, as a
    decode worker sees it, and its stats; or the status it failed with."""
    start = time.perf_counter()
    try:
        result = client.pull(spec, timeout_s=120.0)
    except KvmapError as err:
        return {"ok": False, "code": status_name(err), "message": err.message}
    wall = time.perf_counter() - start
    return {"ok": True, "wall_seconds": wall, "stats": dict(result.__dict__)}


class _Staged:
    """Streams of pulls whose threads wait at a gate, each with its specs
    built: the gate opens when ``release`` joins it (``parties`` includes
    the caller); each thread then makes its stream's pulls one after
    another (a stream of one: a single pull in flight)."""

    def __init__(
        self, client: KvmapClient, streams: list[list[transfers_pb2.TransferSpec]]
    ) -> None:
        self.client = client
        self.streams = streams
        self.gate = threading.Barrier(len(streams) + 1)
        self.out: list[list[dict[str, Any]]] = [[] for _ in streams]
        self.threads = [
            threading.Thread(target=self._one, args=(i,), daemon=True) for i in range(len(streams))
        ]
        for t in self.threads:
            t.start()

    def _one(self, i: int) -> None:
        try:
            self.gate.wait(timeout=STAGED_TIMEOUT_S)
        except threading.BrokenBarrierError:
            self.out[i] = [{"ok": False, "code": "NOT_RELEASED", "message": "gate broken"}]
            return
        for spec in self.streams[i]:
            self.out[i].append(timed_pull(self.client, spec))

    def release(self) -> tuple[list[dict[str, Any]], float]:
        """Every pull's answer, stream by stream, and the wall time from
        the gate's opening until the last stream was done."""
        self.gate.wait(timeout=STAGED_TIMEOUT_S)
        start = time.perf_counter()
        for t in self.threads:
            t.join()
        return [o for stream in self.out for o in stream], time.perf_counter() - start


class BenchWorker:
    def __init__(self, socket: str) -> None:
        self.client = KvmapClient.connect(socket, timeout_s=120.0)
        self.workers: dict[str, Registered] = {}
        self._staged: _Staged | None = None

    def register_many(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Register every ``workers`` entry (each a ``register`` command) at
        once, one thread each, as the ranks of a TP pod start together:
        each one's ready time and the wall time until the last was ready."""
        cmds: list[dict[str, Any]] = cmd["workers"]
        gate = threading.Barrier(len(cmds))
        out: list[dict[str, Any]] = [{} for _ in cmds]
        errors: list[BaseException] = []

        def one(i: int) -> None:
            gate.wait()
            try:
                out[i] = self.register(cmds[i])
            except BaseException as err:  # reported below, not lost in a thread
                errors.append(err)

        start = time.perf_counter()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(cmds))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
        if errors:
            raise errors[0]
        return {"ok": True, "wall_seconds": wall, "workers": out}

    def register(self, cmd: dict[str, Any]) -> dict[str, Any]:
        profile = get_profile(cmd["profile"])
        engine_id = cmd["engine_id"]
        geometry = profile.geometry(int(cmd.get("divisor", 1)), engine_id)
        worker = types_pb2.WorkerId(engine_id=engine_id)
        req = _register_request(worker, geometry)
        fds: list[int] = []
        maps: dict[str, mmap.mmap] = {}
        try:
            for alloc in geometry.allocations:
                # Sparse: ftruncate allocates nothing; pages appear only where
                # a fill or a pull writes.
                fd = sealed_memfd(f"kvmap-bench-{alloc.id}", alloc.size_bytes)
                fds.append(fd)
                maps[alloc.id] = mmap.mmap(fd, alloc.size_bytes, flags=mmap.MAP_SHARED)
            region_map, ready_s = self._register(req, fds)
        finally:
            for fd in fds:
                os.close(fd)  # the daemon holds its own duplicates now
        reg = Registered(cmd["name"], worker, geometry, maps)
        self.workers[reg.name] = reg
        self._attach(reg)
        raw = region_map.SerializeToString()
        return {
            "ok": True,
            "ready_seconds": ready_s,
            "request_bytes": req.ByteSize(),
            "region_map": base64.b64encode(raw).decode(),
        }

    def _register(
        self, req: registry_pb2.RegisterWorkerRequest, fds: list[int]
    ) -> tuple[types_pb2.RegionMap, float]:
        """Register, timing the attempt that succeeds: on a busy machine the
        first connection to a just-started daemon can time out."""
        for attempt in range(REGISTER_ATTEMPTS):
            start = time.perf_counter()
            try:
                region_map = self.client.register(req, fds)
            except Unavailable:
                if attempt == REGISTER_ATTEMPTS - 1:
                    raise
                time.sleep(0.5 * (attempt + 1))
                continue
            return region_map, time.perf_counter() - start
        raise AssertionError("unreachable")

    def _attach(self, reg: Registered) -> None:
        stream = self.client.attach(reg.worker)

        def run() -> None:
            try:
                for event in stream:
                    if event.HasField("transfer_finished"):
                        with reg.lock:
                            reg.finished += 1
            except KvmapError as err:
                with reg.lock:
                    reg.stream_errors.append(str(err))

        threading.Thread(target=run, daemon=True, name=f"attach-{reg.name}").start()

    def deregister(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Deregister worker ``name`` and unmap its memory."""
        reg = self.workers.pop(cmd["name"])
        self.client.deregister(reg.worker)
        reg.close()
        return {"ok": True}

    def fill(self, cmd: dict[str, Any]) -> dict[str, Any]:
        reg = self.workers[cmd["name"]]
        nbytes = 0
        for g in cmd["groups"]:
            blocks = _ids(g["blocks"])
            for vi, view in reg.views_of(g["group"]):
                arr = reg.words(view)
                arr[blocks] = pattern(vi, blocks, arr.shape[1])
                nbytes += blocks.size * view.block_len_bytes
        return {"ok": True, "bytes": nbytes}

    def zero(self, cmd: dict[str, Any]) -> dict[str, Any]:
        reg = self.workers[cmd["name"]]
        for g in cmd["groups"]:
            blocks = _ids(g["local"])
            for _, view in reg.views_of(g["group"]):
                reg.words(view)[blocks] = 0
        return {"ok": True}

    def verify(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Local block ``local[i]`` of every view of the group must hold remote
        block ``remote[i]``'s pattern; counts (view, block) pairs that differ."""
        reg = self.workers[cmd["name"]]
        bad = nbytes = 0
        for g in cmd["groups"]:
            local, remote = _ids(g["local"]), _ids(g["remote"])
            for vi, view in reg.views_of(g["group"]):
                got = reg.words(view)[local]
                want = pattern(vi, remote, got.shape[1])
                bad += int(np.count_nonzero((got != want).any(axis=1)))
                nbytes += got.nbytes
        return {"ok": True, "bad_blocks": bad, "bytes": nbytes}

    def pull(self, cmd: dict[str, Any]) -> dict[str, Any]:
        return timed_pull(self.client, self._spec(cmd))

    def pull_many(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """The ``pulls`` (each a ``pull`` command) all in flight at once, one
        thread each, released together; each one's wall time runs from its
        own Pull call to DONE, as a decode worker sees it. The same as
        ``stage_pulls`` then ``release_pulls``, in one command."""
        staged = self.stage_pulls(cmd)
        if not staged.get("ok"):
            return staged
        return self.release_pulls({})

    def stage_pulls(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """``pull_many``'s first half: read the ``pulls``, build their specs
        and start their threads, each waiting at the gate; ``release_pulls``
        opens it. Between the two, the harness's own work (parsing a
        command of ~130K block ids, starting 32 threads) is over, so a CPU
        reading taken there counts only the pulls."""
        return self.stage_streams({"streams": [[c] for c in cmd["pulls"]]})

    def stage_streams(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """``stage_pulls`` for ``streams`` (lists of ``pull`` commands): one
        thread per stream makes its pulls one after another once released,
        as a rank that always has its next pull to make (a pod at
        saturation)."""
        if self._staged is not None:
            return {"ok": False, "code": "ALREADY_STAGED", "message": "release_pulls first"}
        streams = [[self._spec(c) for c in stream] for stream in cmd["streams"]]
        self._staged = _Staged(self.client, streams)
        return {"ok": True, "staged": sum(len(stream) for stream in streams)}

    def release_pulls(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Release the staged pulls together; their answers, in order, the
        wall time until the last one was done, and this process's context
        switches meanwhile (its pull threads', which /proc forgets once
        they end, included)."""
        staged, self._staged = self._staged, None
        if staged is None:
            return {"ok": False, "code": "NOT_STAGED", "message": "stage_pulls first"}
        switched = own_switches()
        out, wall = staged.release()
        switches = own_switches() - switched
        failed = [o for o in out if not o.get("ok")]
        if failed:
            return {"ok": False, "code": failed[0].get("code"), "message": str(failed[0])}
        return {"ok": True, "pulls": out, "wall_seconds": wall, "switches": switches}

    def _spec(self, cmd: dict[str, Any]) -> transfers_pb2.TransferSpec:
        reg = self.workers[cmd["name"]]
        spec = transfers_pb2.TransferSpec(
            request_id=cmd["request_id"],
            local_worker=reg.worker,
            remote_target=cmd["remote_target"],
            remote_worker=types_pb2.WorkerId(engine_id=cmd["remote_engine_id"]),
            # The remote owner's grant (its ``grant`` command).
            capability=cmd.get("capability", ""),
        )
        for g in cmd["groups"]:
            spec.groups.add(
                transfer_group=g["group"],
                local_block_ids=_id_list(g["local"]),
                remote_block_ids=_id_list(g["remote"]),
            )
        return spec

    def grant(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Worker ``name`` (the owner) lets a peer pull exactly the blocks of
        ``groups`` ([{"group", "blocks"}]) for ``request_id``, as a vLLM
        prefill worker does; the answer's capability goes into the pull."""
        reg = self.workers[cmd["name"]]
        blocks: dict[int, list[int]] = {}
        for g in cmd["groups"]:
            blocks.setdefault(int(g["group"]), []).extend(int(b) for b in g["blocks"])
        grant = self.client.grant_transfer(
            reg.worker, cmd["request_id"], blocks, max_uses=int(cmd.get("max_uses", 0))
        )
        return {"ok": True, "capability": grant.capability}

    def contact(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Time the steps of a first contact with a remote daemon (bench.contact)."""
        from kvmap.tools.bench.contact import first_contact_steps  # noqa: PLC0415  (NIXL)

        steps = first_contact_steps(
            cmd["remote_target"],
            cmd["remote_engine_id"],
            cmd["profile"],
            cmd["planner"],
            int(cmd.get("repeats", 10)),
        )
        return {"ok": True, **steps}

    def events(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """TransferFinished events of worker ``name`` (default: all of them)."""
        names = [cmd["name"]] if cmd.get("name") else list(self.workers)
        finished, errors = 0, []
        for name in names:
            reg = self.workers[name]
            with reg.lock:
                finished += reg.finished
                errors += reg.stream_errors
        return {"ok": True, "finished": finished, "stream_errors": errors}

    def close(self) -> None:
        self.client.close()
        for reg in self.workers.values():
            reg.close()


COMMANDS = (
    "register",
    "register_many",
    "deregister",
    "fill",
    "zero",
    "verify",
    "grant",
    "pull",
    "pull_many",
    "stage_pulls",
    "release_pulls",
    "stage_streams",
    "contact",
    "events",
)


def dispatch(w: Any, commands: Collection[str], cmd: dict[str, Any]) -> dict[str, Any]:
    """Run ``cmd`` as the method of ``w`` its name names, if ``commands``
    lists it; a kvmap error is the answer, not the worker's end."""
    op = cmd.get("cmd", "")
    if op not in commands:
        return {"ok": False, "code": "UNKNOWN_COMMAND", "message": str(op)}
    try:
        out: dict[str, Any] = getattr(w, op)(cmd)
    except KvmapError as err:
        return {"ok": False, "code": status_name(err), "message": err.message}
    return out


def handle(w: BenchWorker, cmd: dict[str, Any]) -> dict[str, Any]:
    return dispatch(w, COMMANDS, cmd)


def worker_main(
    prog: str, make: Callable[[str], Any], commands: Collection[str], argv: list[str] | None
) -> int:
    """A stand-in worker process: ``make(socket)`` served over JSON lines
    (``json_lines``), answering ``commands`` until told to exit."""
    p = argparse.ArgumentParser(prog=prog, allow_abbrev=False)
    p.add_argument("--socket", required=True)
    args = p.parse_args(argv)
    # Answers go to the original stdout; anything else a library writes to
    # fd 1 (NIXL and UCX log there) goes to stderr, the worker's log file.
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    w = make(args.socket)
    try:
        ready = {"ready": True, "pid": os.getpid()}
        json_lines.serve(ready, lambda cmd: dispatch(w, commands, cmd), answers)
    finally:
        w.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    return worker_main("kvmap-bench-worker", BenchWorker, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
