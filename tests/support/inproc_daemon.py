"""kvmapd in the test's own process: the real ``Daemon`` (api, engine,
interceptors, peer authorization, health) on a Unix socket in a temporary
folder and on 127.0.0.1, with NIXL replaced by the fake of ``fake_nixl``.

Everything else is what ``kvmapd serve`` runs: workers reach their daemon
with ``KvmapdTransport`` over its sockets (gRPC, the fd hand-off and the
local calls sockets), the daemon maps their shared memory, pulls between two
daemons go through the real Peer RPCs over TCP, and the fake agents copy the
bytes between the mapped addresses. Each daemon keeps a state folder, so a restart keeps the
generation counters and the workers' pending events, as ``--state-dir``
does in a pod.

Use it where a test is about what the daemon answers, not about processes
(signals, exit codes, a crashed process): it starts in milliseconds and
needs no NIXL. All daemons of the process share one event loop, on a
thread of its own, so the synchronous client and the connector call them
as a worker would.

Failures are injected on the workers' connections (``InprocTransport``):
``InprocDaemon.pull_hook`` runs before every pull or push a connection
sends to the running daemon (it may sleep, or raise a ``KvmapError`` as a
failed call would), ``InprocDaemon.listed_features`` makes the connections report fewer
features (an older kvmapd), ``InprocDaemon.break_attach_streams`` drops the
workers' Attach streams.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from fake_nixl import FakeNetwork

from kvmap.client.client import KvmapClient
from kvmap.client.transports.kvmapd import KvmapdTransport
from kvmap.core.config import DaemonConfig
from kvmap.core.errors import Unavailable
from kvmap.core.geometry import WorkerKey
from kvmap.daemon.api.server import Daemon
from kvmap.daemon.bootstrap import build_daemon
from kvmap.tools.peers import new_peer_secret
from kvmap.v1 import admin_pb2, region_maps_pb2, registry_pb2, transfers_pb2, types_pb2

T = TypeVar("T")
# (engine_id, dp_rank, tp_rank, pp_rank): how tests name a worker.
WorkerTuple = tuple[str, int, int, int]
PullHook = Callable[[transfers_pb2.TransferSpec], None]
Features = tuple[registry_pb2.DaemonFeature.ValueType, ...]
CALL_S = 15.0  # deadline of the helpers' own calls


class _LoopThread:
    """One event loop on a daemon thread, serving every in-process kvmapd
    (gRPC's asyncio servers of one process share a loop best)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="inproc-kvmapd", daemon=True).start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run ``coro`` on the loop; wait for its result here."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


_loop: _LoopThread | None = None
_loop_lock = threading.Lock()


def daemon_loop() -> _LoopThread:
    global _loop  # noqa: PLW0603 -- one loop for the process, started when first needed
    with _loop_lock:
        if _loop is None:
            _loop = _LoopThread()
        return _loop


class _BreakableStream:
    """An Attach stream that ``break_`` ends with UNAVAILABLE, as a dropped
    connection does; the worker hears of it once ``released`` is set (the
    daemon has seen the stream end by then)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.broken = False
        self.released = threading.Event()

    def __iter__(self) -> Iterator[registry_pb2.AttachResponse]:
        yield from self._inner
        if self.broken:
            self.released.wait(CALL_S)
            raise Unavailable("UNAVAILABLE: the connection to kvmapd broke")

    def cancel(self) -> None:
        self._inner.cancel()

    def break_(self) -> None:
        self.broken = True
        self._inner.cancel()


class InprocTransport(KvmapdTransport):
    """A worker's connection to an in-process kvmapd: ``KvmapdTransport`` over
    its sockets, with the daemon handle's failure injection."""

    def __init__(self, daemon: InprocDaemon) -> None:
        super().__init__(daemon.socket)
        self.daemon = daemon
        daemon.transports.append(self)  # closed with the daemon

    def register_worker(
        self, req: registry_pb2.RegisterWorkerRequest, timeout: float
    ) -> registry_pb2.RegisterWorkerResponse:
        resp = super().register_worker(req, timeout)
        if self.daemon.listed_features is not None:
            del resp.features[:]
            resp.features.extend(self.daemon.listed_features)
        return resp

    def attach(self, req: registry_pb2.AttachRequest) -> _BreakableStream:
        stream = _BreakableStream(super().attach(req))
        self.daemon.streams.append(stream)
        return stream

    def pull(
        self, spec: transfers_pb2.TransferSpec, timeout: float
    ) -> Iterator[transfers_pb2.PullResponse]:
        self._hook(spec)
        return super().pull(spec, timeout)

    def push(
        self, spec: transfers_pb2.TransferSpec, timeout: float
    ) -> Iterator[transfers_pb2.PushResponse]:
        self._hook(spec)
        return super().push(spec, timeout)

    def _hook(self, spec: transfers_pb2.TransferSpec) -> None:
        # Only calls that reach a daemon: a stopped one fails them by itself.
        hook = self.daemon.pull_hook
        if hook is not None and self.daemon.running:
            hook(spec)


class InprocDaemon:
    """One kvmapd of an ``InprocNetwork``; ``target`` is its TCP address
    (what peers and the connector's ``peer_address`` name), ``socket`` the
    workers' Unix socket. Both stay the same across ``restart``."""

    def __init__(self, nixl: FakeNetwork, folder: str, planner: str, **config: Any) -> None:
        self._nixl = nixl
        self.socket = f"{folder}/kvmapd.sock"
        self._config = DaemonConfig(
            socket=self.socket,
            listen="127.0.0.1:0",
            planner=planner,
            state_dir=f"{folder}/state",
            # A test that failed halfway must not wait long for its transfers.
            drain_seconds=1.0,
            **config,
        )
        self._daemon: Daemon | None = None
        self.pull_hook: PullHook | None = None
        self.listed_features: Features | None = None
        self.streams: list[_BreakableStream] = []
        self.transports: list[KvmapdTransport] = []
        self.start()
        self.target = self._config.listen

    # Lifecycle ------------------------------------------------------------

    def start(self) -> None:
        """Serve (again, on the same socket and port)."""
        assert self._daemon is None, "already running"
        self._daemon = daemon_loop().run(self._serve())
        # Later starts take the same port: peers and params still name it.
        self._config = dataclasses.replace(
            self._config, listen=f"127.0.0.1:{self._daemon.tcp_port}"
        )

    async def _serve(self) -> Daemon:
        # As kvmapd serve builds it (bootstrap), with the fake NIXL's agents.
        daemon = build_daemon(self._config, create_agent=self._nixl.agent)
        await daemon.start()
        return daemon

    def stop(self) -> None:
        """Stop as on SIGTERM (drain, then close): calls fail UNAVAILABLE and
        the Attach streams end. No-op when stopped."""
        daemon, self._daemon = self._daemon, None
        if daemon is not None:
            daemon_loop().run(daemon.stop())

    def restart(self, forget_state: bool = False) -> None:
        """A new instance on the same socket, port and state folder. It
        restores the workers whose memory it can open again (all of them in
        this process); with ``forget_state`` it starts with an empty folder
        instead, as a daemon that lost its state: it knows no worker and
        numbers generations from 1 again."""
        self.stop()
        if forget_state:
            shutil.rmtree(self._config.state_dir, ignore_errors=True)
        self.start()

    def close(self) -> None:
        self.stop()
        for t in self.transports:
            t.close()

    @property
    def running(self) -> bool:
        return self._daemon is not None

    @property
    def instance(self) -> str:
        return self._running().instance

    @property
    def agent_name(self) -> str:
        return self._running().app.agent_name

    def _running(self) -> Daemon:
        assert self._daemon is not None, "the daemon is stopped"
        return self._daemon

    # Connections ------------------------------------------------------------

    def transport(self) -> InprocTransport:
        """A new worker connection (closed with the network)."""
        return InprocTransport(self)

    def client(self) -> KvmapClient:
        return KvmapClient(self.transport())

    def get_stats(self) -> admin_pb2.GetStatsResponse:
        return self.transport().get_stats(CALL_S)

    def get_region_map(self, worker: types_pb2.WorkerId) -> types_pb2.RegionMap:
        req = region_maps_pb2.GetRegionMapRequest(worker=worker)
        return self.transport().get_region_map(req, CALL_S).region_map

    # The daemon's state, read on its loop ------------------------------------

    def _read(self, read: Callable[[Daemon], T], stopped: T) -> T:
        daemon = self._daemon
        if daemon is None:
            return stopped

        async def on_loop() -> T:
            return read(daemon)

        return daemon_loop().run(on_loop())

    def workers(self) -> list[WorkerTuple]:
        """The registered workers, sorted ([] while stopped)."""
        return self._read(lambda d: sorted(_tuple(r.key) for r in d.app.table.records()), [])

    def generation(self, key: WorkerTuple) -> int:
        return self._read(lambda d: d.app.table.get(WorkerKey(*key)).generation, 0)

    def subscriber_count(self, key: WorkerTuple) -> int:
        """Attach streams the daemon has open for the worker."""
        return self._read(lambda d: d.app.table.subscriber_count(WorkerKey(*key)), 0)

    # Failures ------------------------------------------------------------------

    def break_attach_streams(self, keys: Sequence[WorkerTuple]) -> None:
        """Drop every Attach stream of this daemon's connections, as a broken
        connection does; once the daemon has released the ``keys`` (workers
        with no stream left are gone), the workers hear UNAVAILABLE."""
        broken = [s for s in self.streams if not s.broken]
        for s in broken:
            s.break_()
        deadline = time.monotonic() + CALL_S
        while set(keys) & set(self.workers()):
            assert time.monotonic() < deadline, "the daemon kept workers without a stream"
            time.sleep(0.01)
        for s in broken:
            s.released.set()


def _tuple(key: WorkerKey) -> WorkerTuple:
    return (key.engine_id, key.dp_rank, key.tp_rank, key.pp_rank)


class InprocNetwork:
    """In-process kvmapds that reach each other over 127.0.0.1 and share one
    fake NIXL network; closing it stops them and removes their folders."""

    def __init__(self) -> None:
        self.nixl = FakeNetwork()
        # Short: a Unix socket path has a 108-byte limit.
        self._root = tempfile.mkdtemp(prefix="kvm-")
        self.daemons: list[InprocDaemon] = []
        # The peer secret its daemons share (without one, or mutual TLS, a
        # daemon answers no TCP peer).
        self.peer_secret_file = str(new_peer_secret(Path(self._root)))

    def daemon(self, planner: str = "baseline", **config: Any) -> InprocDaemon:
        """A new running kvmapd planning with ``planner``; ``config`` sets
        other ``DaemonConfig`` fields."""
        folder = tempfile.mkdtemp(dir=self._root)
        config.setdefault("peer_secret_file", self.peer_secret_file)
        d = InprocDaemon(self.nixl, folder, planner, **config)
        self.daemons.append(d)
        return d

    def close(self) -> None:
        try:
            for d in self.daemons:
                d.close()
        finally:
            shutil.rmtree(self._root, ignore_errors=True)

    def __enter__(self) -> InprocNetwork:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
