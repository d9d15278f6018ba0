"""The daemon process: two gRPC servers (Unix socket for the local worker,
TCP for peers and operators), health, reflection, metrics, and shutdown.
The daemon's engine and adapters, and the locks it holds, are built by
``kvmap.daemon.bootstrap`` and handed in."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import os
import resource
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import structlog
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvmap.core.config import MAX_MESSAGE_BYTES, DaemonConfig
from kvmap.daemon.adapters.config_files import read_pem
from kvmap.daemon.adapters.peer_secret import peer_secret
from kvmap.daemon.adapters.socket_lock import PathLock
from kvmap.daemon.api.authorization import PeerAuthorization
from kvmap.daemon.api.health import ObservedHealth
from kvmap.daemon.api.limits import tcp_server_options
from kvmap.daemon.api.local_calls import LocalCallsServer, RegistryCalls
from kvmap.daemon.api.rpc import ErrorsAndContext
from kvmap.daemon.api.services import (
    PeerService,
    TransfersService,
    add_tcp_services,
    add_unix_services,
    attach_events,
    grant_transfer,
    revoke_transfer,
    tcp_service_names,
    unix_service_names,
)
from kvmap.daemon.engine.app import DaemonApp

log = structlog.get_logger("kvmapd")

# Health service names. "" is overall liveness; READINESS_SERVICE is SERVING
# only while the daemon accepts transfers (Kubernetes readiness probes it).
READINESS_SERVICE = "kvmap.v1.Peer"


class Daemon:
    def __init__(
        self, config: DaemonConfig, app: DaemonApp, locks: Sequence[PathLock] = ()
    ) -> None:
        """``app``: the engine over its adapters (``bootstrap.build_daemon``
        makes both); ``locks``: those held on the socket and the state
        directory, released when the daemon stops."""
        self.config = config
        self.app = app
        self.instance = app.instance
        self.metrics = app.metrics
        self._locks = list(locks)
        self.health = ObservedHealth(self.metrics.ready, READINESS_SERVICE)
        self._unix: aio.Server | None = None
        self._tcp: aio.Server | None = None
        self._local_calls: LocalCallsServer | None = None
        self._peer_service: PeerService | None = None
        self.tcp_port = 0
        self._marking: set[asyncio.Task[None]] = set()

    def _release_locks(self) -> None:
        for lock in self._locks:
            lock.release()

    def _new_server(
        self,
        listener: str,
        *inner: aio.ServerInterceptor[Any, Any],
        options: list[tuple[str, Any]] | None = None,
    ) -> aio.Server:
        return aio.server(
            # The first is outermost: statuses, logs and metrics cover the rest.
            interceptors=[
                ErrorsAndContext(self.metrics, listener, self.app.activity.failed),
                *inner,
            ],
            options=options
            or [
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
            ],
        )

    async def start(self) -> None:
        cfg = self.config
        sock = Path(cfg.socket_path)
        for stale in (sock, Path(cfg.fd_socket_path)):
            # A socket file left by a killed daemon would make bind fail.
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()
        # A listener that stops accepting (the fd hand-off's, short of fds
        # for good) would leave health SERVING while registrations hang.
        self.app.fds.on_listener_dead = self._listener_dead
        await self.app.start()

        self._unix = self._new_server("unix")
        add_unix_services(self._unix, self.app)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._unix)
        reflection.enable_server_reflection(unix_service_names(), self._unix)
        self._unix.add_insecure_port(f"unix:{sock}")

        # Only authorized peers reach Peer and RegionMaps on TCP (docs/security.md).
        secret = peer_secret(cfg)
        if secret is None and not cfg.mutual_tls:
            log.warning("peer_service_closed", reason="no peer_secret_file and no mutual TLS")
        # Strangers reach this port: every limit of api.limits applies.
        self._tcp = self._new_server(
            "tcp",
            PeerAuthorization(
                cfg.peer_policy,
                mutual_tls=cfg.mutual_tls,
                secret=secret,
                on_refused=self.app.activity.peer_refused,
            ),
            options=tcp_server_options(),
        )
        self._peer_service = add_tcp_services(self._tcp, self.app)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._tcp)
        reflection.enable_server_reflection(tcp_service_names(), self._tcp)
        self.tcp_port = _add_tcp_port(self._tcp, cfg)

        await self._unix.start()
        await self._tcp.start()
        # Only owner and group (the vLLM container shares the group) may
        # register memory or start transfers.
        os.chmod(sock, 0o660)
        if cfg.local_calls:
            await self._start_local_calls()
        for name in ("", READINESS_SERVICE, "kvmap.v1.RegionMaps"):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if cfg.metrics_listen:
            self.metrics.serve(cfg.metrics_listen)
        log.info(
            "kvmapd_ready",
            instance=self.instance,
            socket=str(sock),
            listen=cfg.listen,
            tcp_port=self.tcp_port,
            planner=cfg.planner,
            agent=self.app.agent_name,
            nixl_threads=self.app.nixl_threads,
            check_before_read=cfg.check_before_read,
        )

    async def _start_local_calls(self) -> None:
        """The local calls socket; without it (a path too long for a Unix
        socket, say) clients call over gRPC, so its failure is only logged."""
        server = LocalCallsServer(
            TransfersService(self.app),
            self.metrics,
            self.app.activity.failed,
            registry=RegistryCalls(
                attach=functools.partial(attach_events, self.app),
                grant=functools.partial(grant_transfer, self.app),
                revoke=functools.partial(revoke_transfer, self.app),
            ),
        )
        path = self.config.local_calls_socket_path
        try:
            await server.start(path)
        except OSError as err:
            log.warning("local_calls_off", socket=path, error=str(err))
            return
        self._local_calls = server

    def _listener_dead(self, err: BaseException) -> None:
        """A listener died (already logged at error): liveness and readiness
        turn NOT_SERVING, so that the daemon is restarted."""
        task = asyncio.get_running_loop().create_task(self._not_serving())
        self._marking.add(task)
        task.add_done_callback(self._marking.discard)

    async def _not_serving(self) -> None:
        for name in ("", READINESS_SERVICE, "kvmap.v1.RegionMaps"):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self) -> None:
        """Drain: stop accepting transfers, let in-flight ones finish (bounded
        by drain_seconds), then release every registration and exit."""
        await self.health.set(READINESS_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        self.app.draining = True
        await self.app.drain(self.config.drain_seconds)
        # Attach streams never end by themselves: without this, stopping
        # the servers would wait out the whole grace period for them.
        self.app.table.end_streams()
        # So do peers' BeginTransferStream calls (their next call reaches
        # whoever serves then).
        if self._peer_service is not None:
            self._peer_service.end_streams()
        if self._local_calls is not None:
            await self._local_calls.close()
        for server in (self._tcp, self._unix):
            if server is not None:
                await server.stop(grace=1.0)
        await self.app.close()
        cfg = self.config
        for path in (cfg.socket_path, cfg.fd_socket_path, cfg.local_calls_socket_path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._release_locks()
        log.info("kvmapd_stopped", instance=self.instance)


def write_ready_file(path: str, daemon: Daemon) -> None:
    """Tell a supervisor (tests, the demo) where the daemon listens."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(
            {
                "pid": os.getpid(),
                "tcp_port": daemon.tcp_port,
                "socket": daemon.config.socket_path,
                "instance": daemon.instance,
                "agent": daemon.app.agent_name,
            },
            f,
        )
    os.replace(tmp, path)


