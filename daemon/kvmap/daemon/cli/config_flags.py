"""One flag per configuration key (``--drain-seconds`` for ``drain_seconds``),
made from ``DaemonConfig``'s fields so that no key exists only in the file;
each flag's help ends with the key's default."""

from __future__ import annotations

import argparse
from dataclasses import fields

from kvmap.core.config import LOG_LEVELS, DaemonConfig, config_keys, field_type
from kvmap.core.planner import PLANNERS

# What each key does; a key missing here still gets its flag and default.
KEY_HELP = {
    "socket": "gRPC Unix socket for the local workers",
    "listen": "TCP HOST:PORT for peers and operators",
    "planner": f"region planner: {' or '.join(sorted(PLANNERS))}",
    "state_dir": "directory of the state database; without one nothing survives a restart",
    "log_format": "json (one object a line, for containers) or console",
    "log_level": f"least severe level logged: {', '.join(LOG_LEVELS)}",
    "metrics_listen": "HOST:PORT for Prometheus /metrics; without it no metrics server",
    "fd_socket": "Unix socket of the SCM_RIGHTS fd hand-off",
    "local_calls": "also serve Pull, Push, Attach, GrantTransfer and RevokeTransfer on "
    "<socket>.calls without gRPC (the client library uses it where it exists)",
    "drain_seconds": "seconds SIGTERM waits for in-flight transfers",
    "transfer_timeout_s": "default deadline of a transfer, handshake to completion",
    "connect_timeout_s": "seconds to wait for a peer daemon's handshake before UNAVAILABLE",
    "peer_keepalive_s": "seconds a TCP connection to a peer may stay silent before the kernel "
    "probes it; a peer whose node or link is gone is cut 6 s later (0: off)",
    "nixl_threads": "UCX threads that post and progress a large transfer's descriptors at "
    "once (0: the daemon's one NIXL thread alone)",
    "check_before_read": "start a pull's read only once the owner accepted it; "
    "--no-check-before-read reads while the owner checks (faster; a refused pull's bytes "
    "may reach its destination blocks, never reported loaded)",
    "restore_attach_grace_s": "release a worker restored after a restart whose client has "
    "not attached by then",
    "attach_grace_s": "release a registration whose worker has not attached by then",
    "max_workers": "workers this daemon serves",
    "max_registered_bytes": "bytes of worker memory this daemon maps and registers",
    "shm_path_prefix": "a directory under which a registration's shm_path may name a file "
    "(repeatable; none: path registrations are refused)",
    "tls_cert": "PEM certificate for the TCP listener (and towards peers)",
    "tls_key": "PEM private key of --tls-cert",
    "tls_client_ca": "require client certificates signed by this CA (mutual TLS)",
    "peer_ca": "CA of peer daemons",
    "peer_allow": "a network or host name this daemon may dial (repeatable)",
    "peer_accept": "a network whose TCP clients may call Peer and RegionMaps without "
    "client certificates (repeatable)",
    "peer_identity": "a peer certificate identity (DNS name or spiffe:// URI) allowed under "
    "mutual TLS, both directions (repeatable; required with --tls-client-ca)",
    "peer_secret_file": "file with the secret peer daemons share (not readable by others); "
    "without it and without mutual TLS every TCP caller of Peer and RegionMaps is refused",
    "otlp_traces_endpoint": "OTLP/gRPC endpoint ([http://|https://]HOST:PORT) to export "
    "traces to; without one no traces",
}
# Defaults that depend on other keys or the environment, in words.
_DEFAULT_WORDS = {
    "socket": "$XDG_RUNTIME_DIR/kvmap/kvmapd.sock, else /tmp/kvmap-$UID/kvmapd.sock",
    "fd_socket": "<socket>.fds",
    "peer_ca": "the --tls-client-ca",
    "otlp_traces_endpoint": "$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else "
    "$OTEL_EXPORTER_OTLP_ENDPOINT, else none",
}
_TYPES = {"float": float, "int": int, "str": str}
_METAVARS = {
    "peer_allow": "CIDR_OR_HOST",
    "peer_accept": "CIDR",
    "peer_identity": "SAN",
    "shm_path_prefix": "DIR",
}


def add_config_flags(p: argparse.ArgumentParser) -> None:
    """A flag for every key (dest: the field's name; default None, so that
    the file's value stands unless the flag is given). A flag some other part
    of the CLI added already is left as it is."""
    defaults = {f.name: f.default for f in fields(DaemonConfig)}
    for key, name in config_keys().items():
        flag = "--" + key.replace("_", "-")
        # argparse has no public lookup of the flags a parser has.
        if flag in p._option_string_actions:
            continue
        kind = field_type(name)
        default = _DEFAULT_WORDS.get(key) or _shown(defaults[name])
        help_text = f"{KEY_HELP.get(key, key)} (default: {default})"
        # argparse expands % in help: the defaults may contain none.
        help_text = help_text.replace("%", "%%")
        if kind.startswith("tuple"):
            p.add_argument(
                flag, dest=name, action="append", metavar=_METAVARS.get(key), help=help_text
            )
        elif kind == "bool":
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            p.add_argument(flag, dest=name, type=_TYPES.get(kind, str), help=help_text)


def _shown(value: object) -> str:
    if isinstance(value, tuple):
        return ", ".join(value) if value else "none"
    if value == "":
        return "none"
    return str(value)
