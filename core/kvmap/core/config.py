"""Daemon configuration: one frozen dataclass and the limits it implies.

``kvmap.daemon.adapters.config_files`` builds it from a TOML file and CLI flags
(flags win) and fills in defaults that depend on the environment; nothing
deeper in the daemon reads the environment."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

from kvmap.core.errors import ConfigError
from kvmap.core.peer_policy import LOOPBACK, PeerPolicy
from kvmap.core.planner import PLANNERS

DEFAULT_LISTEN = "127.0.0.1:50051"
# Largest message either listener accepts or sends (a full-scale registration
# with thousands of views is ~1 MB; a region map a few hundred KB).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# The local calls socket is the gRPC socket's path with this suffix
# (``kvmap.client`` finds it there).
LOCAL_CALLS_SUFFIX = ".calls"
# A region map must fit in one message with room for the agent metadata that
# GetAgentMetadata sends beside it.
MAX_REGION_MAP_BYTES = MAX_MESSAGE_BYTES - 2 * 1024 * 1024
DEFAULT_PLANNER = "coalesce"
LOG_LEVELS = ("debug", "info", "warning", "error")
# Workers one daemon serves: a pod's ranks (8 for TP-8) with ample room.
DEFAULT_MAX_WORKERS = 64
# Bytes of worker memory one daemon maps and registers: a TP-8 pod of
# full-scale ranks (about 111 GB of KV cache each, at most a 141 GB GPU's
# worth) is 0.9-1.1 TB; 2 TiB leaves room for a re-registration in flight.
DEFAULT_MAX_REGISTERED_BYTES = 2 * 1024**4
# Where shm_path registrations may point: POSIX shared memory (in the
# manifests, the pod's /dev/shm emptyDir that both containers mount).
DEFAULT_SHM_PATH_PREFIXES = ("/dev/shm",)
# UCX threads per agent (``nixl_threads``): two measured best on two cores
# (a pod's pulls on 2 cores at 1.8-2.5x of 1 core's rate with two, 1.5-1.6x
# with none, four no better); vLLM's NixlConnector runs 4.
DEFAULT_NIXL_THREADS = 2
MAX_NIXL_THREADS = 64


@dataclass(frozen=True)
class DaemonConfig:
    socket: str = ""
    listen: str = DEFAULT_LISTEN
    planner: str = DEFAULT_PLANNER
    state_dir: str = ""
    log_format: str = "console"
    log_level: str = "info"
    metrics_listen: str = ""
    # Unix socket for SCM_RIGHTS fd hand-off; "" means "<socket>.fds".
    fd_socket: str = ""
    # Also serve Pull, Push, Attach, GrantTransfer and RevokeTransfer on
    # "<socket>.calls" without gRPC (the client library uses it where it
    # exists: api/local_calls.py says why).
    local_calls: bool = True
    # Seconds SIGTERM waits for in-flight transfers before exiting.
    drain_seconds: float = 10.0
    # Default deadline of a transfer (handshake + post + completion).
    transfer_timeout_s: float = 30.0
    # How long a peer waits for a remote daemon's handshake before UNAVAILABLE.
    connect_timeout_s: float = 3.0
    # Seconds a TCP connection (UCX's and gRPC's) may stay silent before the
    # kernel probes its peer; a peer whose node or link is gone is cut
    # PROBES x 2 s later (adapters/tcp_keepalive.py). 0 leaves the sockets
    # as UCX and gRPC set them: UCX's accepted ones then never notice a
    # vanished peer and keep its fds.
    peer_keepalive_s: int = 10
    # UCX threads of the daemon's NIXL agent: a large transfer's descriptors
    # are posted and progressed by this many threads at once, so one daemon
    # moves a pod's pulls on more than one core (0: the NIXL thread alone).
    nixl_threads: int = DEFAULT_NIXL_THREADS
    # A pull's read waits for the owner to accept its BeginTransfer, so a
    # refused pull moves no byte. Off (opt-in), the read runs while the owner
    # checks, and the pull is DONE only once both are: the owner's round trip
    # leaves every pull's latency, but a refused pull's bytes may reach its
    # destination blocks (docs/security.md, "Reading while the owner
    # checks"). A push always waits: it writes the owner's memory.
    check_before_read: bool = True
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
    # Directories under which a registration's shm_path may name a file (no
    # links below them); empty: path registrations are refused.
    shm_path_prefix: tuple[str, ...] = DEFAULT_SHM_PATH_PREFIXES
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
    # A file holding the secret this daemon's peers share (a Kubernetes
    # Secret, the demo's runtime dir): without mutual TLS a TCP caller of
    # Peer and RegionMaps must present it besides an accepted address, and
    # this daemon presents it to its peers. With neither it nor mutual TLS,
    # every TCP caller is refused (a neighbour shares loopback).
    peer_secret_file: str = ""
    # OTLP/gRPC endpoint of trace export ("http://collector:4317"); "" is
    # tracing off. Unset, the standard OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or
    # OTEL_EXPORTER_OTLP_ENDPOINT stands in (config_files).
    otlp_traces_endpoint: str = ""
    # The file this config came from (SIGHUP re-reads it).
    config_file: str = ""
    # The keys given as flags: an error names the flag rather than the file.
    flag_keys: tuple[str, ...] = ()

    @property
    def socket_path(self) -> str:
        if not self.socket:
            raise ValueError("socket: no path (load_config fills in the default)")
        return self.socket

    @property
    def fd_socket_path(self) -> str:
        return self.fd_socket or self.socket_path + ".fds"

    @property
    def local_calls_socket_path(self) -> str:
        return self.socket_path + LOCAL_CALLS_SUFFIX

    @property
    def peer_policy(self) -> PeerPolicy:
        return PeerPolicy.parse(self.peer_accept, self.peer_allow, self.peer_identities)

    @property
    def mutual_tls(self) -> bool:
        """Clients of the TCP port must present a certificate."""
        return bool(self.tls_client_ca)

    def validated(self) -> DaemonConfig:
        check_types({f.name: getattr(self, f.name) for f in fields(self)})
        if self.log_format not in ("json", "console"):
            raise ConfigError("log_format", self.log_format, "must be json or console")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(
                "log_level", self.log_level, f"must be one of {', '.join(LOG_LEVELS)}"
            )
        if self.planner not in PLANNERS:
            known = ", ".join(sorted(PLANNERS))
            raise ConfigError("planner", self.planner, f"unknown planner (known: {known})")
        parse_host_port(self.listen, "listen")
        if self.metrics_listen:
            parse_host_port(self.metrics_listen, "metrics_listen")
        if self.otlp_traces_endpoint:
            _check_endpoint(self.otlp_traces_endpoint)
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key: give both or neither")
        if (self.tls_client_ca or self.peer_ca) and not self.tls_cert:
            raise ValueError("tls_client_ca/peer_ca need tls_cert and tls_key")
        if self.drain_seconds < 0:
            raise ConfigError("drain_seconds", self.drain_seconds, "must not be negative")
        for name in ("transfer_timeout_s", "connect_timeout_s", "restore_attach_grace_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, getattr(self, name), "must be positive")
        if isinstance(self.peer_keepalive_s, int) and not 0 <= self.peer_keepalive_s <= 3600:
            raise ConfigError("peer_keepalive_s", self.peer_keepalive_s, "must be 0 to 3600")
        self._validate_caps()
        return self._validated_peers()._validated_shm_prefixes()

    def _validated_shm_prefixes(self) -> DaemonConfig:
        prefixes = _strings("shm_path_prefix", self.shm_path_prefix)
        for prefix in prefixes:
            if not prefix.startswith("/"):
                raise ConfigError("shm_path_prefix", prefix, "must be an absolute path")
        return replace(self, shm_path_prefix=prefixes)

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
                raise ConfigError(name, value, "must be a positive integer")
        if not 0 <= self.nixl_threads <= MAX_NIXL_THREADS:
            raise ConfigError(
                "nixl_threads", self.nixl_threads, f"must be between 0 and {MAX_NIXL_THREADS}"
            )
        if self.attach_grace_s <= 0:
            raise ConfigError("attach_grace_s", self.attach_grace_s, "must be positive")


def _strings(name: str, values: object) -> tuple[str, ...]:
    # A TOML string where an array belongs would otherwise become its characters.
    if not isinstance(values, list | tuple) or not all(isinstance(v, str) for v in values):
        raise ValueError(f"{name}: expected a list of strings")
    return tuple(values)


def _check_endpoint(value: str) -> None:
    """An OTLP endpoint: HOST:PORT, after an optional http:// or https://."""
    scheme, sep, rest = value.partition("://")
    if sep and scheme not in ("http", "https"):
        raise ConfigError("otlp_traces_endpoint", value, "expected [http://|https://]HOST:PORT")
    parse_host_port((rest if sep else value).rstrip("/"), "otlp_traces_endpoint")


