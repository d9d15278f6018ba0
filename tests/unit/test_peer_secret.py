"""The peer secret file as kvmapd reads it (``adapters/peer_secret.py``) and
the constant-time comparison of what a caller presents
(``core.peer_policy.secret_matches``)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from kvmap.core.errors import ConfigError
from kvmap.core.peer_policy import MIN_PEER_SECRET_BYTES, secret_matches
from kvmap.daemon.adapters.peer_secret import read_peer_secret
from kvmap.tools.peers import new_peer_secret

SECRET = "s3cr3t-" * 6


def _file(tmp_path: Path, text: str | bytes, mode: int = 0o600) -> Path:
    path = tmp_path / "secret"
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    os.chmod(path, mode)
    return path


def test_a_private_file_gives_its_secret_without_surrounding_whitespace(tmp_path: Path) -> None:
    """Owner- and group-readable files (0600, 0440) are read, a trailing newline dropped; a
    symlink to one (how a Kubernetes Secret is mounted) is followed; the harness's own
    files pass."""
    for mode in (0o600, 0o440):
        assert read_peer_secret(str(_file(tmp_path, SECRET + "\n", mode))) == SECRET.encode()
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "secret")
    assert read_peer_secret(str(link)) == SECRET.encode()
    made = new_peer_secret(tmp_path / "harness")
    assert len(read_peer_secret(str(made))) >= MIN_PEER_SECRET_BYTES


@pytest.mark.parametrize(
    ("text", "mode", "problem"),
    [
        (SECRET, 0o644, "readable by others (mode 0644)"),
        (SECRET, 0o604, "readable by others"),
        ("short", 0o600, "holds 5 bytes; at least 16"),
        ("with spaces inside it!!", 0o600, "printable ASCII without spaces"),
        ("é" * 20, 0o600, "printable ASCII"),
        (b"x" * (64 * 1024 + 1), 0o600, "larger than 64 KiB"),
    ],
)
def test_a_file_that_is_no_private_secret_is_one_config_error(
    tmp_path: Path, text: str | bytes, mode: int, problem: str
) -> None:
    """World-readable, short, non-ASCII or huge files are refused with one ConfigError naming
    the key and the path."""
    path = _file(tmp_path, text, mode)
    with pytest.raises(ConfigError, match=re.escape(problem)) as err:
        read_peer_secret(str(path))
    assert err.value.key == "peer_secret_file" and err.value.value == str(path)


def test_a_missing_file_or_a_directory_is_refused(tmp_path: Path) -> None:
    """A path that does not exist, or a directory, is a ConfigError too."""
    with pytest.raises(ConfigError, match="cannot read it"):
        read_peer_secret(str(tmp_path / "nothing"))
    with pytest.raises(ConfigError):
        read_peer_secret(str(tmp_path))


def test_only_the_exact_secret_matches() -> None:
    """The secret matches as text or bytes; nothing, a prefix, a longer string or another
    secret does not."""
    secret = SECRET.encode()
    assert secret_matches(SECRET, secret) and secret_matches(secret, secret)
    for wrong in (None, "", SECRET[:-1], SECRET + "x", SECRET.upper()):
        assert not secret_matches(wrong, secret), wrong
