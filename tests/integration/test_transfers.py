"""Pulls and pushes between real daemons (separate processes, real NIXL agents
over UCX on loopback) into and out of real shared-memory KV caches; the
worker that owns the blocks a transfer touches grants it first, as the vLLM
connector does."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvmap.tools.grants import grant, granted
from kvmap.tools.launch import DaemonProc, WorkerProc, start_daemon, start_worker

pytestmark = pytest.mark.integration

BLOCKS = 48
GEO = (
    "--blocks",
    str(BLOCKS),
    "--block-tokens",
    "32",
    "--mla-layers",
    "6",
    "--indexer-layers",
    "3",
)
MLA_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(6)]


@dataclass
class Side:
    daemon: DaemonProc
    worker: WorkerProc


@dataclass
class Pair:
    prefill: Side
    decode: Side

    def pull(self, request_id: str, groups: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        """The decode worker pulls ``groups`` with the capability the prefill
        worker granted for exactly their remote blocks (or ``capability``)."""
        cmd = {
            "cmd": "pull",
            "request_id": request_id,
            "remote_target": self.prefill.daemon.tcp_target,
            "remote_worker": {"engine_id": "prefill"},
            "groups": groups,
            **extra,
        }
        if "capability" not in cmd:
            cmd = granted(self.prefill.worker, cmd)
        return self.decode.worker.call(cmd)


def _side(tmp: Path, name: str, planner: str, *worker_args: str) -> Side:
    d = start_daemon(tmp / name, "--planner", planner, name=name)
    try:
        w = start_worker(d, name, *GEO, *worker_args)
    except BaseException:
        d.kill()
        raise
    return Side(d, w)


def _close(*sides: Side) -> None:
    for s in sides:
        s.worker.stop()
    for s in sides:
        assert s.daemon.terminate() == 0, s.daemon.log()


@pytest.fixture
def coalesced(tmp_path: Path) -> Iterator[Pair]:
    p = _side(tmp_path, "prefill", "coalesce", "--fill")
    d = _side(tmp_path, "decode", "coalesce")
    yield Pair(p, d)
    _close(d, p)


@pytest.fixture
def mixed(tmp_path: Path) -> Iterator[Pair]:
    p = _side(tmp_path, "prefill", "coalesce", "--fill")
    d = _side(tmp_path, "decode", "baseline")
    yield Pair(p, d)
    _close(d, p)


def both_groups(local: list[int], remote: list[int]) -> list[dict[str, Any]]:
    return [
        {"group": 0, "local": local, "remote": remote},
        {"group": 1, "local": local, "remote": remote},
    ]


SCATTERED_REMOTE = [17, 3, 40, 41, 8, 29, 0, 47]
SCATTERED_LOCAL = [5, 44, 12, 13, 30, 1, 23, 38]


def test_pull_scattered_identical_coalesced_maps(coalesced: Pair) -> None:
    """A scattered pull between two coalesced maps moves every block's bytes
    (verified against the pattern), with one descriptor per block per group
    except where consecutive ids merge, and handshakes on first contact."""
    out = coalesced.pull("r1", both_groups(SCATTERED_LOCAL, SCATTERED_REMOTE))
    assert out["ok"], out
    assert out["bad_blocks"] == 0
    # One descriptor per block per group, except the consecutive pair
    # (12,13)<-(40,41), which merges on full rows: 7 per group.
    assert out["stats"]["descriptors"] == 2 * 7
    assert out["stats"]["handshaked"] is True


def test_pull_consecutive_ids_merge_into_one_descriptor_per_group(coalesced: Pair) -> None:
    """A run of consecutive block ids on both sides moves as a single descriptor
    per group, and its bytes verify."""
    local, remote = list(range(10, 30)), list(range(20, 40))
    out = coalesced.pull("r-run", both_groups(local, remote))
    assert out["ok"] and out["bad_blocks"] == 0, out
    assert out["stats"]["descriptors"] == 2


def test_pull_between_coalesce_and_baseline_maps(mixed: Pair) -> None:
    """A pull from a coalesced map into a baseline one moves the right bytes,
    split along the common refinement of the two maps (one descriptor per layer
    per block)."""
    assert len(mixed.prefill.worker.region_map["regions"]) == 2
    assert len(mixed.decode.worker.region_map["regions"]) == 9
    out = mixed.pull("r-mixed", both_groups(SCATTERED_LOCAL, SCATTERED_REMOTE))
    assert out["ok"] and out["bad_blocks"] == 0, out
    # The common refinement is the per-layer split: 9 layers x 8 blocks.
    assert out["stats"]["descriptors"] == 9 * 8


def test_pull_partial_layer_set(mixed: Pair) -> None:
    """A pull of some layers of one group writes exactly those layers: the
    other group's memory is byte-for-byte unchanged and the other layers of
    the pulled blocks stay zero."""
    layers = MLA_NAMES[1:4]
    before = mixed.decode.worker.call({"cmd": "digest"})["digest"]
    out = mixed.pull(
        "r-part",
        [{"group": 0, "local": SCATTERED_LOCAL, "remote": SCATTERED_REMOTE, "layers": layers}],
    )
    assert out["ok"] and out["bad_blocks"] == 0, out
    after = mixed.decode.worker.call({"cmd": "digest"})["digest"]
    assert after[1] == before[1], "the indexer group was not asked for"
    # The other MLA layers of those blocks stayed zero.
    other = mixed.decode.worker.call(
        {"cmd": "verify", "group": 0, "local": SCATTERED_LOCAL, "remote": SCATTERED_REMOTE,
         "layers": [MLA_NAMES[0]]}
    )  # fmt: skip
    assert other["bad_blocks"] == len(SCATTERED_LOCAL)


def test_push_writes_remote_blocks(coalesced: Pair) -> None:
    """A push writes the local blocks into the remote worker's chosen blocks
    (both groups verify there) and the remote worker is told it was pushed to."""
    pw = coalesced.prefill.worker
    push = {
        "cmd": "push",
        "request_id": "push-1",
        "remote_target": coalesced.decode.daemon.tcp_target,
        "remote_worker": {"engine_id": "decode"},
        # Local (prefill) blocks SCATTERED_REMOTE go to decode's SCATTERED_LOCAL.
        "groups": both_groups(SCATTERED_REMOTE, SCATTERED_LOCAL),
    }
    # The decode worker owns the blocks written: it grants them.
    out = pw.call(granted(coalesced.decode.worker, push))
    assert out["ok"], out
    for group in (0, 1):
        got = coalesced.decode.worker.call(
            {"cmd": "verify", "group": group, "local": SCATTERED_LOCAL, "remote": SCATTERED_REMOTE}
        )
        assert got["bad_blocks"] == 0
    events = _wait_events(coalesced.decode.worker, "push-1")
    assert events["push-1"] == "TRANSFER_DIRECTION_PUSHED_TO"


def _wait_events(worker: WorkerProc, *request_ids: str, timeout: float = 30) -> dict[str, str]:
    """The worker's TransferFinished events (request id -> direction), once
    those of ``request_ids`` have arrived (or ``timeout`` passed)."""
    deadline = time.monotonic() + timeout
    while True:
        events = worker.call({"cmd": "events"})["events"]
        done = {
            e["transfer_finished"]["request_id"]: e["transfer_finished"]["direction"]
            for e in events
            if "transfer_finished" in e
        }
        if set(request_ids) <= set(done) or time.monotonic() > deadline:
            return done
        time.sleep(0.05)


def test_prefill_worker_is_told_each_pull_finished(coalesced: Pair) -> None:
    """The owner of pulled blocks gets one TransferFinished (PULLED_FROM) event
    per pull, naming its request id."""
    for i in range(3):
        assert coalesced.pull(f"n{i}", both_groups([i], [i + 1]))["ok"]
    done = _wait_events(coalesced.prefill.worker, "n0", "n1", "n2")
    assert {k: v for k, v in done.items() if k.startswith("n")} == {
        f"n{i}": "TRANSFER_DIRECTION_PULLED_FROM" for i in range(3)
    }


@pytest.mark.parametrize(
    ("groups", "code", "message"),
    [
        (both_groups([1, 2], [3, BLOCKS]), "INVALID_ARGUMENT", "remote_block_ids[1]"),
        (both_groups([1, -1], [3, 4]), "INVALID_ARGUMENT", "local_block_ids[1]"),
        ([{"group": 0, "local": [1, 2], "remote": [3]}], "INVALID_ARGUMENT", "remote_block_ids"),
        ([{"group": 7, "local": [1], "remote": [3]}], "NOT_FOUND", "transfer group 7"),
    ],
)
def test_bad_requests_get_precise_status_and_touch_nothing(
    coalesced: Pair, groups: list[dict[str, Any]], code: str, message: str
) -> None:
    """Each malformed pull fails with its precise status and the offending
    field in the message, and leaves the decode worker's memory byte-for-byte
    as it was (sha256 of the whole cache)."""
    before = coalesced.decode.worker.call({"cmd": "digest"})["digest"]
    # A grant of blocks that exist: the request itself is what is malformed.
    capability = grant(coalesced.prefill.worker, "bad", [{"group": 0, "blocks": [3]}])
    out = coalesced.pull("bad", groups, capability=capability)
    assert not out["ok"]
    assert out["code"] == code
    assert message in out["message"]
    assert coalesced.decode.worker.call({"cmd": "digest"})["digest"] == before


def test_unknown_remote_worker_is_not_found(coalesced: Pair) -> None:
    """A pull naming a worker the remote daemon does not know is NOT_FOUND
    (with a capability of the worker it does know)."""
    pull = {
        "cmd": "pull",
        "request_id": "nf",
        "remote_target": coalesced.prefill.daemon.tcp_target,
        "remote_worker": {"engine_id": "nobody"},
        "groups": both_groups([1], [1]),
    }
    out = coalesced.decode.worker.call(granted(coalesced.prefill.worker, pull))
    assert (out["ok"], out["code"]) == (False, "NOT_FOUND")


@pytest.mark.timeout(120)
def test_remote_daemon_down_is_unavailable(coalesced: Pair) -> None:
    """A pull from a target where nothing listens ends (no hang: the worker
    call and the test have hang guards) with UNAVAILABLE, and writes nothing."""
    before = coalesced.decode.worker.call({"cmd": "digest"})["digest"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connection refused
        pull = {
            "cmd": "pull",
            "request_id": "down",
            "remote_target": f"127.0.0.1:{port}",
            "remote_worker": {"engine_id": "prefill"},
            "groups": both_groups([1], [1]),
            # UNAVAILABLE is retried until the deadline, then passed on.
            "timeout_ms": 5000,
        }
        out = coalesced.decode.worker.call(granted(coalesced.prefill.worker, pull), timeout=60)
    assert (out["ok"], out["code"]) == (False, "UNAVAILABLE"), out
    assert "127.0.0.1:" in out["message"], out
    assert coalesced.decode.worker.call({"cmd": "digest"})["digest"] == before


def test_reregistered_remote_is_rehandshaked_and_old_mapping_never_read(coalesced: Pair) -> None:
    """After the remote worker registers new memory (new generation, other
    contents), the next pull handshakes again and reads the new memory: its
    bytes verify against the new seed, never the old mapping's."""
    first = coalesced.pull("g1", both_groups(SCATTERED_LOCAL, SCATTERED_REMOTE))
    assert first["ok"] and first["bad_blocks"] == 0
    assert first["stats"]["remote_generation"] == 1
    # New memory with other contents under a new generation.
    assert coalesced.prefill.worker.call({"cmd": "realloc", "seed": 5})["generation"] == 2
    second = coalesced.pull("g2", both_groups(SCATTERED_LOCAL, SCATTERED_REMOTE), seed=5)
    assert second["ok"], second
    assert second["stats"]["handshaked"] is True
    assert second["stats"]["remote_generation"] == 2
    assert second["bad_blocks"] == 0, "pulled bytes of the old mapping"


