"""``kvmapd``: the daemon and its subcommands."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import sys
from collections.abc import Sequence

from kvmap.daemon.adapters.config_files import load_config
from kvmap.daemon.adapters.logs import configure_logging
from kvmap.daemon.adapters.socket_lock import SocketInUse
from kvmap.daemon.cli import plan_cmd


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the daemon")
    p.add_argument("--config", help="TOML file; keys are the long flag names with underscores")
    p.add_argument("--socket", help="gRPC Unix socket for the local workers")
    p.add_argument(
        "--listen", help="TCP HOST:PORT for peers and operators (default 127.0.0.1:50051)"
    )
    p.add_argument("--planner", help="region planner: coalesce (default) or baseline")
    p.add_argument("--state-dir", dest="state_dir", help="directory of the state database")
    p.add_argument("--log-format", dest="log_format", choices=["json", "console"])
    p.add_argument("--metrics-listen", dest="metrics_listen", help="HOST:PORT for /metrics")
    p.add_argument(
        "--fd-socket", dest="fd_socket", help="fd hand-off socket (default <socket>.fds)"
    )
    p.add_argument("--drain-seconds", dest="drain_seconds", type=float)
    p.add_argument("--ready-file", dest="ready_file", help="write a JSON line here once serving")
    _add_security_flags(p)
    _add_limit_flags(p)


def _add_security_flags(p: argparse.ArgumentParser) -> None:
    """TLS and who may talk to this daemon (docs/security.md)."""
    p.add_argument("--tls-cert", dest="tls_cert", help="PEM certificate for the TCP listener")
    p.add_argument("--tls-key", dest="tls_key", help="PEM private key for the TCP listener")
    p.add_argument(
        "--tls-client-ca",
        dest="tls_client_ca",
        help="require client certificates signed by this CA",
    )
    p.add_argument(
        "--peer-ca", dest="peer_ca", help="CA of peer daemons (default: --tls-client-ca)"
    )
    p.add_argument(
        "--peer-allow",
        dest="peer_allow",
        action="append",
        metavar="CIDR_OR_HOST",
        help="a network or host name this daemon may dial (repeatable; default loopback only)",
    )
    p.add_argument(
        "--peer-accept",
        dest="peer_accept",
        action="append",
        metavar="CIDR",
        help="a network whose TCP clients may call Peer and RegionMaps without client "
        "certificates (repeatable; default loopback only)",
    )
    p.add_argument(
        "--peer-identity",
        dest="peer_identities",
        action="append",
        metavar="SAN",
        help="a peer certificate identity (DNS name or spiffe:// URI) allowed under mutual "
        "TLS, both directions (repeatable; required with --tls-client-ca)",
    )


def _add_limit_flags(p: argparse.ArgumentParser) -> None:
    """Caps on what workers may register."""
    p.add_argument(
        "--max-workers", dest="max_workers", type=int, help="workers this daemon serves (64)"
    )
    p.add_argument(
        "--max-registered-bytes",
        dest="max_registered_bytes",
        type=int,
        help="bytes of worker memory this daemon maps and registers (2 TiB)",
    )
    p.add_argument(
        "--attach-grace-s",
        dest="attach_grace_s",
        type=float,
        help="release a registration whose worker has not attached by then (600)",
    )


def _serve(args: argparse.Namespace) -> int:
    # Lazy: the server imports nixl, which `kvmapd plan` must not need.
    from kvmap.daemon.adapters.state_store import StateStoreError  # noqa: PLC0415
    from kvmap.daemon.api import server  # noqa: PLC0415

    try:
        config = load_config(args.config, vars(args))
    except (OSError, ValueError) as err:
        print(f"kvmapd: {err}", file=sys.stderr)
        return 2
    configure_logging(config.log_format)
    try:
        return asyncio.run(server.serve(config, ready_file=args.ready_file))
    except StateStoreError as err:
        # An unusable state dir is the operator's to fix: one line naming it,
        # not a traceback repeated by every restart of a crash loop.
        print(f"kvmapd: {err}", file=sys.stderr)
        return 2
    except SocketInUse as err:
        # Another daemon serves this path; its socket is left alone.
        print(f"kvmapd: {err}", file=sys.stderr)
        return 2


# Harness commands live in kvmap.tools, which the daemon never imports: they
# are loaded by name only when asked for, and parse their own arguments.
HARNESS = {
    "demo": ("kvmap.tools.demo", "P/D pull demo between two local daemons"),
    "bench": ("kvmap.tools.bench", "benchmark every planner against the per-layer baseline"),
}


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in and args_in[0] in HARNESS:
        module = importlib.import_module(HARNESS[args_in[0]][0])
        status: int = module.main(args_in[1:])
        return status
    parser = argparse.ArgumentParser(prog="kvmapd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    plan_cmd.add_parser(sub)
    for name, (_, help_text) in HARNESS.items():
        sub.add_parser(name, help=f"{help_text} (kvmapd {name} --help)", add_help=False)
    args = parser.parse_args(args_in)
    if args.command == "serve":
        return _serve(args)
    return plan_cmd.run(args)


if __name__ == "__main__":
    sys.exit(main())
