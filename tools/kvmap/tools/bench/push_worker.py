"""The stand-in workers of ``kvmapd bench --push`` (``bench.push``): a
``bench.worker`` that also

- on the prefill side "computes" a request layer by layer (``compute``):
  each layer writes its pattern into the request's blocks of that layer's
  view and ends on a fixed schedule (``layer_ms`` per layer), as a GPU's
  forward pass would hand layers to ``save_kv_layer``; pushes wait on
  threads started beforehand, each released when the last layer of its
  layer group has been written (or after the last layer: a push at finish);
- on the decode side mints write grants (``grant_write``) and keeps the
  arrival time of every TransferFinished event (``arrivals``): the moment
  the decode worker hears that a push landed, when it could start.

Times are ``time.monotonic()``, one clock for every process of the machine,
so the prefill worker's end of its last layer and the decode worker's
arrival of an event are read on the same scale.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvmap.client.errors import status_name
from kvmap.core.errors import KvmapError
from kvmap.core.geometry import ViewSpec
from kvmap.tools.bench.worker import BenchWorker, Registered, Words, pattern, worker_main
from kvmap.v1 import registry_pb2, transfers_pb2, types_pb2

# How long a push may take before the daemon's answer is given up on.
PUSH_TIMEOUT_S = 120.0


@dataclass
class _Layer:
    """One layer of a prepared request: its view's words, the request's
    blocks in it and the pattern they get (computed beforehand, so that a
    layer's write is a copy, as a GPU's store of its KV would be)."""

    words: Words
    blocks: npt.NDArray[np.int64]
    pattern: Words

    def write(self) -> None:
        self.words[self.blocks] = self.pattern

    def zero(self) -> None:
        self.words[self.blocks] = 0


@dataclass
class _Push:
    """A push waiting for its layer group: released by ``go``; its answer
    and the times it was issued and done."""

    spec: transfers_pb2.TransferSpec
    go: threading.Event = field(default_factory=threading.Event)
    out: dict[str, Any] = field(default_factory=dict)


def _spec(cmd: dict[str, Any], reg: Registered, push: dict[str, Any]) -> transfers_pb2.TransferSpec:
    spec = transfers_pb2.TransferSpec(
        request_id=cmd["request_id"],
        local_worker=reg.worker,
        remote_target=cmd["remote_target"],
        remote_worker=types_pb2.WorkerId(engine_id=cmd["remote_engine_id"]),
        capability=cmd["capability"],
        readers=int(cmd["readers"]),
    )
    for g in push["groups"]:
        spec.groups.add(
            transfer_group=int(g["group"]),
            local_block_ids=g["local"],
            remote_block_ids=g["remote"],
            layer_names=g.get("layers", []),
        )
    return spec


class PushWorker(BenchWorker):
    def __init__(self, socket: str) -> None:
        super().__init__(socket)
        self._layers: list[_Layer] = []
        self._arrivals: dict[str, list[dict[str, Any]]] = {}
        self._arrived = threading.Condition()

    def _attach(self, reg: Registered) -> None:
        stream = self.client.attach(reg.worker)

        def run() -> None:
            try:
                for event in stream:
                    if event.HasField("transfer_finished"):
                        self._arrive(event.transfer_finished, time.monotonic())
            except KvmapError as err:
                with reg.lock:
                    reg.stream_errors.append(str(err))

        threading.Thread(target=run, daemon=True, name=f"attach-{reg.name}").start()

    def _arrive(self, event: registry_pb2.TransferFinishedEvent, at: float) -> None:
        seen = {
            "t": at,
            "direction": registry_pb2.TransferDirection.Name(event.direction),
            "uses": event.uses,
            "max_uses": event.max_uses,
            "exhausted": event.exhausted,
        }
        with self._arrived:
            self._arrivals.setdefault(event.request_id, []).append(seen)
            self._arrived.notify_all()

    def arrivals(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """The TransferFinished events of ``request_id`` once ``count`` have
        arrived (or ``timeout_s`` passed: then ``ok`` is false)."""
        rid, count = cmd["request_id"], int(cmd["count"])
        deadline = time.monotonic() + float(cmd.get("timeout_s", PUSH_TIMEOUT_S))
        with self._arrived:
            while len(self._arrivals.get(rid, [])) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    got = len(self._arrivals.get(rid, []))
                    return {"ok": False, "code": "NO_EVENT", "message": f"{got}/{count} events"}
                self._arrived.wait(left)
            return {"ok": True, "events": self._arrivals.pop(rid)}

    def grant_write(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Worker ``name`` (decode) lets a peer WRITE exactly ``groups`` for
        ``request_id``: an open grant, whose first push declares how many
        pushes use it (the connector's push offer)."""
        reg = self.workers[cmd["name"]]
        blocks = {int(g["group"]): [int(b) for b in g["blocks"]] for g in cmd["groups"]}
        grant = self.client.grant_transfer(
            reg.worker,
            cmd["request_id"],
            blocks,
            open_uses=True,
            access=registry_pb2.GRANT_ACCESS_WRITE,
        )
        return {"ok": True, "capability": grant.capability, "access": int(grant.access)}

    def prepare(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Worker ``name``'s request of ``groups`` ([{"group", "blocks"}]),
        layer by layer in compute order (the order of its views), with each
        layer's pattern computed now; replaces the one prepared before."""
        reg = self.workers[cmd["name"]]
        blocks = {int(g["group"]): np.asarray(g["blocks"], dtype=np.int64) for g in cmd["groups"]}
        self._layers = []
        for vi, view in enumerate(reg.geometry.views):
            if view.transfer_group in blocks:
                self._layers.append(self._layer(reg, vi, view, blocks[view.transfer_group]))
        return {"ok": True, "layers": len(self._layers)}

    @staticmethod
    def _layer(reg: Registered, vi: int, view: ViewSpec, blocks: npt.NDArray[np.int64]) -> _Layer:
        words = reg.words(view)
        return _Layer(words, blocks, pattern(vi, blocks, words.shape[1]))

    def wipe(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Zero the prepared request's blocks: a push that left before its
        layers were written carries zeros, which the decode side's check
        catches."""
        for layer in self._layers:
            layer.zero()
        return {"ok": True}

    def compute(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Write the prepared request's layers, one every ``layer_ms``; each
        of ``pushes`` ([{"after": layer index, "groups"}]) goes once layer
        ``after`` has ended, from a thread of its own, while the next layers
        compute. Answers the monotonic times of the first layer's start and
        the last layer's end, the layers that overran their time, and each
        push's answer with its issue and done times."""
        reg = self.workers[cmd["name"]]
        pushes = [(int(p["after"]), _Push(_spec(cmd, reg, p))) for p in cmd.get("pushes", [])]
        threads = [threading.Thread(target=self._push, args=(p,), daemon=True) for _, p in pushes]
        for t in threads:
            t.start()
        release: dict[int, list[_Push]] = {}
        for after, p in pushes:
            release.setdefault(after, []).append(p)
        start, end, overruns = self._paced(float(cmd["layer_ms"]) / 1000, release)
        for t in threads:
            t.join(PUSH_TIMEOUT_S + 10)
        return {
            "ok": all(p.out.get("ok") for _, p in pushes),
            "t_start": start,
            "t_end": end,
            "overruns": overruns,
            "pushes": [p.out for _, p in pushes],
        }

    def _paced(self, layer_s: float, release: dict[int, list[_Push]]) -> tuple[float, float, int]:
        """The layers on their schedule: layer i ends at start + (i+1) x
        ``layer_s`` (or when its write is done, if later: an overrun), and
        the pushes of ``release[i]`` go then. Sleeping, not spinning: a GPU's
        forward pass leaves the host's cores to the daemons."""
        start = time.monotonic()
        overruns = 0
        end = start
        for i, layer in enumerate(self._layers):
            layer.write()
            left = start + (i + 1) * layer_s - time.monotonic()
            if left > 0:
                time.sleep(left)
            else:
                overruns += 1
            end = time.monotonic()
            for p in release.get(i, []):
                p.go.set()
        return start, end, overruns

    def _push(self, p: _Push) -> None:
        if not p.go.wait(PUSH_TIMEOUT_S):
            p.out = {"ok": False, "code": "NOT_RELEASED", "message": "the layer never came"}
            return
        issued = time.monotonic()
        try:
            result = self.client.push(p.spec, timeout_s=PUSH_TIMEOUT_S)
        except KvmapError as err:
            p.out = {"ok": False, "code": status_name(err), "message": err.message}
            return
        done = time.monotonic()
        p.out = {"ok": True, "t_issued": issued, "t_done": done, "stats": dict(result.__dict__)}


COMMANDS = (
    "register",
    "deregister",
    "zero",
    "verify",
    "grant",
    "pull",
    "arrivals",
    "grant_write",
    "prepare",
    "wipe",
    "compute",
)


def main(argv: list[str] | None = None) -> int:
    # What NIXL and UCX print goes to the worker's log, as bench.worker's.
    return worker_main("kvmap-bench-push-worker", PushWorker, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