def freeze_startup_heap() -> int:
    """Move every object the daemon holds once started (modules, gRPC,
    NIXL, restored state) out of the collector's generations, for good.
    A full collection otherwise walks all of them, and under load one
    stalls the event loop for tens of milliseconds, on the pulls' path
    (one bench run's decode daemon ran three of ~50 ms each). Returns how
    many objects are frozen. No collection first: here it finds about ten
    unreachable objects and costs 25-35 ms, all of it before the ready
    file (measured over three starts); those few stay frozen."""
    gc.freeze()
    return gc.get_freeze_count()


def raise_fd_limit() -> dict[str, Any]:
    """Raise the soft RLIMIT_NOFILE to the hard limit (often 1,024 against
    a hard limit of 1M): connections, pending fds and NIXL all take
    descriptors, and running out makes accepts fail. Returns what happened,
    for the log once the daemon is up (a start-up error stays one line)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # An unlimited hard limit cannot be the soft one (the kernel's nr_open is).
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError) as err:
            return {"before": soft, "soft": soft, "hard": hard, "error": str(err)}
    return {"before": soft, "soft": target, "hard": hard}


def _add_tcp_port(server: grpc.aio.Server, cfg: DaemonConfig) -> int:
    """The TCP listener's port: TLS (mutual with a client CA) when configured."""
    if not cfg.tls_cert:
        return server.add_insecure_port(cfg.listen)
    client_ca = read_pem(cfg.tls_client_ca) if cfg.tls_client_ca else None
    creds = grpc.ssl_server_credentials(
        [(read_pem(cfg.tls_key), read_pem(cfg.tls_cert))],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )
    return server.add_secure_port(cfg.listen, creds)
