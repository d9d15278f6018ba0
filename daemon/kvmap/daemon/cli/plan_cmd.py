"""``kvmapd plan``: plan a worker geometry offline, without a daemon or memory.

Reads the proto3 JSON of a ``RegisterWorkerRequest`` (``--spec FILE``, or one of
the examples shipped with the package: ``--example glm53-rank``),
validates it exactly as a registration would be, and prints the region map
as a table or as proto3 JSON. Exit status 2 means the input was rejected.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvmap.core import convert
from kvmap.core.errors import InvalidArgument
from kvmap.core.planner import DEFAULT_PLANNER, PLANNERS, get_planner
from kvmap.core.validation import validate_geometry
from kvmap.daemon import examples
from kvmap.daemon.cli import tables

EXIT_INVALID_INPUT = 2


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "plan",
        help="plan a worker geometry (RegisterWorkerRequest JSON) and print its region map",
        description=__doc__,
        allow_abbrev=False,
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--spec", help="proto3 JSON of a RegisterWorkerRequest")
    source.add_argument(
        "--example", choices=examples.NAMES, help="a bundled example geometry instead of --spec"
    )
    p.add_argument(
        "--planner",
        default=DEFAULT_PLANNER,
        help=f"one of {', '.join(sorted(PLANNERS))} (default {DEFAULT_PLANNER})",
    )
    p.add_argument("--json", action="store_true", help="print the RegionMap as proto3 JSON")


def run(args: argparse.Namespace) -> int:
    source = args.spec or f"example {args.example}"
    try:
        if args.spec:
            text = Path(args.spec).read_text(encoding="utf-8")
        else:
            text = examples.example_path(args.example).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        print(f"kvmapd plan: cannot read {source}: {err}", file=sys.stderr)
        return EXIT_INVALID_INPUT
    try:
        planner = get_planner(args.planner)
        geometry = convert.geometry_from_json(text)
        validate_geometry(geometry)
    except InvalidArgument as err:
        print(f"kvmapd plan: {source}: {err}", file=sys.stderr)
        return EXIT_INVALID_INPUT
    plan = planner.plan(geometry)
    region_map = convert.region_map_to_proto(
        convert.model_from_plan(geometry, plan, generation=0, base_addresses={})
    )
    if args.json:
        # Imported here: kvmapd serve imports this module for its flags,
        # and its start would pay ~17 ms for json_format.
        from google.protobuf import json_format  # noqa: PLC0415 - see above

        print(json_format.MessageToJson(region_map, preserving_proto_field_name=True))
    else:
        print(tables.render_region_map(region_map), end="")
    return 0
