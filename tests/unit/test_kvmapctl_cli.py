"""kvmapctl's command line (targets, options anywhere, worker ids), the live
view's bookkeeping (engine.activity) and the pod's default target."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvmap.core.geometry import WorkerKey
from kvmap.core.transfer_requests import UseRelease
from kvmap.daemon.cli import kvmapctl
from kvmap.daemon.cli.status_tables import duration
from kvmap.daemon.engine.activity import MAX_ERROR_CHARS, RECENT_ERRORS, Activity

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("given", "env", "expected"),
    [
        ("/run/kvmap/kvmapd.sock", {}, "unix:///run/kvmap/kvmapd.sock"),
        ("unix:///run/kvmap/kvmapd.sock", {}, "unix:///run/kvmap/kvmapd.sock"),
        ("unix:/tmp/x.sock", {}, "unix:/tmp/x.sock"),
        ("10.0.0.7:50051", {}, "10.0.0.7:50051"),
        ("localhost:50051", {}, "localhost:50051"),
        ("dns:///kvmap.example:50051", {}, "dns:///kvmap.example:50051"),
        (None, {"KVMAP_TARGET": "/run/kvmap/kvmapd.sock"}, "unix:///run/kvmap/kvmapd.sock"),
        ("127.0.0.1:1", {"KVMAP_TARGET": "/elsewhere.sock"}, "127.0.0.1:1"),
    ],
)
def test_target_forms(given: str | None, env: dict[str, str], expected: str) -> None:
    """A path (bare or unix://) is a Unix socket, HOST:PORT and gRPC's own schemes pass as they
    are, and $KVMAP_TARGET counts only when --target is not given."""
    assert kvmapctl.resolve_target(given, env) == expected


def test_relative_socket_path_is_made_absolute(tmp_path: Path, monkeypatch: Any) -> None:
    """A relative socket path names a socket under the working directory."""
    monkeypatch.chdir(tmp_path)
    assert kvmapctl.resolve_target("run/kvmapd.sock", {}) == f"unix://{tmp_path}/run/kvmapd.sock"


def test_default_target_is_the_per_user_socket(monkeypatch: Any) -> None:
    """Without --target and $KVMAP_TARGET, the daemon's own default socket."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/7")
    assert kvmapctl.resolve_target(None, {}) == "unix:///run/user/7/kvmap/kvmapd.sock"


@pytest.mark.parametrize(
    ("argv", "output", "target", "timeout"),
    [
        (["workers", "--json"], "json", None, 5.0),
        (["--json", "workers"], "json", None, 5.0),
        (["workers", "-o", "wide"], "wide", None, 5.0),
        (["-o", "json", "status", "--target", "/s.sock"], "json", "/s.sock", 5.0),
        (["--target", "/a.sock", "--timeout", "2", "grants"], "table", "/a.sock", 2.0),
        (["peers", "--timeout=1.5", "--output=wide"], "wide", None, 1.5),
    ],
)
def test_options_go_anywhere(
    argv: list[str], output: str, target: str | None, timeout: float
) -> None:
    """The target, timeout and output options mean the same before and after the command, and one
    given before the command is not reset by the command's parser."""
    args = kvmapctl.parse_args(argv)
    assert (args.output, args.target, args.timeout) == (output, target, timeout)


def test_abbreviated_options_are_refused(capsys: Any) -> None:
    """`--tar` is no `--target`: a typo never silently means another option."""
    with pytest.raises(SystemExit) as exited:
        kvmapctl.parse_args(["workers", "--tar", "/s.sock"])
    assert exited.value.code == 2
    assert "--tar" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["regions", "engine-x"], ("engine-x", 0, 0, 0)),
        (["regions", "engine-x/dp1/tp2/pp3"], ("engine-x", 1, 2, 3)),
        (["regions", "org/model/dp0/tp4/pp0"], ("org/model", 0, 4, 0)),
        (["regions", "engine-x/dp1/tp2/pp3", "--tp-rank", "5"], ("engine-x", 1, 5, 3)),
        (["regions", "engine-x", "--dp-rank", "1"], ("engine-x", 1, 0, 0)),
    ],
)
def test_regions_takes_the_id_workers_prints(
    argv: list[str], expected: tuple[str, int, int, int]
) -> None:
    """`regions` takes ENGINE/dpN/tpN/ppN as `workers` prints it (engine ids may hold "/"), or an
    engine id with rank flags; a rank flag wins over the id's."""
    w = kvmapctl.worker_of(kvmapctl.parse_args(argv))
    assert (w.engine_id, w.dp_rank, w.tp_rank, w.pp_rank) == expected


@pytest.mark.parametrize(
    ("ms", "text"),
    [(0, "0ms"), (850, "850ms"), (4200, "4.2s"), (187_000, "3m07s"), (7_500_000, "2h05m")],
)
def test_ages_read_at_a_glance(ms: int, text: str) -> None:
    """Ages in the tables: milliseconds, seconds, then minutes and hours."""
    assert duration(ms) == text


def test_in_flight_transfers_are_listed_until_they_end() -> None:
    """A transfer begun is listed with its request, kind and an age from the clock, oldest first;
    once ended it is gone."""
    now = [100.0]
    activity = Activity(clock=lambda: now[0], wall=lambda: 5)
    key = WorkerKey("decode")
    first = activity.begin(UseRelease("r1", key, "h:1", WorkerKey("p"), "cap", 1, 5.0), "release")
    now[0] = 102.5
    second = activity.begin(UseRelease("r2", key, "h:1", WorkerKey("p"), "cap", 1, 5.0), "pull")
    assert [(t.request_id, t.kind) for t in activity.transfers()] == [
        ("r1", "release"),
        ("r2", "pull"),
    ]
    assert activity.age_s(first) == 2.5 and activity.age_s(second) == 0.0
    activity.end(first)
    assert [t.request_id for t in activity.transfers()] == ["r2"]


def test_recent_errors_keep_the_last_few_and_short() -> None:
    """The ring keeps only the last RECENT_ERRORS failures, each message cut to MAX_ERROR_CHARS:
    however many calls fail, it holds a bounded amount."""
    activity = Activity()
    for i in range(RECENT_ERRORS + 10):
        activity.failed("tcp", "BeginTransfer", "PERMISSION_DENIED", "x" * 10_000, f"id-{i}")
    kept = activity.failures()
    assert len(kept) == RECENT_ERRORS
    assert kept[0].request_id == "id-10" and kept[-1].request_id == f"id-{RECENT_ERRORS + 9}"
    assert {len(f.message) for f in kept} == {MAX_ERROR_CHARS}


def test_the_pods_kvmapctl_targets_the_pods_socket() -> None:
    """Inside the sidecar, kvmapctl's default ($KVMAP_TARGET in the manifest) is the socket that
    kvmapd.toml has the daemon serve."""
    config = tomllib.loads((REPO / "deploy/k8s/base/kvmapd.toml").read_text())
    docs = list(yaml.safe_load_all((REPO / "deploy/k8s/base/deployment.yaml").read_text()))
    pod = next(d for d in docs if d and d.get("kind") == "Deployment")["spec"]["template"]
    [sidecar] = [c for c in pod["spec"]["initContainers"] if c["name"] == "kvmapd"]
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert env["KVMAP_TARGET"] == f"unix://{config['socket']}"
