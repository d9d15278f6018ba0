"""kvmapd's configuration as an operator meets it, in-process: every key is a
flag whose help shows its default, no flag is abbreviated, ``check-config``
prints the effective configuration as TOML (secrets hidden) or refuses in
one line, the old ``peer_identities`` spelling still loads with a
deprecation line, and native output lines get their level."""

from __future__ import annotations

import argparse
import json
import tomllib
from pathlib import Path

import pytest

from kvmap.core.config import DaemonConfig, config_keys, exposure_warning
from kvmap.daemon.adapters.config_files import load_config, reload_config
from kvmap.daemon.adapters.logs import native_level, wrap_native_line
from kvmap.daemon.cli import kvmapd
from kvmap.daemon.version import VERSION


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmapd", allow_abbrev=False)
    kvmapd._add_serve(parser.add_subparsers(dest="command"))
    return parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]  # argparse keeps its subparsers privately


def test_every_key_is_a_flag_whose_help_shows_its_default() -> None:
    """Each configuration key has the flag of its name (dashes for underscores) and the flag's
    help ends with its default, so no key exists only in the file."""
    actions = {a.option_strings[0]: a for a in _serve_parser()._actions if a.option_strings}
    for key in config_keys():
        flag = "--" + key.replace("_", "-")
        assert flag in actions, flag
        assert "(default: " in (actions[flag].help or ""), flag


