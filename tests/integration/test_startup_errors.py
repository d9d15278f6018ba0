"""Every configuration or start-up mistake, made as an operator makes it: a
real ``kvmapd`` process exits 2 with exactly one line on stderr that names
the key (as the flag or as ``key = value in FILE``) and the value, leaves no
socket file behind, and does so at once (each case is bounded in time)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmap.core.config import config_keys
from kvmap.tools.launch import local_env

pytestmark = pytest.mark.integration

CASE_TIMEOUT_S = 60
# (case, TOML file or None, arguments after `serve ...`, fragments of the one line).
# {cfg}: the TOML file; {d}: the case's directory; {busy}: a port another socket listens on.
SERVE_CASES = [
    ("socket", None, ["--socket", "{d}/a/b/c/s.sock"], ["--socket", "{d}/a/b/c/s.sock", "exists"]),
    ("listen", 'listen = "nohost"\n', [], ['listen = "nohost" in {cfg}', "HOST:PORT"]),
    ("listen-busy", None, ["--listen", "127.0.0.1:{busy}"], ["--listen", ":{busy}", "in use"]),
    ("planner", None, ["--planner", "nosuch"], ['--planner "nosuch"', "known: baseline, coalesce"]),
    ("planner-toml", 'planner = "Coalesce"\n', [], ['planner = "Coalesce" in {cfg}', "unknown"]),
    ("state_dir", None, ["--state-dir", "{cfg}"], ['--state-dir "{cfg}"', "not a directory"]),
    ("log_format", 'log_format = "xml"\n', [], ['log_format = "xml" in {cfg}', "json or console"]),
    ("log_level", None, ["--log-level", "loud"], ['--log-level "loud"', "debug, info"]),
    ("metrics_listen", None, ["--metrics-listen", "127.0.0.1:{busy}"],
     ["--metrics-listen", ":{busy}", "in use"]),
    ("fd_socket", None, ["--fd-socket", "{d}/x/y/s.fds"], ["--fd-socket", "{d}/x/y/s.fds"]),
    ("local_calls", 'local_calls = "yes"\n', [], ['local_calls = "yes" in {cfg}', "true or false"]),
    ("drain_seconds", 'drain_seconds = "10s"\n', [],
     ['drain_seconds = "10s" in {cfg}', "expected a number"]),
    ("drain_seconds-flag", None, ["--drain-seconds", "-1"], ["--drain-seconds -1.0", "negative"]),
    ("transfer_timeout_s", None, ["--transfer-timeout-s", "0"],
     ["--transfer-timeout-s 0.0", "positive"]),
    ("connect_timeout_s", "connect_timeout_s = 0\n", [],
     ["connect_timeout_s = 0 in {cfg}", "positive"]),
    ("restore_attach_grace_s", None, ["--restore-attach-grace-s", "-1"],
     ["--restore-attach-grace-s -1.0", "positive"]),
    ("attach_grace_s", "attach_grace_s = 0\n", [], ["attach_grace_s = 0 in {cfg}", "positive"]),
    ("max_workers", None, ["--max-workers", "0"], ["--max-workers 0", "positive integer"]),
    ("nixl_threads", "nixl_threads = 65\n", [], ["{cfg}", "nixl_threads", "between 0 and 64"]),
    ("peer_keepalive_s", None, ["--peer-keepalive-s", "-1"],
     ["--peer-keepalive-s -1", "0 to 3600"]),
    ("check_before_read", 'check_before_read = "yes"\n', [],
     ['check_before_read = "yes" in {cfg}', "true or false"]),
    ("max_registered_bytes", 'max_registered_bytes = "2TiB"\n', [],
     ['max_registered_bytes = "2TiB" in {cfg}', "expected an integer"]),
    ("shm_path_prefix", None, ["--shm-path-prefix", "dev/shm"],
     ['--shm-path-prefix "dev/shm"', "absolute"]),
    ("tls_cert", None, ["--tls-cert", "{d}/none.pem", "--tls-key", "{d}/none.pem"],
     ['--tls-cert "{d}/none.pem"', "cannot read"]),
    ("tls_cert-garbage", None, ["--tls-cert", "{cfg}", "--tls-key", "{cfg}"],
     ['--tls-cert "{cfg}"', "not a PEM certificate"]),
    ("tls_key", None, ["--tls-key", "{cfg}"], ["tls_cert and tls_key", "both or neither"]),
    ("tls_client_ca", 'tls_client_ca = "ca.pem"\n', [], ["{cfg}", "tls_client_ca", "tls_cert"]),
    ("peer_ca", None, ["--peer-ca", "ca.pem"], ["peer_ca need tls_cert"]),
    ("peer_allow", None, ["--peer-allow", "not@host"], ["--peer-allow", "not@host"]),
    ("peer_accept", 'peer_accept = ["300.1.1.1/8"]\n', [], ["{cfg}", "peer_accept", "300.1.1.1/8"]),
    ("peer_accept-string", 'peer_accept = "10.0.0.0/8"\n', [],
     ['peer_accept = "10.0.0.0/8" in {cfg}', "a list of strings"]),
    ("peer_identity", None, ["--peer-identity", "a.example"], ["peer_identit", "tls_cert"]),
    ("peer_secret_file", None, ["--peer-secret-file", "{d}/nope"],
     ["--peer-secret-file", "{d}/nope"]),
    ("otlp_traces_endpoint", None, ["--otlp-traces-endpoint", "grpc://collector:4317"],
     ["--otlp-traces-endpoint", "grpc://collector:4317", "HOST:PORT"]),
    ("toml-syntax", "drain_seconds = \n", [], ["{cfg}", "not valid TOML", "line 1"]),
    ("unknown-key", 'planer = "coalesce"\n', [], ["{cfg}", "unknown keys", "planer"]),
    ("abbreviated-flag", None, ["--plan", "coalesce"], ["unrecognized arguments: --plan"]),
]  # fmt: skip
# Cases that are no key of their own (the others' names start with their key).
NOT_KEYS = {"toml-syntax", "unknown-key", "abbreviated-flag"}


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port on 127.0.0.1 that another socket listens on for the test's length."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _kvmapd(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvmap.daemon.cli.kvmapd", *args], capture_output=True, text=True,
        timeout=CASE_TIMEOUT_S, env=local_env(cwd), cwd=cwd, check=False,
    )  # fmt: skip


def _one_line(out: subprocess.CompletedProcess[str]) -> str:
    """The refusal: exit 2, nothing on stdout, exactly one line on stderr."""
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stdout == ""
    assert out.stderr.endswith("\n") and out.stderr.count("\n") == 1, out.stderr
    return out.stderr


def test_the_table_covers_every_key() -> None:
    """Every configuration key has a case of its own in SERVE_CASES, so a key added later
    without a refusal of its bad values fails here."""
    covered = {case.split("-")[0] for case, *_ in SERVE_CASES if case not in NOT_KEYS}
    assert set(config_keys()) <= covered, set(config_keys()) - covered


@pytest.mark.parametrize(
    ("toml", "args", "fragments"), [c[1:] for c in SERVE_CASES], ids=[c[0] for c in SERVE_CASES]
)
def test_a_mistake_is_one_line_and_exit_2(
    tmp_path: Path, busy_port: int, toml: str | None, args: list[str], fragments: list[str]
) -> None:
    """kvmapd serve refuses the case's mistake with exit 2 and one line on stderr naming the key
    (its flag, or the key and its file), the value and the problem, and leaves no socket file
    in its runtime directory; a garbage certificate is not blamed on the port."""
    cfg = tmp_path / "kvmapd.toml"
    cfg.write_text(toml or "# nothing\n")
    run = tmp_path / "run"
    run.mkdir()

    def fill(text: str) -> str:
        return text.format(cfg=cfg, d=tmp_path, busy=busy_port)

    base = ["serve", "--socket", str(run / "s.sock")]
    if "listen" not in (toml or "") and "--listen" not in args:
        base += ["--listen", "127.0.0.1:0"]  # never the default port: others may hold it
    line = _one_line(
        _kvmapd([*base, *(["--config", str(cfg)] if toml else []), *map(fill, args)], tmp_path)
    )
    for fragment in map(fill, fragments):
        assert fragment in line, line
    assert "port" not in line or "--tls" not in line  # a certificate is not blamed on the port
    assert not {"s.sock", "s.sock.fds"} & set(p.name for p in run.iterdir())


def test_demo_refuses_zero_blocks_at_once(tmp_path: Path) -> None:
    """kvmapd demo --blocks 0 is refused in one line naming the flag, before any daemon starts
    (it used to hang for over a minute)."""
    out = _kvmapd(["demo", "--blocks", "0"], tmp_path)
    line = _one_line(out)
    assert "--blocks" in line and "at least 2" in line


def test_a_refused_start_is_one_json_record_under_log_format_json(
    tmp_path: Path, busy_port: int
) -> None:
    """Under --log-format json the one line of a refused start (here a busy --listen port,
    found before anything is created) is a JSON error record whose problem is the line the
    console format prints, and nothing is left behind."""
    sock = tmp_path / "k.sock"
    base = ["serve", "--socket", str(sock), "--listen", f"127.0.0.1:{busy_port}"]
    console = _one_line(_kvmapd([*base, "--log-format", "console"], tmp_path)).rstrip("\n")
    record = json.loads(_one_line(_kvmapd([*base, "--log-format", "json"], tmp_path)))
    assert record["event"] == "kvmapd_start_refused" and record["level"] == "error", record
    assert record["problem"] == console and "--listen" in console and "in use" in console
    assert not sock.exists()
