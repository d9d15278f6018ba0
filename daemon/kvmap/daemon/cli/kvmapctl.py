"""``kvmapctl``: look at (and re-plan) a running kvmapd."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from google.protobuf import json_format

from kvmap.daemon.adapters.config_files import default_runtime_dir
from kvmap.daemon.cli import tables
from kvmap.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    region_maps_pb2,
    region_maps_pb2_grpc,
    types_pb2,
)


def _target(value: str | None) -> str:
    if value:
        return value
    return f"unix://{default_runtime_dir() / 'kvmapd.sock'}"


def _worker(args: argparse.Namespace) -> types_pb2.WorkerId:
    return types_pb2.WorkerId(
        engine_id=args.engine_id, dp_rank=args.dp_rank, tp_rank=args.tp_rank, pp_rank=args.pp_rank
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvmapctl", description=__doc__)
    parser.add_argument(
        "--target",
        help="unix:///path/kvmapd.sock or HOST:PORT (default: the per-user socket)",
    )
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--json", action="store_true", help="print proto3 JSON")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("workers", help="registered workers")
    regions = sub.add_parser("regions", help="a worker's region map")
    regions.add_argument("engine_id")
    regions.add_argument("--dp-rank", dest="dp_rank", type=int, default=0)
    regions.add_argument("--tp-rank", dest="tp_rank", type=int, default=0)
    regions.add_argument("--pp-rank", dest="pp_rank", type=int, default=0)
    replan = sub.add_parser("replan", help="re-plan live workers (Unix socket only)")
    replan.add_argument("--planner", default="", help="planner name (default: configured)")
    sub.add_parser("stats", help="transfer statistics (Unix socket only)")
    args = parser.parse_args(argv)

    with grpc.insecure_channel(_target(args.target)) as channel:
        try:
            return _run(args, channel)
        except grpc.RpcError as err:
            print(f"kvmapctl: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1


def _print(msg: object, args: argparse.Namespace, table: str) -> None:
    if args.json:
        print(json_format.MessageToJson(msg, preserving_proto_field_name=True))  # type: ignore[arg-type]
    else:
        print(table)


def _run(args: argparse.Namespace, channel: grpc.Channel) -> int:
    maps = region_maps_pb2_grpc.RegionMapsStub(channel)
    admin = admin_pb2_grpc.AdminStub(channel)
    if args.command == "workers":
        resp = maps.ListWorkers(region_maps_pb2.ListWorkersRequest(), timeout=args.timeout)
        _print(resp, args, tables.render_workers(resp))
    elif args.command == "regions":
        got = maps.GetRegionMap(
            region_maps_pb2.GetRegionMapRequest(worker=_worker(args)), timeout=args.timeout
        )
        _print(got, args, tables.render_region_map(got.region_map))
    elif args.command == "replan":
        rep = admin.Replan(admin_pb2.ReplanRequest(planner=args.planner), timeout=args.timeout)
        lines = [f"planner {rep.planner.name} v{rep.planner.version}"]
        lines += [
            f"  {w.worker.engine_id}/dp{w.worker.dp_rank}/tp{w.worker.tp_rank}/pp{w.worker.pp_rank}"
            f"  generation {w.generation}  descriptors {w.descriptor_count}"
            for w in rep.workers
        ]
        _print(rep, args, "\n".join(lines))
    elif args.command == "stats":
        stats = admin.GetStats(admin_pb2.GetStatsRequest(), timeout=args.timeout)
        _print(stats, args, json_format.MessageToJson(stats, preserving_proto_field_name=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
