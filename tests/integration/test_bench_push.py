"""``kvmapd bench --push`` on the tiny profile (GLM-shaped: 4 MLA + 2 indexer
layers, block-outermost, coalesce planner): real daemons and stand-in
workers; pull after finish, push at finish and layer-group pushes each
produce figures, every transferred byte is verified, and the descriptor
counts are the ones a block-outermost cache gives. Not timed: speed is in
the printed figures, never asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from kvmap.tools.bench import push
from kvmap.tools.bench.profiles import get_profile
from kvmap.tools.bench.workload import request_bytes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

BLOCKS = (16, 48)
GROUPS = (2, 6)
REPEATS = 2
KINDS = ("pull", "push_finish", "layer_group_2", "layer_group_6")


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    args = ["--push", "--push-profile", "tiny", "--repeats", str(REPEATS), "--json", "--quiet"]
    args += ["--push-blocks", ",".join(map(str, BLOCKS)), "--push-groups", "2,6"]
    proc = subprocess.run(
        [sys.executable, "-m", "kvmap.daemon.cli.kvmapd", "bench", *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path_factory.mktemp("bench-push"),
        env={**os.environ, "UCX_NET_DEVICES": "lo"},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    out: dict[str, Any] = json.loads(proc.stdout)
    return out


def test_every_series_has_figures(result: dict[str, Any]) -> None:
    """One row per block count, each with every kind's exposed time per
    repetition (the warm-up left out), its median and p90, the pushes it
    took (1 at finish, G for G layer groups) and its ratio to the pull."""
    assert result["schema"] == push.SCHEMA
    assert (result["profile"], result["planner"], result["layers"]) == ("tiny", "coalesce", 6)
    assert [r["blocks"] for r in result["rows"]] == list(BLOCKS)
    for row in result["rows"]:
        assert tuple(row["series"]) == KINDS
        for kind, s in row["series"].items():
            assert len(s["exposed_seconds"]) == REPEATS, kind
            assert all(t > 0 for t in s["exposed_seconds"]), kind
            assert min(s["exposed_seconds"]) <= s["exposed_median"] <= s["exposed_p90"], kind
        assert [row["series"][k]["transfers"] for k in KINDS] == [1, 1, *GROUPS]
        assert set(row["vs_pull"]) == set(KINDS) - {"pull"}
        assert "exposed_done_median" in row["series"]["push_finish"]


def test_every_transfer_was_verified(result: dict[str, Any]) -> None:
    """The decode worker checked the whole request after every transfer,
    warm-up included, and every series moved the whole request's bytes."""
    assert result["verified"] is True
    geometry = get_profile("tiny").geometry(result["page_divisor"])
    for row in result["rows"]:
        whole = request_bytes(geometry, push.push_request(get_profile("tiny"), row["blocks"]))
        assert row["verified_bytes"] == (REPEATS + 1) * len(KINDS) * whole
        assert {row["series"][k]["bytes"] for k in KINDS} == {whole}


def test_layer_groups_cost_a_descriptor_per_block_and_piece(result: dict[str, Any]) -> None:
    """Under the coalesce planner a block's layers of one group are one
    descriptor: 6 groups of one layer post blocks x 6 descriptors (a layer
    is never a whole row, so nothing merges); 2 groups post blocks for the
    first (MLA layers 0-2) and for MLA layer 3, and the whole indexer row
    (layers 4-5) merges as the push at finish's does; the push at finish
    and the pull post the same list."""
    for row in result["rows"]:
        s, b = row["series"], row["blocks"]
        assert s["push_finish"]["descriptors"] == s["pull"]["descriptors"]
        assert s["layer_group_6"]["descriptors"] == b * 6
        assert s["layer_group_2"]["descriptors"] == 2 * b + s["push_finish"]["descriptors"] // 2


def test_the_table_names_every_series_and_the_goal(result: dict[str, Any]) -> None:
    """The text form has a table per block count with a line per kind and
    the verdict on the 10% goal."""
    text = push.render(result)
    for label in ("pull after finish", "push at finish", "layer groups G=2", "layer groups G=6"):
        assert text.count(label) == len(BLOCKS), label
    assert text.count("goal (layer groups expose <= 10% of the pull)") == len(BLOCKS)


class _Worker:
    def __init__(self, answer: dict[str, Any]) -> None:
        self.answer = answer

    def call(self, cmd: dict[str, Any], timeout: float = 0) -> dict[str, Any]:
        return self.answer


def test_a_wrong_byte_fails_the_run() -> None:
    """A decode worker that finds any (layer, block) differing from the
    prefill's pattern fails the run, naming the transfer."""
    bad = _Worker({"ok": True, "bad_blocks": 3, "bytes": 4096})
    req = push.push_request(get_profile("tiny"), 4)
    with pytest.raises(AssertionError, match="layer_group_2: 3"):
        push.verify_decode(bad, req, "layer_group_2")  # type: ignore[arg-type]
    good = _Worker({"ok": True, "bad_blocks": 0, "bytes": 4096})
    assert push.verify_decode(good, req, "pull") == 4096  # type: ignore[arg-type]
