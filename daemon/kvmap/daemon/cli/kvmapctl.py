"""``kvmapctl``: look at (and re-plan) a running kvmapd.

Habits borrowed from kubectl: options go anywhere on the line
(``kvmapctl workers -o json``), ``-o json|wide`` picks the output, the
target comes from ``--target``, else ``$KVMAP_TARGET``, else the per-user
socket, and a reader that closes the pipe early (``| head``) ends it
quietly. ``status``, ``transfers``, ``peers``, ``grants``, ``stats`` and
``replan`` are the Admin service's, which the daemon serves on its Unix
socket only."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message

from kvmap.core.errors import ConfigError
from kvmap.core.peer_policy import PEER_SECRET_METADATA
from kvmap.daemon.adapters.config_files import default_runtime_dir, read_pem
from kvmap.daemon.adapters.peer_secret import read_peer_secret
from kvmap.daemon.cli import status_tables, tables
from kvmap.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    region_maps_pb2,
    region_maps_pb2_grpc,
    types_pb2,
)

ENV_TARGET = "KVMAP_TARGET"
# Target prefixes gRPC resolves itself; anything else with a "/" is a path.
_SCHEMES = ("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:")
ADMIN_COMMANDS = frozenset({"status", "transfers", "peers", "grants", "stats", "replan"})
# The id `workers` prints: ENGINE/dpN/tpN/ppN (the engine id may hold "/").
_WORKER_ID = re.compile(r"^(?P<engine>.+)/dp(?P<dp>\d+)/tp(?P<tp>\d+)/pp(?P<pp>\d+)$")
# Every option that may go anywhere, and its value when not given.
_DEFAULTS: dict[str, object] = {
    "target": None,
    "timeout": 5.0,
    "output": "table",
    "tls_ca": None,
    "tls_cert": None,
    "tls_key": None,
    "peer_secret_file": None,
}


class UsageError(Exception):
    """A mistake on the command line: one line, exit 2."""


def resolve_target(value: str | None, environ: dict[str, str] | os._Environ[str]) -> str:
    """The gRPC target: the flag, else $KVMAP_TARGET, else the per-user
    socket. A path (bare or ``unix://``) is a Unix socket, HOST:PORT is TCP."""
    value = value or environ.get(ENV_TARGET) or ""
    if not value:
        return f"unix://{default_runtime_dir() / 'kvmapd.sock'}"
    if value.startswith(_SCHEMES):
        return value
    if "/" in value or value.endswith(".sock"):
        return f"unix://{os.path.abspath(value)}"
    return value


def is_unix(target: str) -> bool:
    return target.startswith(("unix:", "unix-abstract:"))


def _options() -> argparse.ArgumentParser:
    """The options every command takes, anywhere on the line. Defaults are
    left out (SUPPRESS) so that one given before the command is not reset
    by the command's parser; ``_DEFAULTS`` fills in the rest."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    g = p.add_argument_group("target and output (anywhere on the line)")
    s = argparse.SUPPRESS
    g.add_argument(
        "--target",
        default=s,
        help="a Unix socket (/path/kvmapd.sock or unix:///path) or HOST:PORT "
        f"(default: ${ENV_TARGET}, else the per-user socket {default_runtime_dir()}/kvmapd.sock)",
    )
    g.add_argument("--timeout", type=float, default=s, help="seconds per call (default 5)")
    g.add_argument(
        "-o", "--output", choices=["table", "wide", "json"], default=s, help="(default table)"
    )
    g.add_argument(
        "--json", dest="output", action="store_const", const="json", default=s, help="-o json"
    )
    g.add_argument("--tls-ca", dest="tls_ca", default=s, help="PEM CA of a TCP target's cert")
    g.add_argument("--tls-cert", dest="tls_cert", default=s, help="PEM client certificate")
    g.add_argument("--tls-key", dest="tls_key", default=s, help="PEM client private key")
    g.add_argument(
        "--peer-secret-file",
        dest="peer_secret_file",
        default=s,
        help="the daemons' peer secret (peer_secret_file), sent to a TCP target",
    )
    return p


def _parser() -> argparse.ArgumentParser:
    common = _options()
    parser = argparse.ArgumentParser(
        prog="kvmapctl", description=__doc__, parents=[common], allow_abbrev=False
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_text, parents=[common], allow_abbrev=False)

    add("workers", "registered workers")
    regions = add("regions", "a worker's region map")
    regions.add_argument("worker", help="ENGINE_ID, or ENGINE/dpN/tpN/ppN as `workers` prints")
    for rank in ("dp", "tp", "pp"):
        regions.add_argument(f"--{rank}-rank", dest=f"{rank}_rank", type=int, default=None)
    add("status", "the daemon's live view: workers, transfers, peers, leases, grants, errors")
    add("transfers", "this daemon's transfers in flight, with their age")
    add("peers", "remote daemons this daemon has handshaked with")
    add("grants", "grants the local workers gave, and the leases peers hold")
    replan = add("replan", "re-plan live workers (Unix socket only)")
    replan.add_argument(
        "--planner",
        default="",
        help="planner name (default: the planner the daemon runs now, which re-plans "
        "with the same planner: fresh generations, same regions)",
    )
    add("stats", "transfer statistics")
    return parser


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    args = _parser().parse_args(argv)
    for key, value in _DEFAULTS.items():
        if not hasattr(args, key):
            setattr(args, key, value)
    return args


def worker_of(args: argparse.Namespace) -> types_pb2.WorkerId:
    """The worker ``regions`` names: ENGINE/dpN/tpN/ppN or a bare engine id
    with rank flags (a flag given wins over the id's rank)."""
    ranks = {"dp": 0, "tp": 0, "pp": 0}
    engine = args.worker
    found = _WORKER_ID.match(engine)
    if found:
        engine = found["engine"]
        ranks = {r: int(found[r]) for r in ranks}
    for r in ranks:
        flag = getattr(args, f"{r}_rank")
        if flag is not None:
            ranks[r] = flag
    return types_pb2.WorkerId(
        engine_id=engine, dp_rank=ranks["dp"], tp_rank=ranks["tp"], pp_rank=ranks["pp"]
    )


def call_options(args: argparse.Namespace) -> dict[str, Any]:
    """Each call's deadline, and the peer secret for a TCP target (its
    RegionMaps answers only callers that present it: docs/security.md)."""
    options: dict[str, Any] = {"timeout": args.timeout}
    if args.peer_secret_file:
        if is_unix(args.target):
            raise UsageError("--peer-secret-file is for TCP targets, not a Unix socket")
        try:
            secret = read_peer_secret(args.peer_secret_file)
        except ConfigError as err:
            raise UsageError(f"--peer-secret-file {args.peer_secret_file}: {err.problem}") from None
        options["metadata"] = ((PEER_SECRET_METADATA, secret.decode()),)
    return options


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    tls = (args.tls_ca, args.tls_cert, args.tls_key)
    if not any(tls):
        return grpc.insecure_channel(args.target)
    if is_unix(args.target):
        raise UsageError("--tls-ca/--tls-cert/--tls-key are for TCP targets, not a Unix socket")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise UsageError("--tls-cert and --tls-key: give both or neither")
    try:
        ca, cert, key = (read_pem(path) if path else None for path in tls)
    except OSError as err:
        raise UsageError(f"cannot read {err.filename}: {err.strerror}") from None
    creds = grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=cert
    )
    return grpc.secure_channel(args.target, creds)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.target = resolve_target(args.target, os.environ)
    try:
        if args.command in ADMIN_COMMANDS and not is_unix(args.target):
            raise UsageError(
                f"{args.command} needs the daemon's Unix socket (its Admin service is not "
                f"served on TCP): --target /path/kvmapd.sock or ${ENV_TARGET}"
            )
        args.call = call_options(args)
        with open_channel(args) as channel:
            return _guarded(args, channel)
    except UsageError as err:
        print(f"kvmapctl: {err}", file=sys.stderr)
        return 2


def _guarded(args: argparse.Namespace, channel: grpc.Channel) -> int:
    try:
        text = _run(args, channel)
    except grpc.RpcError as err:
        print(f"kvmapctl: {_rpc_error(err, args)}", file=sys.stderr)
        return 1
    return _write(text)


def _rpc_error(err: grpc.RpcError, args: argparse.Namespace) -> str:
    code: grpc.StatusCode = err.code()
    details = err.details() or ""
    if code is grpc.StatusCode.UNIMPLEMENTED and args.command in ADMIN_COMMANDS:
        return (
            f"UNIMPLEMENTED: {args.target} does not serve {args.command} "
            "(a daemon older than this kvmapctl, or not kvmapd's Unix socket)"
        )
    if code is grpc.StatusCode.UNAVAILABLE:
        return f"UNAVAILABLE: no kvmapd answers at {args.target}: {details}"
    return f"{code.name}: {details}"


def _write(text: str) -> int:
    """Print, ending quietly when the reader closed the pipe (``| head``):
    what it wanted was delivered."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # The interpreter flushes stdout again at exit: point it at /dev/null
        # so that flush cannot fail and print a traceback.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return 0


def _json(msg: Message) -> str:
    return (
        json_format.MessageToJson(
            msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
        + "\n"
    )


def _view(args: argparse.Namespace, msg: Message, render: Callable[[bool], str]) -> str:
    return _json(msg) if args.output == "json" else render(args.output == "wide")


def _run(args: argparse.Namespace, channel: grpc.Channel) -> str:
    if args.command in ("workers", "regions"):
        return _region_maps(args, region_maps_pb2_grpc.RegionMapsStub(channel))
    admin = admin_pb2_grpc.AdminStub(channel)
    if args.command == "replan":
        if not args.planner:
            # Say what an empty planner means rather than let it look like a choice.
            print("kvmapctl: no --planner: re-planning with the planner the daemon runs now",
                  file=sys.stderr)  # fmt: skip
        rep = admin.Replan(admin_pb2.ReplanRequest(planner=args.planner), **args.call)
        return _view(args, rep, lambda wide: _replanned(rep))
    if args.command == "stats":
        stats = admin.GetStats(admin_pb2.GetStatsRequest(), **args.call)
        return _json(stats)
    st = admin.GetStatus(admin_pb2.GetStatusRequest(), **args.call)
    return _status_view(args, st)


def _region_maps(args: argparse.Namespace, maps: region_maps_pb2_grpc.RegionMapsStub) -> str:
    if args.command == "workers":
        resp = maps.ListWorkers(region_maps_pb2.ListWorkersRequest(), **args.call)
        return _view(args, resp, lambda wide: tables.render_workers(resp, wide))
    got = maps.GetRegionMap(
        region_maps_pb2.GetRegionMapRequest(worker=worker_of(args)), **args.call
    )
    return _view(args, got, lambda wide: tables.render_region_map(got.region_map))


def _replanned(rep: admin_pb2.ReplanResponse) -> str:
    lines = [f"planner {rep.planner.name} v{rep.planner.version}"]
    lines += [
        f"  {tables.worker_id(w.worker)}  generation {w.generation}  "
        f"descriptors {w.descriptor_count}"
        for w in rep.workers
    ]
    return "\n".join(lines) + "\n"


# What ``transfers``, ``peers`` and ``grants`` show of the status: its
# fields (in JSON) and its sections (in tables).
_PARTS: dict[str, tuple[tuple[str, ...], tuple[Callable[..., list[str]], ...]]] = {
    "transfers": (("transfers", "transfers_total"), (status_tables.render_transfers,)),
    "peers": (("peers",), (status_tables.render_peers,)),
    "grants": (
        ("grants", "grants_total", "leases", "leases_total"),
        (status_tables.render_grants, status_tables.render_leases),
    ),
}


def _status_view(args: argparse.Namespace, st: admin_pb2.GetStatusResponse) -> str:
    """``status``: everything; ``transfers``, ``peers``, ``grants``: their
    part (as JSON, those fields of the status message)."""
    if args.command == "status":
        return _view(args, st, lambda wide: status_tables.render_status(st, wide))
    fields, sections = _PARTS[args.command]
    if args.output == "json":
        whole = json.loads(_json(st))
        return json.dumps({f: whole[f] for f in fields}, indent=2) + "\n"
    lines = [line for section in sections for line in section(st, args.output == "wide")]
    return "\n".join(lines[1:]) + "\n"  # no blank line before the first title


if __name__ == "__main__":
    sys.exit(main())