def test_flags_are_never_abbreviated(capsys: pytest.CaptureFixture[str]) -> None:
    """--plan is not taken for --planner: it is refused, exit 2, in one line."""
    with pytest.raises(SystemExit) as exit_:
        kvmapd.main(["serve", "--plan", "baseline"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --plan" in err and err.count("\n") == 1


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    """kvmapd --version prints kvmap's version (the constant) and exits 0."""
    with pytest.raises(SystemExit) as exit_:
        kvmapd.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvmapd {VERSION}"


def test_check_config_prints_the_effective_configuration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """check-config exits 0 and prints every key as TOML: the file's values, a flag winning over
    its key, the defaults, comma-separated lists split."""
    cfg = tmp_path / "kvmapd.toml"
    cfg.write_text('planner = "baseline"\ndrain_seconds = 4.5\nsocket = "/run/k.sock"\n')
    status = kvmapd.main(
        ["check-config", "--config", str(cfg), "--drain-seconds", "7",
         "--peer-accept", "10.0.0.0/8,192.168.0.0/16", "--log-level", "debug"]
    )  # fmt: skip
    assert status == 0
    printed = tomllib.loads(capsys.readouterr().out)
    assert set(printed) == set(config_keys())
    assert (printed["planner"], printed["drain_seconds"], printed["socket"]) == (
        "baseline", 7.0, "/run/k.sock"
    )  # fmt: skip
    assert printed["peer_accept"] == ["10.0.0.0/8", "192.168.0.0/16"]
    assert printed["log_level"] == "debug" and printed["connect_timeout_s"] == 3.0


def test_check_config_refuses_a_bad_file_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad value: exit 2, nothing on stdout, one line naming the key, the value and the file."""
    cfg = tmp_path / "kvmapd.toml"
    cfg.write_text('transfer_timeout_s = "30s"\n')
    assert kvmapd.main(["check-config", "--config", str(cfg)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert f'transfer_timeout_s = "30s" in {cfg}: expected a number' in err


def test_the_old_peer_identities_spelling_loads_with_a_note(tmp_path: Path) -> None:
    """peer_identities (the old key) still loads, as peer_identity, with a deprecation note
    naming both spellings; both at once are refused."""
    cfg = tmp_path / "kvmapd.toml"
    tls = 'tls_cert = "c"\ntls_key = "k"\ntls_client_ca = "ca"\n'
    cfg.write_text(tls + 'peer_identities = ["a.example"]\n')
    notes: list[str] = []
    config = load_config(str(cfg), {"socket": "/s"}, notes)
    assert config.peer_identities == ("a.example",)
    assert len(notes) == 1 and "peer_identities" in notes[0] and "peer_identity" in notes[0]
    cfg.write_text(tls + 'peer_identities = ["a.example"]\npeer_identity = ["b.example"]\n')
    with pytest.raises(ValueError, match="keep only peer_identity"):
        load_config(str(cfg), {"socket": "/s"})


def test_a_reload_keeps_the_flags_and_refuses_bad_values(tmp_path: Path) -> None:
    """reload_config (SIGHUP) reads the file again with the start's flags still winning, and a
    bad value in the file is refused naming the key, the value and the file."""
    cfg = tmp_path / "kvmapd.toml"
    cfg.write_text('planner = "coalesce"\ndrain_seconds = 5.0\n')
    running = load_config(str(cfg), {"socket": "/s", "drain_seconds": 9.0})
    cfg.write_text('planner = "baseline"\ndrain_seconds = 1.0\n')
    again = reload_config(running)
    assert (again.planner, again.drain_seconds) == ("baseline", 9.0)
    cfg.write_text('planner = "nosuch"\n')
    with pytest.raises(ValueError, match=f'planner = "nosuch" in {cfg}: unknown planner'):
        reload_config(running)


def test_listening_beyond_loopback_with_loopback_peers_is_warned_about() -> None:
    """0.0.0.0 with the loopback-only peer_accept gets a warning naming the settings to change;
    a pod network in peer_accept, or loopback listening, gets none."""
    assert "peer_accept" in exposure_warning(DaemonConfig(socket="/s", listen="0.0.0.0:50051"))
    wide = DaemonConfig(socket="/s", listen="0.0.0.0:1", peer_accept=("10.0.0.0/8",))
    assert exposure_warning(wide) == ""
    assert exposure_warning(DaemonConfig(socket="/s", listen="127.0.0.1:1")) == ""


@pytest.mark.parametrize(
    ("line", "level"),
    [
        ("E1201 18:30:17.1  5001 chttp2_transport.cc:1] connection refused", "error"),
        ("W1201 18:30:17.1  5001 log.cc:110] Log level DEBUG is not suitable", "warning"),
        ("I1201 18:30:17.1  5001 ev_epoll1_linux.cc:1] using epoll1", "info"),
        ("[1764613817.1] [host:5001:0] ucp_worker.c:1 UCX  WARN  no usable transports", "warning"),
        ("[1764613817.1] [host:5001:0] uct_iface.c:1 UCX  ERROR failed", "error"),
        ("Traceback (most recent call last):", "error"),
        ("[vm:27262:0:27269]       stubs.c:107  Assertion `0' failed", "critical"),
        (
            "[host:5001:0:5002] Caught signal 11 (Segmentation fault: address not mapped)",
            "critical",
        ),
        ("terminate called after throwing an instance of 'std::runtime_error'", "critical"),
        ("some library chatter", "info"),
    ],
)
def test_native_lines_are_wrapped_with_their_level(line: str, level: str) -> None:
    """A foreign line becomes a JSON object carrying it, its level read from glog's first letter
    or a level word; a JSON object line passes unchanged."""
    assert native_level(line) == level
    wrapped = json.loads(wrap_native_line(line))
    assert (wrapped["event"], wrapped["level"], wrapped["logger"]) == (line, level, "native")
    assert wrap_native_line('{"event": "x", "level": "info"}') == '{"event": "x", "level": "info"}'


@pytest.mark.parametrize("threads", [-1, 65, True, 2.0, "2"])
def test_nixl_threads_outside_0_to_64_or_not_an_int_is_refused(threads: object) -> None:
    """``nixl_threads`` must be an integer from 0 to 64: anything else is
    refused at load, naming the key, before any agent is made."""
    with pytest.raises((ValueError, TypeError), match="nixl_threads"):
        DaemonConfig(socket="/s", nixl_threads=threads).validated()  # type: ignore[arg-type]  # the bad value is the test


def test_nixl_threads_default_and_flag() -> None:
    """The default is two UCX threads; ``--nixl-threads 0`` turns them off."""
    assert DaemonConfig(socket="/s").validated().nixl_threads == 2
    args = _serve_parser().parse_args(["--nixl-threads", "0"])
    assert args.nixl_threads == 0


def test_check_before_read_is_on_by_default_and_turned_off_by_file_or_flag(
    tmp_path: Path,
) -> None:
    """Pulls wait for the owner's answer unless told otherwise: the default
    is on; ``check_before_read = false`` in the file or
    ``--no-check-before-read`` turns it off, and the flag wins over the file."""
    assert DaemonConfig(socket="/s").validated().check_before_read is True
    cfg = tmp_path / "kvmapd.toml"
    cfg.write_text("check_before_read = false\n")
    assert load_config(str(cfg), {"socket": "/s"}).check_before_read is False
    args = _serve_parser().parse_args(["--no-check-before-read"])
    assert args.check_before_read is False
    flags = {"socket": "/s", "check_before_read": True}
    assert load_config(str(cfg), flags).check_before_read is True
