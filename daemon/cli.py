"""``kvmapd``: the daemon and its subcommands."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

from kvmap.daemon import bench, demo, plan_cmd
from kvmap.daemon.config import load_config
from kvmap.daemon.logs import configure_logging


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
    p.add_argument("--ready-file", dest="ready_file", help="write a JSON line here once serving")


def _serve(args: argparse.Namespace) -> int:
    # Lazy: the server imports nixl, which `kvmapd plan` must not need.
    from kvmap.daemon import server  # noqa: PLC0415

    try:
        config = load_config(args.config, vars(args))
    except (OSError, ValueError) as err:
        print(f"kvmapd: {err}", file=sys.stderr)
        return 2
    configure_logging(config.log_format)
    return asyncio.run(server.serve(config, ready_file=args.ready_file))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvmapd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    plan_cmd.add_parser(sub)
    demo.add_parser(sub)
    bench.add_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "demo":
        configure_logging("console", level=logging.WARNING)
        return demo.run(args)
    if args.command == "bench":
        return bench.run(args)
    return plan_cmd.run(args)


if __name__ == "__main__":
    sys.exit(main())
