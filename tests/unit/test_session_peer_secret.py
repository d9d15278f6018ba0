"""Every daemon the harness starts in one process shares one peer secret,
even when they are started from several threads at once (the bench and the
load tool do): two secrets would make the daemons refuse each other."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from kvmap.tools import peers


def test_threads_starting_daemons_at_once_share_one_secret(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Eight threads asking at once for the process's secret all get the
    same file, made once (its making is slowed down here, so that without
    the lock every thread would find none yet and make its own)."""
    made: list[Path] = []
    real = peers.new_peer_secret

    def slow_new_peer_secret(folder: Path) -> Path:
        time.sleep(0.05)
        made.append(real(folder))
        return made[-1]

    monkeypatch.delenv(peers.SESSION_ENV, raising=False)
    monkeypatch.setattr(peers, "_session", None)
    monkeypatch.setattr(peers, "new_peer_secret", slow_new_peer_secret)
    gate = threading.Barrier(8)
    got: list[Path] = []

    def ask() -> None:
        gate.wait()
        got.append(peers.session_peer_secret())

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and set(got) == {made[0]}
