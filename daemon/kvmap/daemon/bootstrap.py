"""The daemon's composition root: the one module that builds its adapters
(the locks on the socket and the state directory, the state store, the fd
hand-off server, the NIXL thread and how the agent is made, the peer
client, the memory importers, the keepalive sweeper, the metrics, the
tracer) and wires them into the engine (``engine.app.DaemonApp``, through
``engine.app.Adapters``) and the api (``api.server.Daemon``). ``serve``
runs a daemon built here until a signal (``kvmapd serve``); the tests build
their daemons here too, with the fake NIXL or in-process peers in place of
the real ones.

A layer of its own, between the cli and the api (``daemon-layers`` in
pyproject.toml); ``tests/repo/test_composition_root.py`` checks that no
other module of the daemon above the adapters builds one."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import Callable
from functools import partial

import structlog

from kvmap.core.config import DaemonConfig
from kvmap.daemon.adapters.config_files import reload_config
from kvmap.daemon.adapters.cuda_ipc import CudaIpcImporter
from kvmap.daemon.adapters.fd_handoff import FdHandoffServer
from kvmap.daemon.adapters.memory import ShmImporter
from kvmap.daemon.adapters.metrics import Metrics
from kvmap.daemon.adapters.nixl_agent import NixlAgent
from kvmap.daemon.adapters.nixl_port import AgentFactory
from kvmap.daemon.adapters.nixl_thread import NixlThread
from kvmap.daemon.adapters.peer_client import PeerClient
from kvmap.daemon.adapters.socket_lock import PathLock, SocketLock, StateDirLock
from kvmap.daemon.adapters.state_store import StateStore
from kvmap.daemon.adapters.tcp_keepalive import HalfOpenGuard, Keepalive
from kvmap.daemon.api.server import Daemon, freeze_startup_heap, raise_fd_limit, write_ready_file
from kvmap.daemon.engine.app import Adapters, DaemonApp
from kvmap.daemon.engine.pacing import Pacing
from kvmap.daemon.engine.transfers import Peers
from kvmap.tracing import tracer_for

log = structlog.get_logger("kvmapd")


def build_adapters(
    config: DaemonConfig,
    instance: str = "",
    *,
    metrics: Metrics | None = None,
    create_agent: AgentFactory | None = None,
    peers: Peers | None = None,
    shm: ShmImporter | None = None,
    cuda: CudaIpcImporter | None = None,
    pacing: Pacing | None = None,
) -> Adapters:
    """One daemon's adapters for ``config``, its spans exported as daemon
    ``instance`` (when an endpoint is configured). Each argument given
    replaces the real adapter (the engine's tests: the fake NIXL's agents,
    in-process peers, a CUDA driver that is not there, a virtual clock)."""
    return Adapters(
        create_agent=(
            partial(NixlAgent.create, threads=config.nixl_threads)
            if create_agent is None
            else create_agent
        ),
        peers=PeerClient.for_config(config) if peers is None else peers,
        shm=ShmImporter(config.shm_path_prefix) if shm is None else shm,
        cuda=CudaIpcImporter() if cuda is None else cuda,
        tracer=tracer_for(config.otlp_traces_endpoint, "kvmapd", instance),
        nixl=NixlThread(),
        fds=FdHandoffServer(config.fd_socket_path),
        store=StateStore(config.state_dir),
        metrics=Metrics() if metrics is None else metrics,
        reload_config=reload_config,
        half_open=(
            HalfOpenGuard(Keepalive(config.peer_keepalive_s))
            if config.peer_keepalive_s > 0
            else None
        ),
        pacing=Pacing() if pacing is None else pacing,
    )


def build_daemon(
    config: DaemonConfig,
    *,
    metrics: Metrics | None = None,
    create_agent: AgentFactory | None = None,
) -> Daemon:
    """A daemon for ``config``, not started yet (``Daemon.start``);
    ``create_agent`` replaces NIXL's (the in-process tests' fake)."""
    # First: the state store and the stale-socket clean-up are this
    # socket's owner's; a second daemon is refused before it touches
    # either (SocketInUse names the path and the PID holding it).
    # The socket's directory is made (0770) or checked safe first; the
    # state directory is locked too (StateDirInUse), so two daemons never
    # share one store.
    locks: list[PathLock] = [SocketLock(config.socket_path)]
    if config.state_dir:
        locks.append(StateDirLock(config.state_dir))
    instance = uuid.uuid4().hex[:12]
    try:
        for lock in locks:
            lock.acquire()
        adapters = build_adapters(config, instance, metrics=metrics, create_agent=create_agent)
        app = DaemonApp(config, instance, adapters)
    except BaseException:
        for lock in locks:  # a daemon in this process may try again
            lock.release()
        raise
    return Daemon(config, app, locks)


async def serve(
    config: DaemonConfig,
    ready_file: str | None = None,
    on_started: Callable[[], None] = lambda: None,
) -> int:
    """Run the daemon until SIGTERM or SIGINT; ``on_started`` runs once it
    serves, before the ready file is written (a failed start never gets
    there: its one line stays the only one)."""
    # Sockets are born owner/group-only (no window before the chmod of
    # Daemon.start); "other" never gets access to anything the daemon creates.
    os.umask(0o007)
    fd_limit = raise_fd_limit()
    daemon = build_daemon(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    await daemon.start()
    (log.warning if "error" in fd_limit else log.info)("fd_limit", **fd_limit)
    # After start: creating the NIXL/UCX agent may install handlers of its own.
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, daemon.app.request_replan)
    freeze_startup_heap()
    on_started()
    if ready_file:
        write_ready_file(ready_file, daemon)
    await stop.wait()
    log.info("kvmapd_stopping")
    await daemon.stop()
    return 0
