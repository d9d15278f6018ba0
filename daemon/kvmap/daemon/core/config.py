"""Daemon configuration: one frozen dataclass and the limits it implies.

``kvmap.daemon.adapters.config_files`` builds it from a TOML file and CLI flags
(flags win) and fills in defaults that depend on the environment; nothing
deeper in the daemon reads the environment."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_LISTEN = "127.0.0.1:50051"
# Largest message either listener accepts or sends (a full-scale registration
# with thousands of views is ~1 MB; a region map a few hundred KB).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# A region map must fit in one message with room for the agent metadata that
# GetAgentMetadata sends beside it.
MAX_REGION_MAP_BYTES = MAX_MESSAGE_BYTES - 2 * 1024 * 1024
DEFAULT_PLANNER = "coalesce"


@dataclass(frozen=True)
class DaemonConfig:
    socket: str = ""
    listen: str = DEFAULT_LISTEN
    planner: str = DEFAULT_PLANNER
    state_dir: str = ""
    log_format: str = "console"
    metrics_listen: str = ""
    # Unix socket for SCM_RIGHTS fd hand-off; "" means "<socket>.fds".
    fd_socket: str = ""
    # Seconds SIGTERM waits for in-flight transfers before exiting.
    drain_seconds: float = 10.0
    # Default deadline of a transfer (handshake + post + completion).
    transfer_timeout_s: float = 30.0
    # How long a peer waits for a remote daemon's handshake before UNAVAILABLE.
    connect_timeout_s: float = 3.0
    # A worker restored from the state store whose client has not re-attached
    # by then is taken for dead and released.
    restore_attach_grace_s: float = 60.0
    # TLS on the TCP listener (PEM files). With tls_client_ca, clients must
    # present a certificate signed by it (mutual TLS). The same certificate
    # and key are this daemon's client identity towards its peers, whose
    # certificates are checked against peer_ca (default: tls_client_ca).
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    peer_ca: str = ""
    # The file this config came from (SIGHUP re-reads its planner).
    config_file: str = ""

    @property
    def socket_path(self) -> str:
        if not self.socket:
            raise ValueError("socket: no path (load_config fills in the default)")
        return self.socket

    @property
    def fd_socket_path(self) -> str:
        return self.fd_socket or self.socket_path + ".fds"

    def validated(self) -> DaemonConfig:
        if self.log_format not in ("json", "console"):
            raise ValueError(f"log_format: must be json or console, not {self.log_format!r}")
        parse_host_port(self.listen, "listen")
        if self.metrics_listen:
            parse_host_port(self.metrics_listen, "metrics_listen")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key: give both or neither")
        if (self.tls_client_ca or self.peer_ca) and not self.tls_cert:
            raise ValueError("tls_client_ca/peer_ca need tls_cert and tls_key")
        if self.drain_seconds < 0 or self.transfer_timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError(
                "drain_seconds, transfer_timeout_s, connect_timeout_s must be positive"
            )
        return self


def parse_host_port(value: str, name: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"{name}: expected HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)
