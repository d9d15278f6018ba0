"""What the daemon checks before it creates anything: that its PEM files
are readable and hold what their keys say, and that its TCP ports are free.
A mistake here is one ConfigError naming the key and its value, and the
daemon exits 2 without leaving a socket file, a lock or a log of its own
behind; gRPC and the metrics server would otherwise fail halfway through
start-up, with a traceback that blames the wrong thing (a garbage
certificate makes gRPC report the port as unusable)."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import ssl

from kvmap.core.config import DaemonConfig, parse_host_port
from kvmap.core.errors import ConfigError
from kvmap.daemon.adapters.peer_secret import peer_secret

# sun_path holds 108 bytes, the terminating NUL included.
MAX_UNIX_PATH_BYTES = 107


def check_files(config: DaemonConfig) -> None:
    """Raise ConfigError for the first PEM file that is unreadable or does
    not hold what its key says (``kvmapd check-config`` stops here)."""
    for key in ("tls_cert", "tls_key", "tls_client_ca", "peer_ca"):
        path = getattr(config, key)
        if path:
            _check_readable(key, path)
    if config.tls_cert:
        _check_key_pair(config.tls_cert, config.tls_key)
    for key in ("tls_client_ca", "peer_ca"):
        if getattr(config, key):
            _check_ca(key, getattr(config, key))
    peer_secret(config)  # readable, owner and group only, long enough


def check_socket_paths(config: DaemonConfig) -> None:
    """Raise ConfigError when a Unix socket could not be made where the key
    says: a path too long for a socket address, or a directory that neither
    exists nor can be made (the daemon makes the last level only)."""
    for key, path in (("socket", config.socket_path), ("fd_socket", config.fd_socket_path)):
        if len(os.fsencode(path)) > MAX_UNIX_PATH_BYTES:
            raise ConfigError(
                key, path, f"longer than {MAX_UNIX_PATH_BYTES} bytes, the most a socket path holds"
            )
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(directory) and not os.path.isdir(os.path.dirname(directory)):
            raise ConfigError(key, path, f"neither {directory} nor its parent directory exists")


def check_state_dir(config: DaemonConfig) -> None:
    """Raise ConfigError when state_dir names something that is no directory
    (one the daemon cannot use otherwise fails when the store opens it)."""
    path = config.state_dir
    if path and os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError("state_dir", path, "not a directory")


def check_ports(config: DaemonConfig) -> None:
    """Raise ConfigError when a TCP address the daemon listens on is taken
    or not this host's (not in check-config: the running daemon holds them)."""
    _check_free("listen", config.listen)
    if config.metrics_listen:
        _check_free("metrics_listen", config.metrics_listen)


def _check_readable(key: str, path: str) -> None:
    try:
        with open(path, "rb"):
            pass
    except OSError as err:
        raise ConfigError(key, path, f"cannot read it: {err.strerror}") from None


def _check_key_pair(cert: str, key: str) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # No password prompt: gRPC cannot use an encrypted key either.
        context.load_cert_chain(cert, key, password=lambda: b"")
    except ssl.SSLError as err:
        raise ConfigError(
            "tls_cert",
            cert,
            f"not a PEM certificate whose unencrypted private key is tls_key {key!r} "
            f"({err.reason or err.strerror or err})",
        ) from None


def _check_ca(key: str, path: str) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_verify_locations(cafile=path)
    except ssl.SSLError as err:
        raise ConfigError(
            key, path, f"not a PEM CA certificate ({err.reason or err.strerror or err})"
        ) from None


def _check_free(key: str, listen: str) -> None:
    """Bind the address once, as gRPC will (SO_REUSEADDR, no SO_REUSEPORT):
    a port another process listens on, or an address this host lacks, fails
    here with its reason instead of deep inside gRPC."""
    host, port = parse_host_port(listen, key)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise ConfigError(key, listen, f"cannot resolve {host!r}: {err.strerror}") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                # As gRPC's own listener: "::" also covers IPv4.
                with contextlib.suppress(OSError):
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            try:
                probe.bind(address)
            except OSError as err:
                raise ConfigError(key, listen, _bind_problem(err)) from None


def _bind_problem(err: OSError) -> str:
    if err.errno == errno.EADDRINUSE:
        return "the port is in use by another process"
    if err.errno == errno.EADDRNOTAVAIL:
        return "this host has no such address"
    if err.errno == errno.EACCES:
        return "not allowed to bind that port (below 1024?)"
    return f"cannot bind it: {err.strerror}"