def parse_host_port(value: str, name: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(name, value, "expected HOST:PORT")
    return host.strip("[]"), int(port)


# Fields that are no configuration key: where the configuration came from.
INTERNAL_FIELDS = frozenset({"config_file", "flag_keys"})
# A key whose name differs from its field's (the flag is --peer-identity,
# repeatable like --peer-allow and --peer-accept).
KEY_OF_FIELD = {"peer_identities": "peer_identity"}
# Old spellings of keys, still accepted in the file with a deprecation line.
DEPRECATED_KEYS = {"peer_identities": "peer_identity"}
# Keys a SIGHUP applies to the running daemon; any other changed key is
# named in a log line as taking effect only at the next start.
RELOADABLE_KEYS = frozenset({"planner"})
# Keys whose values the effective-config log line and check-config hide.
SECRET_MARKERS = ("secret", "password", "token")
_EXPECTED: dict[str, tuple[type | tuple[type, ...], str]] = {
    "str": (str, "a string"),
    "float": ((int, float), "a number (seconds)"),
    "int": (int, "an integer"),
    "bool": (bool, "true or false"),
    "tuple[str, ...]": ((list, tuple), "a list of strings"),
}


def config_keys() -> dict[str, str]:
    """Every configuration key, in the dataclass's order, to its field's name."""
    return {
        KEY_OF_FIELD.get(f.name, f.name): f.name
        for f in fields(DaemonConfig)
        if f.name not in INTERNAL_FIELDS
    }


def field_type(name: str) -> str:
    """The field's annotation as written (``"float"``, ``"tuple[str, ...]"``)."""
    return str(next(f.type for f in fields(DaemonConfig) if f.name == name))


def check_types(values: Mapping[str, object]) -> None:
    """Raise ConfigError for the first field whose value has the wrong type
    (a TOML ``drain_seconds = "10s"``); ``values`` are keyed by field name."""
    for name, value in values.items():
        if name in INTERNAL_FIELDS:
            continue
        expected = _EXPECTED.get(field_type(name))
        if expected is None:
            continue
        types, words = expected
        wrong_bool = isinstance(value, bool) and types is not bool
        if wrong_bool or not isinstance(value, types):
            raise ConfigError(KEY_OF_FIELD.get(name, name), value, f"expected {words}")
        if isinstance(value, list | tuple) and not all(isinstance(v, str) for v in value):
            raise ConfigError(KEY_OF_FIELD.get(name, name), value, f"expected {words}")


def effective(config: DaemonConfig) -> dict[str, object]:
    """Every key and the value the daemon runs with, secrets hidden."""
    out: dict[str, object] = {}
    for key, name in config_keys().items():
        value = getattr(config, name)
        # A file's path is no secret; a value that is one is hidden.
        if value and any(m in key for m in SECRET_MARKERS) and not key.endswith("_file"):
            value = "(hidden)"
        out[key] = list(value) if isinstance(value, tuple) else value
    return out


def changed_keys(old: DaemonConfig, new: DaemonConfig) -> list[str]:
    """The keys whose values differ between two configurations."""
    return [k for k, n in config_keys().items() if getattr(old, n) != getattr(new, n)]


def exposure_warning(config: DaemonConfig) -> str:
    """Why a daemon listening beyond loopback would refuse every peer: its
    peer_accept admits loopback only (and no mutual TLS admits by
    certificate). "" when there is nothing to say."""
    host, _ = parse_host_port(config.listen, "listen")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return ""  # a host name: what it resolves to is the operator's to know
    if address.is_loopback or config.mutual_tls:
        return ""
    networks = [ipaddress.ip_network(n, strict=False) for n in config.peer_accept]
    if any(
        not (n.network_address.is_loopback and n.broadcast_address.is_loopback) for n in networks
    ):
        return ""
    return (
        f"listen {config.listen} reaches beyond loopback but peer_accept admits loopback "
        "only: every peer daemon on another host gets PERMISSION_DENIED; set peer_accept "
        "and peer_allow to the pod network (docs/security.md)"
    )
