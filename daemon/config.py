"""Daemon configuration: one frozen dataclass, built from a TOML file and CLI
flags (flags win). Nothing deeper in the daemon reads the environment."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

DEFAULT_LISTEN = "127.0.0.1:50051"
# Largest message either listener accepts or sends (a full-scale registration
# with thousands of views is ~1 MB; a region map a few hundred KB).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# A region map must fit in one message with room for the agent metadata that
# GetAgentMetadata sends beside it.
MAX_REGION_MAP_BYTES = MAX_MESSAGE_BYTES - 2 * 1024 * 1024
DEFAULT_PLANNER = "coalesce"


def default_runtime_dir(uid: int | None = None) -> Path:
    """A per-user runtime directory: $XDG_RUNTIME_DIR/kvmap, else /tmp/kvmap-<uid>."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "kvmap"
    return Path(f"/tmp/kvmap-{os.getuid() if uid is None else uid}")


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
        return self.socket or str(default_runtime_dir() / "kvmapd.sock")

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


def load_config(path: str | None, overrides: dict[str, Any]) -> DaemonConfig:
    """Config file values, then every override that is not None."""
    known = {f.name for f in fields(DaemonConfig)}
    values: dict[str, Any] = {}
    if path:
        with open(path, "rb") as f:
            data = tomllib.load(f)
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"{path}: unknown keys {sorted(unknown)} (known: {sorted(known)})")
        values.update(data)
        values["config_file"] = path
    values.update({k: v for k, v in overrides.items() if v is not None and k in known})
    return replace(DaemonConfig(), **values).validated()


def read_pem(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