def test_concurrent_pulls_from_several_decode_workers(tmp_path: Path) -> None:
    """Three decode daemons (both planners) pulling from one prefill daemon at
    once all succeed with verified bytes, and the prefill worker is told of
    every pull."""
    p = _side(tmp_path, "prefill", "coalesce", "--fill")
    decodes = [_side(tmp_path, f"decode{i}", "coalesce" if i % 2 else "baseline") for i in range(3)]
    results: dict[str, dict[str, Any]] = {}

    def plan(i: int, r: int) -> dict[str, Any]:
        local = [(b * 7 + r + i) % BLOCKS for b in range(10)]
        remote = [(b * 5 + 3 * r + i) % BLOCKS for b in range(10)]
        return {
            "cmd": "pull",
            "request_id": f"d{i}-{r}",
            "remote_target": p.daemon.tcp_target,
            "remote_worker": {"engine_id": "prefill"},
            "groups": both_groups(local, remote),
        }

    def run(i: int, side: Side, pulls: list[dict[str, Any]]) -> None:
        for cmd in pulls:
            results[cmd["request_id"]] = side.worker.call(cmd)

    try:
        # Granted up front: one prefill worker answers one command at a time.
        pulls = [[granted(p.worker, plan(i, r)) for r in range(4)] for i in range(len(decodes))]
        threads = [
            threading.Thread(target=run, args=(i, s, pulls[i])) for i, s in enumerate(decodes)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(results) == 12
        assert all(r["ok"] and r["bad_blocks"] == 0 for r in results.values()), results
        done = _wait_events(p.worker, *results)
        assert set(results) <= set(done)
    finally:
        _close(*decodes, p)
