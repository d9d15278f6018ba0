"""Daemon configuration: one frozen dataclass and the limits it implies.

``kvmap.daemon.adapters.config_files`` builds it from a TOML file and CLI flags
(flags win) and fills in defaults that depend on the environment; nothing
deeper in the daemon reads the environment."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvmap.core.peer_policy import LOOPBACK, PeerPolicy

DEFAULT_LISTEN = "127.0.0.1:50051"
# Largest message either listener accepts or sends (a full-scale registration
# with thousands of views is ~1 MB; a region map a few hundred KB).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# A region map must fit in one message with room for the agent metadata that
# GetAgentMetadata sends beside it.
MAX_REGION_MAP_BYTES = MAX_MESSAGE_BYTES - 2 * 1024 * 1024
DEFAULT_PLANNER = "coalesce"
# Workers one daemon serves: a pod's ranks (8 for TP-8) with ample room.
DEFAULT_MAX_WORKERS = 64
# Bytes of worker memory one daemon maps and registers: a TP-8 pod of
# full-scale ranks (about 111 GB of KV cache each, at most a 141 GB GPU's
# worth) is 0.9-1.1 TB; 2 TiB leaves room for a re-registration in flight.
DEFAULT_MAX_REGISTERED_BYTES = 2 * 1024**4


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
    # A registration whose worker has not opened an Attach stream by then is
    # taken for abandoned and released (clients attach right after they
    # register; raw RegisterWorker callers must attach too).
    attach_grace_s: float = 600.0
    # Caps checked before a registration maps anything (RESOURCE_EXHAUSTED).
    max_workers: int = DEFAULT_MAX_WORKERS
    max_registered_bytes: int = DEFAULT_MAX_REGISTERED_BYTES
    # TLS on the TCP listener (PEM files). With tls_client_ca, clients must
    # present a certificate signed by it (mutual TLS). The same certificate
    # and key are this daemon's client identity towards its peers, whose
    # certificates are checked against peer_ca (default: tls_client_ca).
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    peer_ca: str = ""
    # Data-plane allow-lists (docs/security.md). peer_allow: CIDRs and host
    # names this daemon may dial. peer_accept: CIDRs whose TCP clients may call
    # Peer and RegionMaps when there are no client certificates. peer_identities:
    # certificate SANs (DNS names, spiffe:// URIs) of peers under mutual TLS,
    # both directions; required with tls_client_ca.
    peer_allow: tuple[str, ...] = LOOPBACK
    peer_accept: tuple[str, ...] = LOOPBACK
    peer_identities: tuple[str, ...] = ()
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

    @property
    def peer_policy(self) -> PeerPolicy:
        return PeerPolicy.parse(self.peer_accept, self.peer_allow, self.peer_identities)

    @property
    def mutual_tls(self) -> bool:
        """Clients of the TCP port must present a certificate."""
        return bool(self.tls_client_ca)

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
        self._validate_caps()
        return self._validated_peers()

    def _validated_peers(self) -> DaemonConfig:
        # TOML arrays and repeated flags arrive as lists: keep the config frozen.
        config = replace(
            self,
            peer_allow=_strings("peer_allow", self.peer_allow),
            peer_accept=_strings("peer_accept", self.peer_accept),
            peer_identities=_strings("peer_identities", self.peer_identities),
        )
        config.peer_policy  # noqa: B018 -- parses every entry; raises on a bad one
        if self.peer_identities and not self.tls_cert:
            raise ValueError("peer_identities need tls_cert and tls_key (mutual TLS)")
        if self.mutual_tls and not self.peer_identities:
            # Any certificate from the CA is not an authorization: say whom.
            raise ValueError(
                "tls_client_ca needs peer_identities: the certificate identities "
                "(DNS names or spiffe:// URIs) allowed to call this daemon"
            )
        return config

    def _validate_caps(self) -> None:
        for name in ("max_workers", "max_registered_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, not {value!r}")
        if self.attach_grace_s <= 0:
            raise ValueError(f"attach_grace_s: must be positive, not {self.attach_grace_s!r}")


def _strings(name: str, values: object) -> tuple[str, ...]:
    # A TOML string where an array belongs would otherwise become its characters.
    if not isinstance(values, list | tuple) or not all(isinstance(v, str) for v in values):
        raise ValueError(f"{name}: expected a list of strings")
    return tuple(values)


def parse_host_port(value: str, name: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"{name}: expected HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)
