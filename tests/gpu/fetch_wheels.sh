#!/usr/bin/env bash
# Fetch, where PyPI is reachable, the wheels that tests/gpu/run_on_device.sh
# installs on a GPU machine that has no network: kvmap's dependencies that
# the GPU image lacks or has in too old a version. They land in .whl/ at the
# repository root (ignored through .git/info/exclude, so they travel only
# when a device run carries .whl). About 36 MB.
#
#   bash tests/gpu/fetch_wheels.sh [PYTHON_VERSION]    # default 3.12, the GPU image's python3
#
# nixl-cu13 is slimmed: its wheel also holds nixl_ep_cu13 (expert-parallel
# kernels for three torch versions, 28 MB packed) and UCX's perftest, which
# kvmap never loads; without them it fits a device run's 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/../.."
pyver=${1:-3.12}
dest=.whl
mkdir -p "$dest" .git/info
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude

# Versions as pyproject.toml pins them or .ci/setup resolves them. The GPU
# image brings torch (CUDA 13), numpy, pytest, pytest-timeout, hypothesis.
pkgs=(
  nixl==1.5.1 nixl-cu13==1.5.1
  grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1
  protobuf==7.36.2 structlog==26.1.0 prometheus-client==0.26.0
)
plats=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
  manylinux1_x86_64; do
  plats+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
  --implementation cp "${plats[@]}" -d "$dest" "${pkgs[@]}"

python3 - "$dest" <<'PY'
import pathlib, sys, zipfile

for whl in pathlib.Path(sys.argv[1]).glob("nixl_cu13-*.whl"):
    def keep(name: str) -> bool:
        return not (name.startswith("nixl_ep_cu13/") or "libucx_perftest" in name)
    with zipfile.ZipFile(whl) as src:
        names = [n for n in src.namelist() if keep(n)]
        if len(names) == len(src.namelist()):
            continue  # slimmed already
        slim = whl.with_suffix(".slim")
        with zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as out:
            for n in names:
                data = src.read(n)
                if n.endswith(".dist-info/RECORD"):
                    rows = data.decode().splitlines()
                    data = ("\n".join(r for r in rows if keep(r.split(",", 1)[0])) + "\n").encode()
                out.writestr(src.getinfo(n), data)
    slim.replace(whl)
    print(f"slimmed {whl.name}: {whl.stat().st_size / 2**20:.1f} MiB")
PY
du -ch "$dest"/*.whl | tail -1
