"""``kvmapd plan``: table and JSON output, rejected input, the shipped examples."""

from __future__ import annotations

import argparse
import json
from importlib import resources
from pathlib import Path

import pytest
from google.protobuf import json_format

from kvmap.core import convert
from kvmap.daemon.cli.kvmapd import plan_cmd
from kvmap.v1 import types_pb2

EXAMPLES = Path(str(resources.files("kvmap.daemon.examples")))


def _run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="kvmapd")
    plan_cmd.add_parser(parser.add_subparsers(dest="command"))
    return plan_cmd.run(parser.parse_args(["plan", *argv]))


def _spec(tmp_path: Path, spec: dict[str, object]) -> str:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    return str(path)


def test_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    """kvmapd plan prints the worker, planner, descriptor counts with the saving over baseline, and
    one row per region with its layer range, for the glm-tiny example."""
    assert _run("--spec", str(EXAMPLES / "glm-tiny.json")) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["worker", "glm-tiny/dp0/tp0/pp0"]
    assert "planner      coalesce v1" in lines
    assert "descriptors  128 in 2 regions (baseline 384, saving 66.7%)" in lines
    rows = lines[lines.index("") + 2 :]
    assert [row.split()[:9] for row in rows] == [
        ["0", "0", "kv-mla", "0", "41984", "41984", "64", "yes", "4"],
        ["1", "1", "kv-indexer", "0", "4224", "4224", "64", "yes", "2"],
    ]
    assert "model.layers.0.self_attn.attn .. model.layers.3.self_attn.attn" in rows[0]


def test_json_output_parses_back_to_a_region_map(capsys: pytest.CaptureFixture[str]) -> None:
    """plan --json prints a RegionMap in proto3 JSON with proto field names, which parses back to a
    valid map with the chosen planner's regions and counts."""
    assert _run("--spec", str(EXAMPLES / "glm-tiny.json"), "--planner", "baseline", "--json") == 0
    out = capsys.readouterr().out
    assert '"baseline_descriptor_count"' in out  # proto field names, not camelCase
    msg = json_format.Parse(out, types_pb2.RegionMap())
    model = convert.region_map_from_proto(msg)
    assert (model.planner.name, len(model.regions), model.descriptor_count) == ("baseline", 6, 384)


@pytest.mark.parametrize(
    ("name", "baseline", "coalesced", "regions"),
    [
        ("glm-tiny.json", 384, 128, 2),
        ("glm53-rank.json", 3_234_222, 64_044, 2),
        ("llama-mha.json", 131_072, 131_072, 64),
    ],
)
def test_shipped_examples_plan_as_documented(
    capsys: pytest.CaptureFixture[str], name: str, baseline: int, coalesced: int, regions: int
) -> None:
    """Each shipped example plans to its documented baseline and coalesced descriptor counts and
    region count (GLM-5.3 rank: 3,234,222 -> 64,044)."""
    assert _run("--spec", str(EXAMPLES / name), "--json") == 0
    msg = json_format.Parse(capsys.readouterr().out, types_pb2.RegionMap())
    counts = (msg.baseline_descriptor_count, msg.descriptor_count, len(msg.regions))
    assert counts == (baseline, coalesced, regions)


def test_invalid_spec_exits_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A spec breaking a validation rule exits 2 with nothing on stdout and the field path and
    problem on stderr."""
    spec = json.loads((EXAMPLES / "glm-tiny.json").read_text())
    spec["views"][3]["block_stride_bytes"] = 2048
    spec["views"][3]["block_len_bytes"] = 4096
    assert _run("--spec", _spec(tmp_path, spec)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "views[3].block_stride_bytes: must be >= block_len_bytes (4096 > 2048)" in captured.err


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("{not json", "invalid RegisterWorkerRequest JSON"),
        (
            '{"worker": {"engine_id": "e"}, "block_size_tokens": 16}',
            "allocations: must not be empty",
        ),
        ("{}", "worker: must be set"),
    ],
)
def test_unusable_specs_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, fragment: str
) -> None:
    """A spec that is not JSON, lacks allocations or lacks a worker exits 2 and says why on
    stderr."""
    path = tmp_path / "spec.json"
    path.write_text(content)
    assert _run("--spec", str(path)) == 2
    assert fragment in capsys.readouterr().err


def test_missing_file_and_unknown_planner_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A spec file that cannot be read and an unknown planner name each exit 2, the latter listing
    the known planners."""
    assert _run("--spec", str(tmp_path / "absent.json")) == 2
    assert "cannot read" in capsys.readouterr().err
    assert _run("--spec", str(EXAMPLES / "glm-tiny.json"), "--planner", "magic") == 2
    assert "planner: unknown planner 'magic' (known: baseline, coalesce)" in capsys.readouterr().err
